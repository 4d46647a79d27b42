"""Pad-to-max vs dynamic padding vs packing: fill ratio and real-target tokens per second, side by side.

Two data sets, each trained for the same steps on the same batches of samples in three layouts:

  shapes       shapes-VQA conversations (configs/shapes-tiny.yaml: its tokenizer, processor and tiny VLM),
               max_length 256
  long-tailed  token sequences with log-normal lengths (median ~100, a few near 1024) for a tiny
               random-init Llama, max_length 1024: the case where padding to the longest sample hurts

  pad-to-max   every row padded to max_length
  dynamic      rows padded to the batch's longest sample (what VLMCollator / DefaultCollator do)
  packing      the batch's samples packed into rows of max_length tokens (vlmtrain.data.packing), each
               sample attending only to itself (data.packing, the default: a step keeps its samples; here
               every batch is packed, while the default packs only batches whose fill it raises by 0.05)
  window       all samples packed 256 at a time into rows (vlmtrain.data.pack_stream.PackedDataset,
               data.pack_window: 256), batched as many rows per step as "packing" averages

Batches are collated before timing (the step is what differs); a step is forward, backward, AdamW.
fill = real tokens / (rows x row length). Throughput = real target tokens (labels != -100) per second of
training steps, median over --rounds rounds whose layout order rotates. Ratios are against dynamic padding.
"packing" takes the same samples per step as the padded layouts, so the loss is the same: the script checks
that the first-step losses agree ("window" regroups samples, so its first loss differs).

    python benchmarks/packing.py                # about 2-3 minutes on 2 cores
    python benchmarks/packing.py --steps 10 --rounds 3 --batch-size 16
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vlmtrain.data.collate import pad_sequences
from vlmtrain.data.pack_stream import PackedDataset, collate_rows
from vlmtrain.data.packing import IGNORE_INDEX, PackingCollator
from vlmtrain.data.sources import IndexedSource, StreamingDataset
from vlmtrain.data.vlm_collate import VLMCollator

LAYOUTS = ("pad-to-max", "dynamic", "packing", "window")
ROOT = Path(__file__).resolve().parents[1]


def pad_to(batch: dict, length: int, pad_id: int) -> dict:
    """A right-padded batch widened to ``length`` columns."""
    extra = length - batch["input_ids"].shape[1]
    out = dict(batch)
    for key, value in (("input_ids", pad_id), ("attention_mask", 0), ("labels", IGNORE_INDEX)):
        out[key] = torch.nn.functional.pad(batch[key], (0, extra), value=value)
    return out


def model_inputs(batch: dict) -> dict:
    keep = ("input_ids", "attention_mask", "labels", "position_ids", "pixel_values")
    return {k: v for k, v in batch.items() if k in keep}


def fill(batch: dict) -> tuple[int, int]:
    """(real tokens, row capacity) of a training batch."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum()), batch["input_ids"].numel()
    stats = batch["pack_stats"]
    return stats["tokens"], stats["capacity"]


