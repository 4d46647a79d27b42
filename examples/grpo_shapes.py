"""The GRPO learning demo: a tiny random-init Qwen3-VL, SFT'd briefly, then GRPO with an exact-match reward.

    OMP_NUM_THREADS=1 python examples/grpo_shapes.py    # seed 0, runs/grpo-shapes (~5 minutes on 2 CPU cores)
    OMP_NUM_THREADS=1 python examples/grpo_shapes.py --seed 1 --output-dir runs/grpo-shapes-1

Stage 1 is the two-stage preference demo's SFT config (configs/qwen3vl-tiny-pairs-sft.yaml: one large coloured
shape in a 64 px image, "What color is the shape?", 30 steps), which teaches the answer format and reads the
colours on some seeds only. Stage 2 is GRPO (vlmtrain.GRPOTrainer, TRL's vision layout: a conversational prompt
with an image placeholder and an ``images`` column) on new questions of the same kind: each prompt is answered
``num_generations`` times by sampling, and a completion earns 1 when it is exactly the right colour. The script
prints the held-out greedy exact match after SFT and after GRPO beside chance (one colour in six). Numbers, and
how they were measured: docs/grpo.md, "Proof that it learns".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SFT_CONFIG = ROOT / "configs" / "qwen3vl-tiny-pairs-sft.yaml"
GRPO = {  # stage 2's GRPOConfig (TRL's names)
    "num_generations": 8, "per_device_train_batch_size": 64, "max_completion_length": 8, "temperature": 0.2,
    "learning_rate": 3e-4, "max_steps": 60, "lr_scheduler_type": "constant", "weight_decay": 0.0, "beta": 0.0,
}


def exact_match(completions: list, answer: list[str], **kwargs: Any) -> list[float]:
    """The reward: 1.0 where the completion (its text) is the answer, else 0.0."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if t.strip() == a else 0.0 for t, a in zip(texts, answer, strict=True)]


class Questions:
    """Shapes questions (vlmtrain.tasks.shapes_pairs) as GRPO prompts in TRL's vision layout: ``prompt`` (a user
    turn with an image placeholder and the question), ``images`` and ``answer`` (the reward's keyword)."""

    def __init__(self, split: str, count: int, seed: int) -> None:
        from vlmtrain.tasks.shapes_pairs import ShapesPairs

        self.pairs = ShapesPairs(split, count, seed=seed)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict[str, Any]:
        pair = self.pairs[index]
        question = pair["texts"][0]["user"]
        return {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
                "images": pair["images"], "answer": pair["chosen"]}


def accuracy(checkpoint: str, pairs: Any) -> float:
    """Greedy exact match of a Hub VLM checkpoint on held-out questions (shapes_pairs' layout: ``images``,
    ``texts`` and the truth as ``chosen``)."""
    from vlmtrain import load_for_inference

    model, right = load_for_inference(checkpoint, "cpu", "float32"), 0
    for start in range(0, len(pairs), 50):
        batch = [pairs[i] for i in range(start, min(start + 50, len(pairs)))]
        answers = model.generate([{"images": p["images"], "texts": p["texts"]} for p in batch], max_new_tokens=8)
        right += sum(a.strip() == p["chosen"] for a, p in zip(answers, batch, strict=True))
    return right / len(pairs)


def sft(output_dir: Path, seed: int, pretrained: str | None, overrides: dict[str, Any] | None = None) -> str:
    """Stage 1: the preference demo's SFT config (``overrides``: its keys changed, e.g. ``train.max_steps``) from
    a tiny random-init Qwen3-VL; its last checkpoint."""
    from vlmtrain import run
    from vlmtrain.models.families import get_family

    if pretrained is None:
        pretrained = get_family("qwen3_vl").build_tiny(str(output_dir / "tiny-qwen3vl"), seed=seed)
    run.demo(output_dir=str(output_dir / "sft"), config=str(SFT_CONFIG), seed=seed,
             overrides={"model.pretrained": pretrained, **(overrides or {})})
    (checkpoint,) = (output_dir / "sft").glob("checkpoint-*")
    return str(checkpoint)


def grpo(stage1: str, output_dir: Path, seed: int, settings: dict[str, Any]) -> str:
    """Stage 2: GRPO from the stage-1 checkpoint on fresh training questions; the saved policy's directory."""
    import torch
    from transformers import AutoModelForImageTextToText

    from vlmtrain import GRPOConfig, GRPOTrainer
    from vlmtrain.models.families import get_family

    steps, rows = settings["max_steps"], settings["per_device_train_batch_size"]
    prompts = Questions("train", steps * rows // settings["num_generations"], seed=seed + 1000)
    args = GRPOConfig(str(output_dir / "grpo"), seed=seed, save_strategy="steps", save_steps=steps, report_to="none",
                      use_cpu=True, dataloader_num_workers=0, **{"logging_steps": 5, **settings})
    model = AutoModelForImageTextToText.from_pretrained(stage1, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=args, train_dataset=prompts,
                          processing_class=get_family("qwen3_vl").load_processor(stage1))
    trainer.train()
    return str(output_dir / "grpo" / f"checkpoint-{steps}")


def _pairs(settings: list[str]) -> dict[str, Any]:
    return {k: json.loads(v) for k, v in (s.split("=", 1) for s in settings)}


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run both stages and print the table; returns ``sft``, ``grpo`` (held-out greedy exact match) and
    ``chance``."""
    from vlmtrain.evaluation.preference_demo import table
    from vlmtrain.tasks.shapes_pairs import ShapesPairs
    from vlmtrain.tasks.shapes_scenes import ANSWERS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default="runs/grpo-shapes")
    p.add_argument("--seed", type=int, default=0, help="the model's initialization, the questions, the sampling")
    p.add_argument("--pretrained", help="a tiny Qwen3-VL to start from (default: built here, random init)")
    p.add_argument("--eval", type=int, default=300, help="held-out questions")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a GRPOConfig setting of stage 2, e.g. --set max_steps=20 (JSON values)")
    p.add_argument("--sft-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a key of stage 1's config, e.g. --sft-set train.max_steps=10 (JSON values)")
    opts = p.parse_args(argv)
    settings = {**GRPO, **_pairs(opts.set)}
    out = Path(opts.output_dir)
    stage1 = sft(out, opts.seed, opts.pretrained, _pairs(opts.sft_set))
    stage2 = grpo(stage1, out, opts.seed, settings)
    held_out = ShapesPairs("val", opts.eval, seed=opts.seed)
    result = {"sft": accuracy(stage1, held_out), "grpo": accuracy(stage2, held_out),
              "chance": 1 / len(ANSWERS["color"])}
    print(f"\nGRPO demo (seed {opts.seed}): {opts.eval} held-out questions, 'What color is the shape?'")
    print(table([("greedy exact match", [result["sft"], result["grpo"]], result["chance"])], ["SFT", "GRPO"]))
    print(f"  after SFT: {stage1}\n  after GRPO: {stage2}")
    return result


if __name__ == "__main__":
    main()
