"""GRPO: vlmtrain's GRPOTrainer against TRL's, same model, same prompts, same settings.

Each contender trains in a fresh process (so each peak memory is its own) from the same random-init weights
(``--model llama``: a Llama of ``--hidden`` x 2 layers with a character tokenizer, on prompts of random words;
``--model qwen3_vl``: the tiny Qwen3-VL of ``build_tiny``, on one 64 px image and a colour question per prompt,
TRL's vision layout; ``--model qwen3_vl_2b``: Qwen3-VL-2B-Instruct's published configuration built random-init in
bf16 on the GPU by benchmarks/gpu_hub_vlm_models.py, with its offline processor, on one ``--image-size`` px image
(448 by default) and a colour question per prompt; ``--smoke`` builds the family's tiny configuration instead, for
a run of seconds on CPU) on the same prompts, with the same GRPOConfig: ``--generations`` completions per prompt
of up to ``--length`` tokens, sampled at temperature 1 with ``model.generate`` (``use_vllm`` off: TRL's default),
AdamW, gradient checkpointing (GRPOConfig's default), fp32 (the tiny models) or bf16 (qwen3_vl_2b), no evaluation
or checkpoints, a deterministic reward (the completion's share of vowels). ``--lora``: the same peft LoraConfig
(r 16, alpha 32, the language model's linear layers: gpu_hub_vlm_parts.LORA) handed to both trainers as
``peft_config``. A step is one generation batch (rollout, scoring, one optimizer step); steps/s, completions/s
and completion tokens/s are timed over the steps after the warm-up (after a CUDA sync on a GPU). At random init
few completions stop early, so both sides generate about the same tokens (the table shows each side's mean
completion length). Peak memory: resident (RSS) and, on CUDA, ``torch.cuda.max_memory_allocated``. Never a
pass/fail: numbers to read (the start weights' checksums are compared and said).

    python benchmarks/grpo.py                 # 12 steps of 4 prompts x 8 completions of up to 32 tokens
    python benchmarks/grpo.py --steps 3 --warmup 1 --hidden 32     # a smoke run (seconds)
    python benchmarks/grpo.py --model qwen3_vl
    python benchmarks/grpo.py --model qwen3_vl_2b --lora --steps 5 --warmup 2 --rounds 1 --length 128   # a GPU
    python benchmarks/grpo.py --model qwen3_vl_2b --lora --smoke   # the same code path on tiny dims (CPU, seconds)
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


def image_prompts(n: int, seed: int = 0, size: int = 64) -> list[dict]:
    """One image of a coloured shape (64 px, scaled to ``size`` px a side) and "What color is the shape?" per
    prompt (vlmtrain.tasks.shapes_pairs), in TRL's vision layout."""
    from vlmtrain.tasks.shapes_pairs import ShapesPairs

    pairs = ShapesPairs("train", n, seed=seed)
    return [{"prompt": [{"role": "user", "content": [{"type": "image"},
                                                     {"type": "text", "text": p["texts"][0]["user"]}]}],
             "images": [image if size == image.width else image.resize((size, size)) for image in p["images"]]}
            for p in pairs]


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


def load(path: str, opts: argparse.Namespace, device: object) -> tuple[object, object, list[dict]]:
    """(model, processing class, prompts) of ``opts.model``: the tiny ones from ``path``, Qwen3-VL-2B (or, with
    --smoke, the family's tiny configuration) random-init in bf16 on ``device`` under seed 0, as
    benchmarks/gpu_hub_vlm.py builds it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    n = opts.steps * opts.prompts
    if opts.model == "llama":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return model, AutoTokenizer.from_pretrained(path), prompts(n)
    if opts.model == "qwen3_vl":
        from vlmtrain.models.families import get_family

        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
        return model, get_family("qwen3_vl").load_processor(path), image_prompts(n)
    import gpu_hub_vlm_models as hub  # (beside this file)

    size = "tiny" if opts.smoke else "2b"
    model = hub.build_model(hub.model_config(size, "sdpa"), device, seed=0)
    model.config.use_cache = True  # (build_model turns the cache off for training; generation wants it)
    return model, hub.processor_for(size), image_prompts(n, size=opts.image_size)


def lora_config() -> object:
    """The peft LoraConfig both contenders get as ``peft_config``: benchmarks/gpu_hub_vlm.py's (r 16, alpha 32,
    the language model's linear layers)."""
    import peft
    from gpu_hub_vlm_parts import LORA, LORA_TARGETS

    return peft.LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules=LORA_TARGETS)


def run_one(contender: str, path: str, opts: argparse.Namespace) -> dict:
    """Train one contender in this process; its step times, completion lengths, start checksum and peak memory."""
    import torch
    from datasets import Dataset

    torch.set_num_threads(opts.threads)
    cuda = torch.cuda.is_available() and opts.model == "qwen3_vl_2b"
    device = torch.device("cuda" if cuda else "cpu")
    config_class, trainer_class = trainer_classes(contender, "GRPO")
    stamps: list[float] = []

    rows = opts.prompts * opts.generations
    with tempfile.TemporaryDirectory() as out:
        args = config_class(out, per_device_train_batch_size=rows, num_generations=opts.generations,
                            max_completion_length=opts.length, temperature=1.0, max_steps=opts.steps,
                            learning_rate=1e-4, weight_decay=0.1, logging_steps=1, seed=0,
                            bf16=opts.model == "qwen3_vl_2b", report_to="none", save_strategy="no", use_cpu=not cuda,
                            dataloader_num_workers=0, disable_tqdm=True)
        model, processing, data = load(path, opts, device)
        with torch.no_grad():
            start = float(sum(p.detach().float().sum() for p in model.parameters()))
        torch.manual_seed(0)  # (the LoRA adapters' init: TRL draws them before seeding, vlmtrain after)
        trainer = trainer_class(model=model, reward_funcs=vowel_share, args=args, processing_class=processing,
                                train_dataset=Dataset.from_list(data), callbacks=[step_clock(stamps)],
                                **({"peft_config": lora_config()} if opts.lora else {}))
        trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    timed = len(stamps) - opts.warmup
    seconds = stamps[-1] - stamps[opts.warmup - 1]
    tokens = sum(lengths[opts.warmup:]) * rows
    return {"steps_per_s": timed / seconds, "completions_per_s": timed * rows / seconds,
            "tokens_per_s": tokens / seconds, "mean_length": sum(lengths) / len(lengths),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad), "start": start}


