"""Qwen3-VL 2B full fine-tune and 8B LoRA on one CUDA GPU: transformers' Trainer vs vlmtrain padded vs packed.

Models: the published Qwen3-VL-2B / -8B-Instruct configurations (text 2048 x 28 / 4096 x 36 layers, vision
1024 x 24 / 1152 x 27, vocabulary 151,936) built on the meta device, then materialised on the GPU in bf16 and
randomly initialised under --seed: every contender starts from the same weights (a checksum says so). The
processor is built offline (vlmtrain's byte-level Qwen tokenizer with Qwen's special tokens and chat template,
the checkpoints' image processing: patch 16, merge 2, at most 1,024 tokens per image); the model keeps the real
vocabulary size. Data: synthetic two-image samples (JPEG files, 448-896 px a side) with log-normal text lengths
(median ~200 tokens, at most 4,096), written once as a the_cauldron JSONL.

Contenders, one after the other in one process, each on the same samples in the same order (the same seeded
sampler permutation), batch size, steps, AdamW (fused on CUDA), linear schedule, clipping 1.0, bf16, attention
kernel (--attn), data-loader workers, activation checkpointing and torch.compile settings:

  transformers     transformers.Trainer + a batched processor collator with padding (one processor call per
                   batch, labels = the assistant answers), as its users write it; LoRA through peft
  transformers + liger   the same with TrainingArguments(use_liger_kernel=True) (Liger's RMSNorm, RoPE and fused
                   linear cross-entropy for Qwen3-VL); with --liger or --smoke; skipped without CUDA or
                   liger-kernel
  vlmtrain padded  vlmtrain's `hub_vlm` kind through run.build on a config (data.packing: false)
  vlmtrain packed  the same with data.packing: true; skipped, with vlmtrain's own message, where the installed
                   vlmtrain refuses packing for Hub VLMs
  (--liger: both vlmtrain contenders with train.use_liger_kernel: Liger's RMSNorm, RoPE, SwiGLU, vlmtrain's loss)
  vlmtrain budget  (only when named: --contender "vlmtrain budget") token-budget micro-batches: one packed row
                   of --budget-tokens per step, the vision tower padded to --budget-patches, text and vision
                   attention varlen_torch (gpu_hub_vlm_budget.py); its steps hold other samples than the
                   others' (left out of the same-first-batch check; its step-1 loss is still compared)

Setups: 2B full fine-tune (everything trains) and 8B LoRA (r 16, alpha 32, adapters on the language model's
linear layers; vision tower, projector and the rest frozen).

Measured per contender over steps --warmup+1 .. --steps: real tokens/s (text + image tokens, padding never),
TFLOP/s and MFU (vlmtrain.models.speed.flops: analytic model FLOPs, vision tower counted; MFU against --peak-tflops,
989 for H100/H200 bf16 by default), the peak torch.cuda.max_memory_allocated of the whole run (weights,
optimizer state, activations), the data-wait fraction (time the training loop waited for the next batch /
wall time), the loss at step 1 and the ratios to transformers. Timestamps after a CUDA sync at every step end;
batch counts are made where the collator runs (a loader worker), so counting never syncs the GPU. Checks
(exit 1 when one fails): every contender trained the same first batch (target count and id sum) from the same
weights with the same number of trainable parameters, and the step-1 losses agree within bf16 tolerance
(relative 1e-2).

    python benchmarks/gpu_hub_vlm.py                       # both setups, ~20 steps each: a few minutes on an H100
    python benchmarks/gpu_hub_vlm.py --only 8b-lora --steps 30 --batch-size 8
    python benchmarks/gpu_hub_vlm.py --no-activation-checkpointing --torch-compile
    python benchmarks/gpu_hub_vlm.py --only 2b-full --liger   # + transformers + liger, vlmtrain with Liger
    python benchmarks/gpu_hub_vlm.py --smoke               # the whole pipeline on tiny configs, 3 steps: on the GPU
                                                           # if there is one (a minute), else on CPU (the test)

Without CUDA (and without --smoke) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import platform
import sys
import tempfile
import time
import warnings

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_hub_vlm_budget as budget  # noqa: E402
import gpu_hub_vlm_parts as parts  # noqa: E402

import vlmtrain  # noqa: E402
from vlmtrain.trainer.setup import dataloader_workers  # noqa: E402

SETUPS = {"2b-full": ("2b", False), "8b-lora": ("8b", True)}
CONTENDERS = ("transformers", "transformers + liger", "vlmtrain padded", "vlmtrain packed", budget.NAME)
LIGER = "transformers + liger"  # (a default contender with --liger or --smoke only)
SAME_BATCHES = ("transformers", LIGER, "vlmtrain padded", "vlmtrain packed")  # (budget: its own samples per step)
DEFAULT_CONTENDERS = SAME_BATCHES  # (budget runs when named: --contender "vlmtrain budget")
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0}
LOSS_RTOL = 1e-2


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=sorted(SETUPS), action="append", help="run only this setup (repeatable)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per contender (default 20; 3 with "
                   "--smoke)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the rates (default 5)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per step (default 8)")
    p.add_argument("--lr", type=float, default=None, help="default 1e-5 full fine-tune, 1e-4 LoRA")
    p.add_argument("--workers", default="auto", help="data-loader workers for every contender (default auto: "
                   "vlmtrain's rule, min(4, cores - 2) on CUDA)")
    p.add_argument("--attn", default="sdpa", help="attention kernel for every contender: sdpa, eager, "
                   "flash_attention_2, ... (default sdpa)")
    p.add_argument("--vision-attn", choices=("same", "varlen"), default="same", help="the vision tower's "
                   "attention for every contender: same as --attn (transformers: one call per image) or varlen (one "
                   "torch varlen_attn call for all images: vlmtrain.models.vision.vision_attention, which vlmtrain's "
                   "model.attn_implementation: varlen_torch also sets)")
    p.add_argument("--text-attn", choices=("same", "varlen"), default="same", help="vlmtrain packed's text "
                   "attention: same as --attn (sdpa: a dense block-diagonal mask per row) or varlen "
                   "(model.attn_implementation: varlen_torch, per document with no mask; torch varlen_attn on CUDA)")
    budget.add_options(p)
    p.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="gradient/activation checkpointing in every contender (default on)")
    p.add_argument("--checkpointing-mode", choices=("full", "selective", "attention"), default="full",
                   help="vlmtrain's activation_checkpointing_kwargs mode: full (recompute whole layers, as "
                   "transformers), selective (keep matmul and attention outputs, recompute the rest) or attention "
                   "(keep attention outputs only); transformers' Trainer always full")
    p.add_argument("--torch-compile", action=argparse.BooleanOptionalAction, default=False,
                   help="torch.compile in every contender (default off)")
    p.add_argument("--liger", action="store_true", help="the vlmtrain contenders with train.use_liger_kernel "
                   "(Liger's RMSNorm, RoPE, SwiGLU; vlmtrain's own loss), and the 'transformers + liger' contender "
                   "among the defaults (needs CUDA and liger-kernel)")
    p.add_argument("--pad-to-multiple-of", type=int, default=None, help="vlmtrain padded: batch lengths rounded "
                   "up to a multiple (data.pad_to_multiple_of; fewer shapes to compile)")
    p.add_argument("--recompile-limit", type=int, default=None, help="torch._dynamo.config.recompile_limit "
                   "for --torch-compile (default torch's, 8: layers past it run eagerly)")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak bf16 TFLOP/s for MFU "
                   "(default: 989 on H100/H200, 312 on A100; none elsewhere)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", action="store_true", help="print each step's time and data wait on stderr")
    p.add_argument("--contender", choices=CONTENDERS, action="append", help="run only this contender "
                   "(repeatable; default transformers, vlmtrain padded and packed, and 'transformers + liger' with "
                   "--liger or --smoke: the ratios need transformers; 'vlmtrain budget' only when named)")
    p.add_argument("--profile", choices=CONTENDERS, action="append", help="profile this contender's 2 steps "
                   "after --warmup (torch.profiler; top operators by device time on stderr; repeatable); those "
                   "steps and the one after them (the report) are left out of the rates")
    p.add_argument("--stacks-after", type=float, default=None, help="print every thread's stack after this many "
                   "seconds (where a slow run spends its time)")
    p.add_argument("--out", default=None, help="where data and run dirs go (default: a temporary directory)")
    p.add_argument("--smoke", action="store_true", help="tiny Qwen3-VL configs, 3 steps, on the GPU if there "
                   "is one, else on CPU: checks the script end to end (numbers meaningless)")
    opts = p.parse_args(argv)
    if opts.smoke:
        opts.steps, opts.warmup, opts.batch_size = opts.steps or 3, 1, min(opts.batch_size, 2)
    opts.steps = opts.steps or 20
    if opts.steps <= max(opts.warmup, 1) + (3 if opts.profile else 0):
        p.error("--steps must exceed --warmup (and be at least 2), by 4 with --profile")
    return opts


def peak_tflops(opts: argparse.Namespace, device: torch.device) -> float | None:
    if opts.peak_tflops is not None or device.type != "cuda":
        return opts.peak_tflops
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def header(opts: argparse.Namespace, device: torch.device, workers: int) -> None:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    gpu += " (--smoke: tiny models, numbers meaningless)" if opts.smoke else ""
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  device {gpu}  torch {torch.__version__}  "
          f"transformers {transformers.__version__}  vlmtrain {vlmtrain.__version__}  python "
          f"{platform.python_version()}  cpus {os.cpu_count()}")
    print(f"batch {opts.batch_size} samples/step | {opts.steps} steps, rates over steps {max(opts.warmup, 1) + 1}.."
          f"{opts.steps}{f' but {opts.warmup + 1}..{opts.warmup + 3} (profiled)' if opts.profile else ''} | "
          f"attention {opts.attn}{' (vision: varlen)' if opts.vision_attn == 'varlen' else ''}"
          f"{' (vlmtrain packed text: varlen_torch)' if opts.text_attn == 'varlen' else ''} | activation "
          f"checkpointing "
          f"{(opts.checkpointing_mode if opts.checkpointing_mode != 'full' else 'on') if opts.activation_checkpointing else 'off'} | torch.compile "
          f"{'on' if opts.torch_compile else 'off'} (recompile limit {torch._dynamo.config.recompile_limit}) | "
          f"Liger kernels in vlmtrain {'on' if opts.liger else 'off'} | {workers} data-loader workers | seed "
          f"{opts.seed}")


def run_setup(name: str, opts: argparse.Namespace, device: torch.device, out: str, workers: int,
              peak: float | None) -> bool:
    size, lora = SETUPS[name]
    size = "tiny" if opts.smoke else size
    config = parts.model_config(size, opts.attn)
    processor = parts.processor_for(size)
    sub = os.path.join(out, name)
    samples = opts.batch_size * opts.steps
    if budget.NAME in (opts.contender or DEFAULT_CONTENDERS):  # (as many samples as its token budget takes)
        samples = max(samples, budget.samples_needed(opts, size))
    data = parts.write_samples(os.path.join(sub, "data"), samples, opts.seed, opts.smoke)
    model_dir = parts.write_model_dir(os.path.join(sub, "model"), config, processor)
    run_opts = argparse.Namespace(**{**vars(opts), "workers": workers,
                                     "lr": opts.lr or (1e-4 if lora else 1e-5)})
    setup = parts.Setup(size, lora, config, processor, data, model_dir, device, run_opts, sub)
    params = parts.parameter_count(config)
    print(f"\n== {name}: Qwen3-VL {size} ({params / 1e6:,.1f}M parameters, bf16), "
          f"{'LoRA r 16 on the language model, the rest frozen' if lora else 'every parameter trains'}, "
          f"lr {run_opts.lr:g}")

    results: dict[str, dict] = {}
    for contender in opts.contender or [c for c in DEFAULT_CONTENDERS if c != LIGER or opts.liger or opts.smoke]:
        if contender == LIGER and parts.liger_skip(device):
            results[contender] = {"skipped": parts.liger_skip(device)}
            continue
        meter = parts.Meter(device=device, progress=opts.progress,
                            profile_after=opts.warmup if contender in (opts.profile or ()) else None)
        print(f"  {contender} ...", file=sys.stderr, flush=True)
        parts.release()
        if device.type == "cuda":
            left = torch.cuda.memory_allocated(device) / 2**30
            if left > 0.5:
                print(f"  note: {left:.1f} GiB still allocated from the previous contender (counted in this peak)")
            torch.cuda.reset_peak_memory_stats(device)
        try:
            # (Liger swaps functions in transformers' modeling modules: put back for the next contender)
            with warnings.catch_warnings(), parts.modeling_globals_restored():
                warnings.simplefilter("ignore")
                if contender.startswith("transformers"):
                    history = parts.run_transformers(setup, meter, liger=contender == LIGER)
                else:
                    history = parts.run_vlmtrain(setup, meter, packed=contender.endswith("packed"),
                                                 budget=contender == budget.NAME)
        except parts.ConfigError as err:
            results[contender] = {"skipped": f"vlmtrain refuses it: {err}"}
            continue
        except torch.OutOfMemoryError:
            results[contender] = {"skipped": "out of GPU memory"}
            continue
        rates = meter.window(opts.warmup)
        results[contender] = {**rates, "loss1": parts.first_loss(history), "first": meter.first_batch,
                              "init": meter.init, "trainable": meter.trainable,
                              "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30
                              if device.type == "cuda" else math.nan}
        r = results[contender]
        print(f"  {contender} done after {time.perf_counter() - meter.created:.0f}s: {r['tokens_per_s']:.0f} tokens/s, "
              f"peak {r['peak_gib']:.1f} GiB, data wait {r['data_wait']:.1%}", file=sys.stderr, flush=True)
    return report(results, peak)


def report(results: dict[str, dict], peak: float | None) -> bool:
    base = results.get("transformers", {})
    print(f"  {'contender':<20} {'tokens/s':>10} {'x tf':>6} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9} "
          f"{'x tf':>6} {'data wait':>9} {'fill':>5} {'loss @1':>9}")
    for name in CONTENDERS:
        if name not in results:  # (--contender)
            continue
        r = results[name]
        if "skipped" in r:
            print(f"  {name:<20} skipped: {r['skipped']}")
            continue
        tf, mem = r["flops_per_s"] / 1e12, r["peak_gib"]
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if "tokens_per_s" in base else math.nan
        mem_ratio = mem / base["peak_gib"] if "peak_gib" in base else math.nan
        mfu = f"{tf / peak:.1%}" if peak else "-"
        mem_s, mem_r = (f"{mem:.2f}", f"{mem_ratio:.2f}") if math.isfinite(mem) else ("-", "-")
        print(f"  {name:<20} {r['tokens_per_s']:>10.1f} {ratio:>6.2f} {tf:>8.2f} {mfu:>6} {mem_s:>9} "
              f"{mem_r:>6} {r['data_wait']:>9.1%} {r['fill']:>5.2f} {r['loss1']:>9.5f}")
    ran = {k: r for k, r in results.items() if "skipped" not in r}
    if LIGER in ran:  # (the issue's bar: vlmtrain against transformers' best setup)
        lg = ran[LIGER]
        print("  vs transformers + liger: " + "; ".join(
            f"{k} {r['tokens_per_s'] / lg['tokens_per_s']:.2f}x tokens/s at {r['peak_gib'] / lg['peak_gib']:.2f}x "
            f"peak memory" for k, r in ran.items() if k.startswith("vlmtrain")))
    if len(ran) < 2:  # (e.g. out of memory): a finding, not a failed check
        print(f"  {len(ran)} contender(s) ran: nothing to compare")
        return True
    same = {k: r for k, r in ran.items() if k in SAME_BATCHES} or ran
    firsts = {r["first"] for r in same.values()}
    losses = [r["loss1"] for r in ran.values()]  # (budget too: a random init's loss hardly depends on the batch)
    same_data = len(firsts) == 1 and None not in firsts
    inits = {r["init"] for r in ran.values()}
    same_init = len(inits) == 1 and None not in inits
    trains = {r["trainable"] for r in ran.values()}
    same_trainable = len(trains) == 1 and None not in trains
    agree = all(math.isfinite(v) for v in losses) and (max(losses) - min(losses)) <= LOSS_RTOL * abs(min(losses))
    print(f"  same weights at the start (checksums {sorted(inits, key=str)}): {'yes' if same_init else 'NO'} | "
          f"same trainable parameters ({', '.join(f'{t:,}' for t in sorted(trains, key=str) if t)}): "
          f"{'yes' if same_trainable else 'NO'} | "
          f"same first batch (targets, id sum) {sorted(firsts, key=str)}: {'yes' if same_data else 'NO'} | "
          f"step-1 losses within {LOSS_RTOL:g} relative: {'yes' if agree else 'NO'}")
    return same_init and same_trainable and same_data and agree


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    if not torch.cuda.is_available() and not opts.smoke:
        print("benchmarks/gpu_hub_vlm.py needs a CUDA GPU (none is visible here); nothing was measured. "
              "Run it on a GPU machine, or with --smoke to check the script on CPU with tiny models.")
        return 0
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    workers = dataloader_workers(int(opts.workers) if opts.workers != "auto" else "auto",
                                 cuda=device.type == "cuda")
    if opts.recompile_limit is not None:
        torch._dynamo.config.recompile_limit = opts.recompile_limit
    header(opts, device, workers)
    print("goals: vlmtrain packed >= 1.5x transformers' tokens/s and <= 0.7x its peak memory; vlmtrain padded "
          ">= 1.0x; MFU >= 40%; data wait <= 5%")
    peak = peak_tflops(opts, device)
    if opts.stacks_after:
        faulthandler.dump_traceback_later(opts.stacks_after, exit=False)
    ok = True
    with tempfile.TemporaryDirectory(prefix="gpu_hub_vlm_") as tmp:
        out = opts.out or tmp
        for name in opts.only or list(SETUPS):
            ok = run_setup(name, opts, device, out, workers, peak) and ok
    print("\nall checks passed" if ok else "\nA CHECK FAILED (see NO above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
