"""DPO on a VLM: vlmtrain's DPOTrainer against TRL's, same tiny Qwen3-VL, same pairs, same settings.

Each contender trains in a fresh process (so each peak resident memory is its own) from the same random-init
checkpoint on the same pairs in TRL's vision layout (two images per prompt by default), AdamW, fp32, no
evaluation or checkpoints; pairs/s is timed over the steps after the warm-up. TRL runs the vision tower on every
image twice per pair (chosen and rejected each carry the images); vlmtrain once.

    python benchmarks/preference.py                       # 24 steps of 4 pairs, 2 images of 224 x 224 each
    python benchmarks/preference.py --images 1 --size 112 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import tempfile

from contenders import add_contender_options, run_contenders, step_clock, trainer_classes


def pairs(n: int, images: int, size: int, seed: int = 0) -> list[dict]:
    """Pairs whose prompt shows ``images`` coloured images and whose answers are a few words each."""
    from PIL import Image

    rng = random.Random(seed)
    words = ["red", "blue", "green", "square", "circle", "two", "three", "a", "the", "big"]

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))

    return [{"images": [Image.new("RGB", (size, size), tuple(rng.randrange(256) for _ in range(3)))
                        for _ in range(images)],
             "prompt": [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text(3, 8)}]}],
             "chosen": [{"role": "assistant", "content": [{"type": "text", "text": text(2, 6)}]}],
             "rejected": [{"role": "assistant", "content": [{"type": "text", "text": text(2, 6)}]}]}
            for _ in range(n)]


def run_one(contender: str, path: str, opts: argparse.Namespace) -> dict:
    """Train one contender in this process; its step times and peak resident memory."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText

    from vlmtrain.models.families import get_family

    torch.set_num_threads(opts.threads)
    config_class, trainer_class = trainer_classes(contender, "DPO")
    stamps: list[float] = []

    with tempfile.TemporaryDirectory() as out:
        args = config_class(out, max_length=None, per_device_train_batch_size=opts.batch, max_steps=opts.steps,
                            learning_rate=1e-4, weight_decay=0.1, logging_steps=opts.steps, seed=0, bf16=False,
                            gradient_checkpointing=False, report_to="none", save_strategy="no",
                            use_cpu=True, dataloader_num_workers=0, eval_strategy="no", disable_tqdm=True)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
        trainer = trainer_class(model=model, args=args, processing_class=get_family("qwen3_vl").load_processor(path),
                                train_dataset=Dataset.from_list(pairs(opts.steps * opts.batch, opts.images, opts.size)),
                                callbacks=[step_clock(stamps)])
        trainer.train()
    timed = len(stamps) - opts.warmup
    return {"pairs_per_s": timed * opts.batch / (stamps[-1] - stamps[opts.warmup - 1]),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "loss": trainer.state.log_history[0].get("loss")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the timing")
    p.add_argument("--batch", type=int, default=4, help="pairs per step")
    p.add_argument("--images", type=int, default=2, help="images per prompt")
    p.add_argument("--size", type=int, default=224, help="image side in pixels")
    add_contender_options(p)
    opts = p.parse_args()
    if opts.one:  # (a child process: one contender, its result as JSON on the last line)
        print(json.dumps(run_one(opts.one, opts.path, opts)))
        return
    from vlmtrain.models.families import get_family

    with tempfile.TemporaryDirectory() as tmp:
        path = get_family("qwen3_vl").build_tiny(os.path.join(tmp, "qwen3_vl"), seed=0)
        results = run_contenders(__file__, path, opts)
    base = results["trl"]
    print(f"tiny Qwen3-VL DPO, {opts.batch} pairs/step, {opts.images} images of {opts.size}px per prompt, "
          f"steps {opts.warmup + 1}-{opts.steps} timed, {opts.threads} threads")
    print(f"{'contender':<10} {'pairs/s':>9} {'x TRL':>7} {'peak RSS GiB':>13} {'x TRL':>7} {'first loss':>11}")
    for name, r in results.items():
        print(f"{name:<10} {r['pairs_per_s']:>9.2f} {r['pairs_per_s'] / base['pairs_per_s']:>7.2f} "
              f"{r['peak_rss_gib']:>13.2f} {r['peak_rss_gib'] / base['peak_rss_gib']:>7.2f} {r['loss']:>11.5f}")


if __name__ == "__main__":
    main()