def targets(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def window_batches(samples: list, process, pack_length: int, pad_id: int, per_batch_rows: list[int],
                   max_images: int | None = None) -> list[dict]:
    """The samples window-packed (256 per window, in order), grouped into as many rows per step as per-batch
    packing used on average."""
    stream = StreamingDataset([IndexedSource(samples, block_size=len(samples))], shuffle=False)
    rows = list(PackedDataset(stream, process, pack_length, pad_id, window=256, max_images_per_pack=max_images))
    k = max(1, round(statistics.mean(per_batch_rows)))
    return [collate_rows(rows[i:i + k]) for i in range(0, len(rows), k)]


def time_steps(make_model, batches: list[dict], warmup: int) -> tuple[float, float]:
    """Seconds per real target over the timed steps, and the first step's loss."""
    model = make_model()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    first_loss, n_targets, start = None, 0, None
    for i, batch in enumerate(batches):
        if i == warmup:
            start = time.perf_counter()
        out = model(**model_inputs(batch), use_cache=False)
        loss = out["loss"] if isinstance(out, dict) else out.loss
        if first_loss is None:
            first_loss = float(loss.detach())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            n_targets += targets(batch)
    return n_targets / (time.perf_counter() - start), first_loss


def shapes_case(steps: int, batch_size: int, pack_length: int | None = None):
    from vlmtrain import run
    from vlmtrain.config import load_run_config

    cfg = load_run_config(ROOT / "configs" / "shapes-tiny.yaml",
                          {"data.num_train": steps * batch_size, "data.num_eval": 1, "data.packing": False})
    trainer = run.build(cfg)
    model, collator = trainer.model, trainer.data_collator
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def make_model():
        model.load_state_dict(state)
        return model

    samples = [trainer.train_dataset[i] for i in range(steps * batch_size)]
    chunks = [samples[i:i + batch_size] for i in range(0, len(samples), batch_size)]
    processor, max_length = collator.processor, cfg.data.max_length
    packer = VLMCollator(processor, pack_length=pack_length or max_length, min_fill_gain=-1)  # always pack
    dynamic = [collator(c) for c in chunks]
    layouts = {"pad-to-max": [pad_to(b, max_length, collator.pad_token_id) for b in dynamic],
               "dynamic": dynamic, "packing": [packer(c) for c in chunks]}
    layouts["window"] = window_batches(samples, processor.process, pack_length or max_length, collator.pad_token_id,
                                       [b["input_ids"].shape[0] for b in layouts["packing"]])
    return make_model, layouts


def _same(sample):
    return sample


def long_tailed_case(steps: int, batch_size: int, max_length: int = 1024, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    vocab = 512
    lengths = torch.exp(torch.randn(steps * batch_size, generator=gen) * 0.9 + math.log(100)).round().long()
    lengths = lengths.clamp(8, max_length).tolist()
    samples = []
    for n in lengths:
        ids = torch.randint(1, vocab, (n,), generator=gen)
        labels = ids.clone()
        labels[: n // 4] = IGNORE_INDEX  # a prompt without targets
        samples.append({"input_ids": ids, "labels": labels})
    chunks = [samples[i:i + batch_size] for i in range(0, len(samples), batch_size)]

    def dynamic_collate(chunk):
        ids = [s["input_ids"] for s in chunk]
        return {"input_ids": pad_sequences(ids, 0), "labels": pad_sequences([s["labels"] for s in chunk], -100),
                "attention_mask": pad_sequences([torch.ones_like(t) for t in ids], 0)}

    packer = PackingCollator(max_length, pad_token_id=0, min_fill_gain=-1)  # always pack
    dynamic = [dynamic_collate(c) for c in chunks]
    layouts = {"pad-to-max": [pad_to(b, max_length, 0) for b in dynamic], "dynamic": dynamic,
               "packing": [packer(c) for c in chunks]}
    layouts["window"] = window_batches(samples, _same, max_length, 0,
                                       [b["input_ids"].shape[0] for b in layouts["packing"]])

    def make_model():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=512,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                            max_position_embeddings=max_length, pad_token_id=0))
    return make_model, layouts


def report(name: str, make_model, layouts: dict, rounds: int, warmup: int) -> dict[str, float]:
    speeds: dict[str, list[float]] = {k: [] for k in LAYOUTS}
    losses: dict[str, float] = {}
    for r in range(rounds):
        order = LAYOUTS[r % len(LAYOUTS):] + LAYOUTS[:r % len(LAYOUTS)]
        for layout in order:
            speed, loss = time_steps(make_model, layouts[layout], warmup)
            speeds[layout].append(speed)
            losses[layout] = loss
    samples = sum(b["pack_stats"]["samples"] for b in layouts["packing"])
    print(f"\n{name}: {samples} samples, {len(layouts['dynamic'])} steps, median of {rounds} rounds")
    print(f"  {'layout':<11} {'steps':>5} {'rows/step':>9} {'fill':>6} {'targets/s':>10} {'vs dynamic':>10} "
          f"{'first loss':>10}")
    med = {k: statistics.median(v) for k, v in speeds.items()}
    for layout in LAYOUTS:
        real, cap = map(sum, zip(*(fill(b) for b in layouts[layout])))
        rows = statistics.mean(b["input_ids"].shape[0] for b in layouts[layout])
        print(f"  {layout:<11} {len(layouts[layout]):>5} {rows:>9.1f} {real / cap:>6.3f} {med[layout]:>10.0f} "
              f"{med[layout] / med['dynamic']:>9.2f}x {losses[layout]:>10.5f}")
    spread = max(abs(losses[k] - losses["dynamic"]) for k in LAYOUTS if k != "window")
    if spread > 1e-4:
        raise SystemExit(f"layouts disagree on the first-step loss by {spread:.2g}: not the same computation")
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="steps per run (default 12)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, layout order rotating (default 3)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step (default 32)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=("shapes", "long-tailed"), default=None)
    parser.add_argument("--shapes-pack-length", type=int, default=512,
                        help="row length of the packed shapes layouts (default 512: its samples are ~100 tokens, "
                             "two fit a row of max_length=256 and leave a fifth of it empty)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.only != "long-tailed":
        report(f"shapes-VQA (tiny VLM, max_length 256, packed rows of {args.shapes_pack_length})",
               *shapes_case(args.steps, args.batch_size, args.shapes_pack_length), args.rounds, args.warmup)
    if args.only != "shapes":
        report("long-tailed lengths (tiny Llama, max_length 1024)",
               *long_tailed_case(args.steps, args.batch_size // 2), args.rounds, args.warmup)


if __name__ == "__main__":
    main()
