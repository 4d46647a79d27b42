"""A Hub VLM (tiny Qwen3-VL) trained by vlmtrain.Trainer, by transformers.Trainer and by a bare loop, side by side.

All contenders train the same tiny random-init Qwen3-VL (written once by the qwen3_vl family's build_tiny, loaded
by each with AutoModelForImageTextToText.from_pretrained, fp32 unless --bf16) on the same two-image shapes-VQA
samples, served in the same order, with the same batch size, steps, AdamW (lr, no weight decay), linear schedule
without warmup, gradient clipping at 1.0, no accumulation and dataloader_num_workers=0:

  transformers  transformers.Trainer (report_to="none") with a hand-written collator as seed 000 writes one:
                the chat template rendered per sample, ONE batched processor call (padding=True, right side)
                that concatenates pixel_values / image_grid_thw and pads mm_token_type_ids, and labels built
                by masking everything but each assistant answer + <|im_end|> (found after the
                "<|im_start|>assistant\\n" header tokens)
  vlmtrain      vlmtrain.Trainer with HubVLMProcessor + HubVLMCollator as the hub_vlm kind builds them (per-sample
                apply_chat_template with the family's training template and return_assistant_tokens_mask;
                no generation prompts: the kind makes those only for evaluation batches, and only with
                train.predict_with_generate)
  bare          forward, backward, clip_grad_norm_, AdamW.step, LambdaLR.step, zero_grad over batches that
                were collated BEFORE timing (the floor: model work only)

The script first checks that the two collators produce the same batch, key by key (so the losses are
comparable), and times each collator alone on the training batches (ms per batch, outside any training).
Timing: a timestamp (wall-clock and process CPU time) at the end of every optimizer step (after a CUDA sync);
steps/s is measured over steps --warmup+1 .. --steps (model loading, setup and the first steps left out). Contenders run interleaved for --repeats rounds, the
order rotating; the table gives medians. Peak memory per run: on CUDA torch.cuda.max_memory_allocated (model,
optimizer state, activations; reset before each run); on CPU the peak resident set size (RSS, sampled every
5 ms by a thread, psutil) minus the RSS at the start of the run, after gc and malloc_trim: it includes the
model load and allocator caching, and is only good to a few MB. Losses: the last logged training loss (a
logging window's average: transformers averages the per-step means, vlmtrain weights each step by its target
tokens, so they differ a little when steps have different token counts) and the loss of each trained model on
a fixed held-out probe batch (eval mode), which must agree across contenders.

    python benchmarks/hub_vlm.py                          # CPU: about 2 minutes on 2 busy cores
    python benchmarks/hub_vlm.py --steps 60 --repeats 3
    python benchmarks/hub_vlm.py --device cuda --batch-size 16 --steps 100 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import io
import math
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from typing import Any

import psutil
import torch
import transformers
from torch.utils.data import Dataset
from transformers import AutoModelForImageTextToText

import vlmtrain
from vlmtrain.data.hub_collate import HubVLMCollator
from vlmtrain.data.hub_processing import HubVLMProcessor, build_messages
from vlmtrain.models.families import get_family
from vlmtrain.tasks.shapes import ShapesVQA

CONTENDERS = ("transformers", "vlmtrain", "bare")
MODEL_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw", "labels")
LR = 1e-3
MAX_GRAD_NORM = 1.0
TRAINER_SEED = 42


# -- data ---------------------------------------------------------------------------------------------------
class InOrder(Dataset):
    """Samples served in a fixed order whatever index a sampler asks for: every trainer's sampler does its usual
    work, yet all contenders train on the same sequence of batches (needs dataloader_num_workers=0)."""

    def __init__(self, samples: list[dict[str, Any]]) -> None:
        self.samples = samples
        self.served = 0

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = self.samples[self.served % len(self.samples)]
        self.served += 1
        return sample


class HandWrittenCollator:
    """What a transformers.Trainer user writes for Qwen3-VL: render each
    conversation with the processor's chat template, make one batched processor call (it concatenates
    ``pixel_values`` and ``image_grid_thw`` over all images in placeholder order and pads ``mm_token_type_ids``
    like ``input_ids``), then labels = input_ids on the assistant answers and their <|im_end|>, -100 elsewhere."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        tok = processor.tokenizer
        self.header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
        self.end = tok.convert_tokens_to_ids("<|im_end|>")

    def labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        labels = torch.full_like(input_ids, -100)
        h = len(self.header)
        for row, ids in enumerate(input_ids.tolist()):
            i = 0
            while i + h <= len(ids):
                if ids[i:i + h] != self.header:
                    i += 1
                    continue
                start = i = i + h  # the answer starts after the header ...
                while i < len(ids) and ids[i] != self.end:
                    i += 1
                stop = min(i + 1, len(ids))  # ... and ends with <|im_end|>, included
                labels[row, start:stop] = input_ids[row, start:stop]
        return labels

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        texts, images = [], []
        for s in samples:
            turns = [(t["user"], t["assistant"]) for t in s["texts"]]
            texts.append(self.processor.apply_chat_template(build_messages(turns, s["images"]), tokenize=False))
            images.extend(s["images"])
        batch = dict(self.processor(text=texts, images=images or None, padding=True, padding_side="right",
                                    return_tensors="pt"))
        batch["labels"] = self.labels(batch["input_ids"])
        return batch