SMOKE = {"steps": 3, "warmup": 1, "rounds": 1, "prompts": 2, "generations": 4, "length": 8}
"""--smoke's sizes (each one still set by its own option)."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The options; --smoke's sizes as the defaults where --smoke is given (an option given still wins)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("llama", "qwen3_vl", "qwen3_vl_2b"), default="llama")
    p.add_argument("--steps", type=int, default=12, help="generation batches (= optimizer steps)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--generations", type=int, default=8, help="num_generations: completions per prompt")
    p.add_argument("--length", type=int, default=32, help="max_completion_length")
    p.add_argument("--hidden", type=int, default=128, help="the Llama's hidden size (--model llama)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each contender, alternating; the fastest counts")
    p.add_argument("--lora", action="store_true", help="both trainers get the same peft LoraConfig (peft_config)")
    p.add_argument("--image-size", type=int, help="--model qwen3_vl_2b: the image side in px (448; --smoke 64)")
    p.add_argument("--smoke", action="store_true",
                   help=f"--model qwen3_vl_2b on the family's tiny configuration, with {SMOKE}: seconds on CPU")
    add_contender_options(p)
    opts = p.parse_args(argv)
    if opts.smoke:
        p.set_defaults(**SMOKE)
        opts = p.parse_args(argv)
    if opts.image_size is None:
        opts.image_size = 64 if opts.smoke else 448
    if opts.warmup < 1 or opts.steps <= opts.warmup:
        p.error("--warmup must be >= 1 and below --steps (the timing starts after the warm-up's last step)")
    if (opts.smoke or opts.lora) and opts.model != "qwen3_vl_2b":
        p.error("--smoke and --lora are for --model qwen3_vl_2b")
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    if opts.one:  # (a child process: one contender, its result as JSON on the last line)
        print(json.dumps(run_one(opts.one, opts.path, opts)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if opts.model == "llama":
            path = build(os.path.join(tmp, "llama"), opts.hidden)
        elif opts.model == "qwen3_vl":
            from vlmtrain.models.families import get_family

            path = get_family("qwen3_vl").build_tiny(os.path.join(tmp, "qwen3_vl"), seed=0)
        else:  # (each contender builds the model itself, on its device: nothing to write)
            path = tmp
        rounds = [run_contenders(__file__, path, opts) for _ in range(opts.rounds)]
    # each contender's fastest round: the one least slowed by whatever else the machine ran (TRL and vlmtrain
    # alternate, so a busy minute does not land on one side only)
    results = {name: max((r[name] for r in rounds), key=lambda r: r["steps_per_s"]) for name in rounds[0]}
    report(results, opts)


def report(results: dict[str, dict], opts: argparse.Namespace) -> None:
    """The table: each contender's rates and peak memory, beside TRL's."""
    base = results["trl"]
    name = {"llama": f"tiny Llama (hidden {opts.hidden}, 2 layers)", "qwen3_vl": "tiny Qwen3-VL (64 px images)",
            "qwen3_vl_2b": f"{'tiny Qwen3-VL (--smoke)' if opts.smoke else 'Qwen3-VL-2B (random init, bf16)'}"
                           f"{' LoRA' if opts.lora else ''}, {opts.image_size} px images"}[opts.model]
    gpu = base["peak_gpu_gib"] is not None
    print(f"{name} GRPO, {opts.prompts} prompts x {opts.generations} "
          f"completions of up to {opts.length} tokens per step, steps {opts.warmup + 1}-{opts.steps} timed, "
          f"{'CUDA' if gpu else f'{opts.threads} threads'}, the fastest of {opts.rounds} rounds")
    print(f"{'contender':<10} {'steps/s':>8} {'completions/s':>14} {'x TRL':>6} {'tokens/s':>9} {'x TRL':>6} "
          f"{'mean length':>12} {'peak RSS GiB':>13} {'x TRL':>6}" + (f" {'peak GPU GiB':>13} {'x TRL':>6}" if gpu else ""))
    for name, r in results.items():
        print(f"{name:<10} {r['steps_per_s']:>8.2f} {r['completions_per_s']:>14.2f} "
              f"{r['steps_per_s'] / base['steps_per_s']:>6.2f} "
              f"{r['tokens_per_s']:>9.1f} {r['tokens_per_s'] / base['tokens_per_s']:>6.2f} {r['mean_length']:>12.1f} "
              f"{r['peak_rss_gib']:>13.2f} {r['peak_rss_gib'] / base['peak_rss_gib']:>6.2f}"
              + (f" {r['peak_gpu_gib']:>13.2f} {r['peak_gpu_gib'] / base['peak_gpu_gib']:>6.2f}" if gpu else ""))
    starts = sorted({r["start"] for r in results.values()})
    trainable = sorted({r["trainable"] for r in results.values()})
    print(f"same weights at the start (checksums {starts}): {'yes' if len(starts) == 1 else 'NO'}; "
          f"same trainable parameters ({', '.join(f'{t:,}' for t in trainable)}): "
          f"{'yes' if len(trainable) == 1 else 'NO'}")


if __name__ == "__main__":
    main()
