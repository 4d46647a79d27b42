"""GRPO: vlmtrain's GRPOTrainer against TRL's, same tiny model, same prompts, same settings.

Each contender trains in a fresh process (so each peak resident memory is its own) from the same random-init
checkpoint (``--model llama``: a Llama of ``--hidden`` x 2 layers with a character tokenizer, on prompts of
random words; ``--model qwen3_vl``: the tiny Qwen3-VL of ``build_tiny``, on one 64 px image and a colour question
per prompt, TRL's vision layout) on the same prompts, with the same
GRPOConfig: ``--generations`` completions per prompt of up to ``--length`` tokens, sampled at temperature 1,
AdamW, fp32, no evaluation or checkpoints, a deterministic reward (the completion's share of vowels). A step is
one generation batch (rollout, scoring, one optimizer step); steps/s and completion tokens/s are timed over the
steps after the warm-up. At random init few completions stop early, so both sides generate about the same tokens
(the table shows each side's mean completion length). Never a pass/fail: numbers to read.

    python benchmarks/grpo.py                 # 12 steps of 4 prompts x 8 completions of up to 32 tokens
    python benchmarks/grpo.py --steps 3 --warmup 1 --hidden 32     # a smoke run (seconds)
    python benchmarks/grpo.py --model qwen3_vl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import tempfile

from contenders import add_contender_options, run_contenders, step_clock, trainer_classes

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,?"


def prompts(n: int, seed: int = 0) -> list[dict]:
    """Prompts of 8-24 characters of lowercase words."""
    rng = random.Random(seed)
    return [{"prompt": " ".join("".join(rng.choice(CHARS[:26]) for _ in range(rng.randint(2, 5)))
                                for _ in range(rng.randint(2, 4)))} for _ in range(n)]


def image_prompts(n: int, seed: int = 0) -> list[dict]:
    """One 64 px image of a coloured shape and "What color is the shape?" per prompt (vlmtrain.tasks.shapes_pairs),
    in TRL's vision layout."""
    from vlmtrain.tasks.shapes_pairs import ShapesPairs

    pairs = ShapesPairs("train", n, seed=seed)
    return [{"prompt": [{"role": "user", "content": [{"type": "image"},
                                                     {"type": "text", "text": p["texts"][0]["user"]}]}],
             "images": p["images"]} for p in pairs]


def vowel_share(completions: list, **kwargs: object) -> list[float]:
    """A deterministic reward with spread at random init: the share of vowels in the completion."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch in "aeiou" for ch in t) / max(len(t), 1) for t in texts]


def build(path: str, hidden: int) -> str:
    """A random-init Llama and its character tokenizer at ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vlmtrain.data.tokenizers import build_char_tokenizer

    tokenizer = build_char_tokenizer(CHARS)
    tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token = "<pad>", "<s>", "</s>"
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                                         eos_token_id=2))
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 2
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run_one(contender: str, path: str, opts: argparse.Namespace) -> dict:
    """Train one contender in this process; its step times, completion lengths and peak resident memory."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    torch.set_num_threads(opts.threads)
    config_class, trainer_class = trainer_classes(contender, "GRPO")
    stamps: list[float] = []

    rows = opts.prompts * opts.generations
    with tempfile.TemporaryDirectory() as out:
        args = config_class(out, per_device_train_batch_size=rows, num_generations=opts.generations,
                            max_completion_length=opts.length, temperature=1.0, max_steps=opts.steps,
                            learning_rate=1e-4, weight_decay=0.1, logging_steps=1, seed=0, bf16=False,
                            report_to="none", save_strategy="no", use_cpu=True, dataloader_num_workers=0,
                            disable_tqdm=True)
        if opts.model == "llama":
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            processing, data = AutoTokenizer.from_pretrained(path), prompts(opts.steps * opts.prompts)
        else:
            from vlmtrain.models.families import get_family

            model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
            processing, data = get_family("qwen3_vl").load_processor(path), image_prompts(opts.steps * opts.prompts)
        trainer = trainer_class(model=model, reward_funcs=vowel_share, args=args, processing_class=processing,
                                train_dataset=Dataset.from_list(data), callbacks=[step_clock(stamps)])
        trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    timed = len(stamps) - opts.warmup
    seconds = stamps[-1] - stamps[opts.warmup - 1]
    tokens = sum(lengths[opts.warmup:]) * rows
    return {"steps_per_s": timed / seconds, "tokens_per_s": tokens / seconds,
            "mean_length": sum(lengths) / len(lengths),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("llama", "qwen3_vl"), default="llama")
    p.add_argument("--steps", type=int, default=12, help="generation batches (= optimizer steps)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--generations", type=int, default=8, help="num_generations: completions per prompt")
    p.add_argument("--length", type=int, default=32, help="max_completion_length")
    p.add_argument("--hidden", type=int, default=128, help="the Llama's hidden size (--model llama)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each contender, alternating; the fastest counts")
    add_contender_options(p)
    opts = p.parse_args()
    if opts.warmup < 1 or opts.steps <= opts.warmup:
        p.error("--warmup must be >= 1 and below --steps (the timing starts after the warm-up's last step)")
    if opts.one:  # (a child process: one contender, its result as JSON on the last line)
        print(json.dumps(run_one(opts.one, opts.path, opts)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if opts.model == "llama":
            path = build(os.path.join(tmp, "llama"), opts.hidden)
        else:
            from vlmtrain.models.families import get_family

            path = get_family("qwen3_vl").build_tiny(os.path.join(tmp, "qwen3_vl"), seed=0)
        rounds = [run_contenders(__file__, path, opts) for _ in range(opts.rounds)]
    # each contender's fastest round: the one least slowed by whatever else the machine ran (TRL and vlmtrain
    # alternate, so a busy minute does not land on one side only)
    results = {name: max((r[name] for r in rounds), key=lambda r: r["steps_per_s"]) for name in rounds[0]}
    base = results["trl"]
    name = f"tiny Llama (hidden {opts.hidden}, 2 layers)" if opts.model == "llama" else "tiny Qwen3-VL (64 px images)"
    print(f"{name} GRPO, {opts.prompts} prompts x {opts.generations} "
          f"completions of up to {opts.length} tokens per step, steps {opts.warmup + 1}-{opts.steps} timed, "
          f"{opts.threads} threads, the fastest of {opts.rounds} rounds")
    print(f"{'contender':<10} {'steps/s':>8} {'x TRL':>6} {'tokens/s':>9} {'x TRL':>6} {'mean length':>12} "
          f"{'peak RSS GiB':>13} {'x TRL':>6}")
    for name, r in results.items():
        print(f"{name:<10} {r['steps_per_s']:>8.2f} {r['steps_per_s'] / base['steps_per_s']:>6.2f} "
              f"{r['tokens_per_s']:>9.1f} {r['tokens_per_s'] / base['tokens_per_s']:>6.2f} {r['mean_length']:>12.1f} "
              f"{r['peak_rss_gib']:>13.2f} {r['peak_rss_gib'] / base['peak_rss_gib']:>6.2f}")


if __name__ == "__main__":
    main()
