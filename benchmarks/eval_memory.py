"""Peak memory of Trainer.evaluate() against the number of eval batches, with a 150k vocabulary (issue 14, item 6).

    python benchmarks/eval_memory.py                      # 4 and 16 batches of 2 x 40 tokens, about 1 minute
    python benchmarks/eval_memory.py --batches 4 32 --vocab 152064

A tiny random-init Llama (hidden 16, 1 layer) with a Qwen-sized vocabulary: one batch of logits is
2 x 40 x vocab float32 (46 MB at 150k). For each way evaluation can be asked for metrics it prints the peak
resident memory during evaluate() above the memory just before it (/proc/self/statm sampled every 1 ms).
"full logits" is a compute_metrics without preprocess_logits_for_metrics (transformers' contract: it gets
B x L x vocab for the whole eval set); it is measured over fewer batches (--full-batches) to stay small.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vlmtrain import Trainer, TrainingArguments

PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def peak_growth_mb(trainer: Trainer, data: list[dict]) -> float:
    """Peak RSS while ``trainer.evaluate(data)`` runs, minus RSS before it, in MiB."""
    start, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        trainer.evaluate(data)
    finally:
        done.set()
        thread.join()
    return (max(peak[0], _rss()) - start) / 2**20


def samples(n: int, vocab: int, length: int, prompt: int = 8) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(1, vocab, (length,), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones(length, dtype=torch.long),
                    "labels": torch.cat([torch.full((prompt,), -100), ids[prompt:]]),
                    "prompt_input_ids": ids[:prompt], "prompt_attention_mask": torch.ones(prompt, dtype=torch.long)})
    return out


def collate(items: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def rows(p) -> dict[str, float]:
    return {"rows": float(len(p.predictions))}


MODES = {  # name: (Trainer keyword arguments, TrainingArguments overrides)
    "losses only": ({}, {}),
    "argmax (preprocess_logits_for_metrics)": (
        {"compute_metrics": rows, "preprocess_logits_for_metrics": lambda logits, labels: logits.argmax(-1)}, {}),
    "generated ids (predict_with_generate)": (
        {"compute_metrics": rows}, {"predict_with_generate": True, "generation_max_new_tokens": 3}),
    "full logits (compute_metrics alone)": ({"compute_metrics": rows}, {}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=150_000)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--length", type=int, default=40)
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--full-batches", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--threads", type=int, default=1)
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    warnings.simplefilter("ignore")
    logits_mb = a.batch_size * a.length * a.vocab * 4 / 2**20
    print(f"vocab {a.vocab}, batch {a.batch_size} x {a.length} tokens: one batch of logits = {logits_mb:.1f} MiB")
    print(f"{'mode':42s} " + " ".join(f"{'batches':>8s} {'peak MiB':>9s}" for _ in a.batches))
    for name, (kwargs, overrides) in MODES.items():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=a.vocab, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                             max_position_embeddings=64, pad_token_id=0))
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), disable_tqdm=True, save_strategy="no",
                                 per_device_eval_batch_size=a.batch_size, **overrides)
        trainer = Trainer(model, args, data_collator=collate, **kwargs)
        trainer.evaluate(samples(a.batch_size, a.vocab, a.length))  # warm-up
        counts = a.full_batches if name.startswith("full") else a.batches
        cells = []
        for n in counts:
            data = samples(n * a.batch_size, a.vocab, a.length)
            cells.append(f"{n:>8d} {peak_growth_mb(trainer, data):>9.1f}")
        print(f"{name:42s} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