def vlmtrain_collator(processor: Any, prompts: bool = False) -> HubVLMCollator:
    """HubVLMProcessor + HubVLMCollator with the hub_vlm kind's training settings (no heads; generation prompts
    only in evaluation batches when evaluation generates, i.e. train.predict_with_generate)."""
    return HubVLMCollator(HubVLMProcessor(processor, get_family("qwen3_vl"), prompts=prompts),
                          label_collate=lambda heads: {})


def batches_of(samples: list[dict[str, Any]], size: int) -> list[list[dict[str, Any]]]:
    return [samples[i:i + size] for i in range(0, len(samples), size)]


# -- measurement helpers ------------------------------------------------------------------------------------
class PeakMemory:
    """Peak memory over a block: CUDA max_memory_allocated, or peak RSS minus the RSS at the start (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.peak = device, 0
        self._stop = threading.Event()

    def _sample(self, proc: psutil.Process) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, proc.memory_info().rss)

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            with contextlib.suppress(OSError, AttributeError):  # glibc: give freed heap back to the OS
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            proc = psutil.Process()
            self.start = self.peak = proc.memory_info().rss
            self._thread = threading.Thread(target=self._sample, args=(proc,), daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._thread.join()
        self.delta_mb = (self.peak - self.start) / 2**20


def load_model(opts: argparse.Namespace) -> torch.nn.Module:
    model = AutoModelForImageTextToText.from_pretrained(opts.model_dir, dtype=torch.float32)
    return model.to(opts.device)


def probe_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], opts: argparse.Namespace) -> float:
    model.eval()
    with torch.no_grad(), autocast(opts):
        return float(model(**{k: v.to(opts.device) for k, v in batch.items()}).loss)


def autocast(opts: argparse.Namespace) -> contextlib.AbstractContextManager:
    return torch.autocast(opts.device.type, dtype=torch.bfloat16) if opts.bf16 else contextlib.nullcontext()


def stamp(opts: argparse.Namespace) -> tuple[float, float]:
    """(wall-clock, process CPU time) now; on CUDA after the queued kernels have finished."""
    if opts.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter(), time.process_time()


def _last_loss(log_history: list[dict]) -> float:
    return next((float(h["loss"]) for h in reversed(log_history) if "loss" in h), math.nan)


# -- the contenders: each returns (timestamps at each optimizer step's end, last logged loss, model) --------------
Run = tuple[list[tuple[float, float]], float, torch.nn.Module]


def run_bare(opts: argparse.Namespace, data: dict[str, Any], out_dir: str) -> Run:
    model = load_model(opts)
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, (opts.steps - s) / opts.steps))
    stamps, last_loss, running, since = [], math.nan, torch.zeros((), device=opts.device), 0
    model.train()
    for step, batch in enumerate(data["collated"], start=1):
        with autocast(opts):
            loss = model(**{k: v.to(opts.device, non_blocking=True) for k, v in batch.items()}).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        running += loss.detach()
        since += 1
        stamps.append(stamp(opts))
        if step % opts.logging_steps == 0 or step == opts.steps:
            last_loss, since = running.item() / since, 0
            running.zero_()
        if step == opts.steps:
            break
    return stamps, last_loss, model


class _VlmStamps(vlmtrain.TrainerCallback):
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts, self.stamps = opts, []

    def on_step_end(self, args, state, control, **kwargs):
        self.stamps.append(stamp(self.opts))


class _HfStamps(transformers.TrainerCallback):
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts, self.stamps = opts, []

    def on_step_end(self, args, state, control, **kwargs):
        self.stamps.append(stamp(self.opts))


def common_args(opts: argparse.Namespace, out_dir: str) -> dict[str, Any]:
    return dict(output_dir=out_dir, max_steps=opts.steps, per_device_train_batch_size=opts.batch_size,
                learning_rate=LR, weight_decay=0.0, lr_scheduler_type="linear", warmup_steps=0,
                max_grad_norm=MAX_GRAD_NORM, gradient_accumulation_steps=1, logging_steps=opts.logging_steps,
                save_strategy="no", eval_strategy="no", disable_tqdm=True, report_to="none", seed=TRAINER_SEED,
                dataloader_num_workers=0, bf16=opts.bf16)


def run_vlmtrain(opts: argparse.Namespace, data: dict[str, Any], out_dir: str) -> Run:
    model = load_model(opts)
    timer = _VlmStamps(opts)
    trainer = vlmtrain.Trainer(model=model, args=vlmtrain.TrainingArguments(**common_args(opts, out_dir)),
                               data_collator=vlmtrain_collator(data["processor"]),
                               train_dataset=InOrder(data["samples"]), callbacks=[timer])
    trainer.train()
    return timer.stamps, _last_loss(trainer.state.log_history), model


def run_transformers(opts: argparse.Namespace, data: dict[str, Any], out_dir: str) -> Run:
    model = load_model(opts)
    args = transformers.TrainingArguments(**common_args(opts, out_dir), use_cpu=opts.device.type == "cpu",
                                          optim="adamw_torch", remove_unused_columns=False)
    timer = _HfStamps(opts)
    trainer = transformers.Trainer(model=model, args=args, data_collator=HandWrittenCollator(data["processor"]),
                                   train_dataset=InOrder(data["samples"]), callbacks=[timer])
    trainer.train()
    return timer.stamps, _last_loss(trainer.state.log_history), model


RUNNERS = {"transformers": run_transformers, "vlmtrain": run_vlmtrain, "bare": run_bare}


def timed_run(name: str, opts: argparse.Namespace, data: dict[str, Any]) -> dict[str, float]:
    torch.set_num_threads(opts.threads)
    sink = io.StringIO()  # the trainers' log lines go here, not to the terminal
    with tempfile.TemporaryDirectory(prefix=f"hub-vlm-{name}-") as out_dir, contextlib.redirect_stdout(sink), \
            PeakMemory(opts.device) as mem:
        stamps, last_loss, model = RUNNERS[name](opts, data, out_dir)
    if len(stamps) != opts.steps:
        raise RuntimeError(f"{name}: {len(stamps)} optimizer steps recorded, expected {opts.steps}.")
    w = opts.warmup
    wall, cpu = ((opts.steps - w) / (stamps[-1][i] - stamps[w - 1][i]) for i in (0, 1))
    result = {"steps_s": wall, "cpu_steps_s": cpu, "mem_mb": mem.delta_mb, "last_loss": last_loss,
              "probe_loss": probe_loss(model, data["probe"], opts)}
    del model
    return result


# -- report ---------------------------------------------------------------------------------------------------
def check_same_batches(hand: dict[str, torch.Tensor], ours: dict[str, Any]) -> bool:
    diffs = [k for k in MODEL_KEYS if not (k in hand and k in ours and torch.equal(hand[k], ours[k]))]
    extra = sorted(set(hand) - set(MODEL_KEYS))
    print(f"same first batch from both collators, key by key ({', '.join(MODEL_KEYS)}): "
          f"{'yes' if not diffs else 'NO, differ: ' + ', '.join(diffs)}"
          + (f" (hand-written collator has extra keys {extra})" if extra else ""))
    targets = int((hand["labels"] != -100).sum())
    print(f"  first batch: {tuple(hand['input_ids'].shape)} tokens, {len(hand['image_grid_thw'])} images, "
          f"pixel_values {tuple(hand['pixel_values'].shape)}, {targets} target tokens")
    return not diffs


def time_collators(data: dict[str, Any], opts: argparse.Namespace) -> None:
    collators = {"hand-written (batched processor call)": HandWrittenCollator(data["processor"]),
                 "vlmtrain HubVLMCollator (as trained)": vlmtrain_collator(data["processor"]),
                 "vlmtrain, + generation prompts": vlmtrain_collator(data["processor"], prompts=True)}
    print(f"\ncollation alone, ms per batch of {opts.batch_size} (median of {len(data['raw_batches'])} batches, "
          f"outside training)")
    base = None
    for name, collate in collators.items():
        collate(data["raw_batches"][0])
        times = []
        for raw in data["raw_batches"]:
            t = time.perf_counter()
            collate(raw)
            times.append(time.perf_counter() - t)
        med = statistics.median(times) * 1e3
        base = base or med
        print(f"  {name:<40}{med:>9.1f}{med / base:>8.2f}x")


def report(results: dict[str, list[dict]], opts: argparse.Namespace) -> bool:
    clock = "CUDA max_memory_allocated" if opts.device.type == "cuda" else "peak RSS - RSS at run start"
    med = {c: {k: statistics.median(r[k] for r in results[c]) for k in results[c][0]} for c in CONTENDERS}
    ref = med["transformers"]["steps_s"]
    print(f"\nper contender, median over {opts.repeats} round(s); steps/s over steps {opts.warmup + 1}..{opts.steps}")
    cpu_ref = med["transformers"]["cpu_steps_s"]
    print(f"  {'contender':<14}{'steps/s':>9}{'x transformers':>16}{'CPU-time steps/s':>18}{'x transformers':>16}"
          f"{'peak MB':>9}{'last logged loss':>18}{'probe loss':>12}")
    for c in CONTENDERS:
        m = med[c]
        print(f"  {c:<14}{m['steps_s']:>9.2f}{m['steps_s'] / ref:>16.2f}{m['cpu_steps_s']:>18.2f}"
              f"{m['cpu_steps_s'] / cpu_ref:>16.2f}{m['mem_mb']:>9.1f}{results[c][-1]['last_loss']:>18.5f}"
              f"{results[c][-1]['probe_loss']:>12.5f}")
    print(f"  steps/s: wall-clock; CPU-time steps/s: per second of process CPU time (less disturbed by other "
          f"processes on a shared CPU machine; not meaningful on CUDA). peak MB: {clock}.")
    print("  wall steps/s per round: "
          + "; ".join(f"{c} " + " ".join(f"{r['steps_s']:.2f}" for r in results[c]) for c in CONTENDERS))
    probes = [r["probe_loss"] for c in CONTENDERS for r in results[c]]
    ok = max(probes) - min(probes) <= 1e-3 * abs(min(probes)) * (20 if opts.bf16 else 1)
    print(f"same-work check, probe losses of all {len(probes)} trained models within "
          f"{'2%' if opts.bf16 else '0.1%'}: {'ok' if ok else 'FAILED'} ({min(probes):.6f}..{max(probes):.6f})")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=5, help="leading steps left out of the timing")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (each runs every contender once)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--image-size", type=int, default=64, help="shapes image side (64 px -> 16 image tokens)")
    p.add_argument("--logging-steps", type=int, default=10, help="keep steps a multiple of it (last logged loss)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for every contender")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast in every contender (fp32 weights)")
    opts = p.parse_args(argv)
    if not 1 <= opts.warmup < opts.steps:
        p.error("--warmup must be in [1, steps)")
    if opts.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device visible")
    if opts.device == "cpu" and torch.cuda.is_available():
        p.error("--device cpu with a visible GPU: vlmtrain.Trainer would use the GPU; run with CUDA_VISIBLE_DEVICES=''")
    opts.device = torch.device(opts.device)

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.set_num_threads(opts.threads)
    family = get_family("qwen3_vl")
    with tempfile.TemporaryDirectory(prefix="hub-vlm-model-") as model_dir:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            opts.model_dir = family.build_tiny(model_dir, seed=0)
        processor = family.load_processor(model_dir)
        train = ShapesVQA("train", opts.steps * opts.batch_size, image_size=opts.image_size, multi_image_fraction=1.0)
        samples = [train[i] for i in range(len(train))]  # rendered once, outside every timing
        val = ShapesVQA("val", opts.batch_size, image_size=opts.image_size, multi_image_fraction=1.0)
        hand = HandWrittenCollator(processor)
        raw_batches = batches_of(samples, opts.batch_size)
        data = {"processor": processor, "samples": samples, "raw_batches": raw_batches,
                "collated": [hand(b) for b in raw_batches], "probe": hand([val[i] for i in range(len(val))])}
        n_params = sum(q.numel() for q in load_model(opts).parameters())
        device_name = torch.cuda.get_device_name() if opts.device.type == "cuda" else "cpu"
        print(f"torch {torch.__version__}  transformers {transformers.__version__}  vlmtrain {vlmtrain.__version__}  "
              f"python {sys.version.split()[0]}  device {device_name}  torch threads {torch.get_num_threads()}  "
              f"cpus {os.cpu_count()}  load average {os.getloadavg()[0]:.2f}")
        print(f"tiny Qwen3-VL (family build_tiny, seed 0): {n_params / 1e6:.2f}M params, "
              f"{'bf16 autocast' if opts.bf16 else 'fp32'} | shapes-VQA, 2 images of {opts.image_size} px per "
              f"sample | batch {opts.batch_size} | {opts.steps} steps (timed from step {opts.warmup + 1}) | "
              f"{opts.repeats} round(s)")
        same = check_same_batches(data["collated"][0], vlmtrain_collator(processor)(raw_batches[0]))
        time_collators(data, opts)

        short = argparse.Namespace(**{**vars(opts), "steps": opts.warmup + 2})
        for name in CONTENDERS:  # one short untimed run each: imports, allocator and kernel warm-up
            timed_run(name, short, data)
        results: dict[str, list[dict]] = {c: [] for c in CONTENDERS}
        for r in range(opts.repeats):
            order = CONTENDERS[r % 3:] + CONTENDERS[:r % 3]
            for name in order:
                results[name].append(timed_run(name, opts, data))
            print(f"round {r + 1}/{opts.repeats} steps/s: "
                  + ", ".join(f"{c} {results[c][-1]['steps_s']:.2f}" for c in order), flush=True)
        ok = report(results, opts) and same
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
