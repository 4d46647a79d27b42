"""Peak memory of the LM loss step (lm_head + cross-entropy, forward and backward) at a Qwen-sized vocabulary:
full logits (transformers' path) vs gathered at the supervised positions vs gathered and chunked (vlmtrain).

    python benchmarks/loss_memory.py                       # hidden 4096, vocab 151,936, 8,192 tokens, 25% trained
    python benchmarks/loss_memory.py --supervised 0.5 --chunk-rows 1024 4096
    python benchmarks/loss_memory.py --tokens 1024 --vocab 32000 --real   # CPU: run it for real (and check losses)

The batch is 4 samples of tokens/4, each trained on its last ``--supervised`` fraction (an answer after its
prompt); hidden states and the lm_head weight are bf16 (``--dtype``), logits are upcast to float32 for the
cross-entropy as transformers does. Measured: the peak of memory allocated during forward + backward of the loss
step above what existed before it (hidden states, weight), the weight's gradient included (the same size in
every variant).

- full: ``lm_head(hidden)`` on every position, then transformers' ``ForCausalLMLoss``.
- gathered: the hidden states at the positions with a target (index_select), ``lm_head``, float32 cross-entropy,
  plain autograd (all targets' logits at once).
- chunked: the same rows through ``vlmtrain.models.speed.lm_loss.linear_cross_entropy`` (``--chunk-rows`` rows at a
  time; default vlmtrain's CHUNK_ROWS).

On CUDA: ``torch.cuda.max_memory_allocated``, run for real (with the time per step). Elsewhere: every tensor an
op creates is counted by its storage size while it is alive (a TorchDispatchMode that tracks storages through
weak references), under FakeTensorMode by default: nothing is computed, so the full size takes seconds on a
CPU. ``--real`` computes on the CPU with the same counter (fake and real counts agree exactly) and prints the
three losses, which must agree.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import time
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from transformers.loss.loss_utils import ForCausalLMLoss

from vlmtrain.models.speed.lm_loss import CHUNK_ROWS, linear_cross_entropy

MIB = 1 << 20


class AllocationCounter(TorchDispatchMode):
    """Bytes of the tensors created inside it that are alive now (``live``) and at most (``peak``): each new
    storage counts its size from the op that makes it until it is freed (views and in-place results count once)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def _free(self, key: int, size: int) -> None:
        self._refs.pop(key, None)
        self.live -= size

    def _track(self, t: torch.Tensor, inputs: list[Any]) -> None:
        storage = t.untyped_storage()  # (one Python object per storage while it lives)
        key = id(storage)
        ref = self._refs.get(key)
        if any(s is storage for s in inputs) or (ref is not None and ref() is storage):  # a view, an in-place op
            return
        size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        self._refs[key] = weakref.ref(storage, lambda _, key=key, size=size: self._free(key, size))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        inputs: list[Any] = []
        tree_map_only(torch.Tensor, lambda t: inputs.append(t.untyped_storage()), (args, kwargs))
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, lambda t: self._track(t, inputs), out)
        return out


def _labels(tokens: int, supervised: float, vocab: int) -> torch.Tensor:
    rows, length = 4, tokens // 4
    labels = torch.full((rows, length), -100, dtype=torch.long)
    answer = max(1, round(length * supervised))
    labels[:, length - answer:] = torch.randint(0, vocab, (rows, answer), generator=torch.Generator().manual_seed(0))
    return labels


def _step(variant: str, hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, index: torch.Tensor,
          targets: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """Forward + backward of one loss step; returns the loss (the summed CE over the targets)."""
    if variant == "full":
        logits = head(hidden)
        loss = ForCausalLMLoss(logits, labels, head.out_features, num_items_in_batch=torch.tensor(1.0))
    else:
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
        if variant == "gathered":
            loss = F.cross_entropy(head(rows).float(), targets, reduction="sum")
        else:
            loss = linear_cross_entropy(rows, head, targets, chunk_rows)
    loss.backward()
    return loss.detach()


def measure(variant: str, args: argparse.Namespace, chunk_rows: int, device: torch.device,
            fake: bool) -> dict[str, float]:
    dtype = getattr(torch, args.dtype)
    labels = _labels(args.tokens, args.supervised, args.vocab)
    shift = F.pad(labels[:, 1:], (0, 1), value=-100).reshape(-1)
    index = (shift != -100).nonzero().squeeze(1)  # (computed before any fake tensor: its size is the data's)
    targets = shift[index]
    mode: Any = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        torch.manual_seed(0)
        head = nn.Linear(args.hidden, args.vocab, bias=False, device=device, dtype=dtype)
        nn.init.normal_(head.weight, std=0.02)
        hidden = torch.randn(4, args.tokens // 4, args.hidden, device=device, dtype=dtype, requires_grad=True)
        labels, index, targets = labels.to(device), index.to(device), targets.to(device)
        grad_bytes = head.weight.numel() * head.weight.element_size()
        if device.type == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            loss = _step(variant, hidden, head, labels, index, targets, chunk_rows)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated() - before
        else:
            start = time.perf_counter()
            with AllocationCounter() as counter:
                loss = _step(variant, hidden, head, labels, index, targets, chunk_rows)
            seconds, peak = time.perf_counter() - start, counter.peak
        value = float("nan") if fake else float(loss) / len(targets)
    return {"peak": peak / MIB, "grad": grad_bytes / MIB, "seconds": seconds, "loss": value, "targets": len(targets)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--supervised", type=float, default=0.25, help="fraction of each sample that is trained")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--chunk-rows", type=int, nargs="+", default=[CHUNK_ROWS])
    parser.add_argument("--real", action="store_true", help="without CUDA: compute on the CPU instead of counting "
                                                            "under FakeTensorMode")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fake = device.type != "cuda" and not args.real
    how = ("torch.cuda.max_memory_allocated, run" if device.type == "cuda" else
           "tensors counted while alive (TorchDispatchMode), " + ("FakeTensorMode: not computed" if fake else "run"))
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"# {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; {how}")
    print(f"# hidden {args.hidden}, vocab {args.vocab:,}, {args.tokens:,} tokens (4 x {args.tokens // 4}), "
          f"{args.supervised:.0%} supervised, {args.dtype}")
    variants = [("full", "full", 0), ("gathered", "gathered", 0)] + [
        (f"chunked ({rows} rows)", "chunked", rows) for rows in args.chunk_rows]
    results = []
    for label, variant, rows in variants:
        r = measure(variant, args, rows, device, fake)
        results.append((label, r))
    full = results[0][1]["peak"]
    print(f"# {results[0][1]['targets']:,} targets; every peak includes the weight's gradient "
          f"({results[0][1]['grad']:,.0f} MiB)")
    print("| loss step | peak MiB | vs full |" + (" ms | loss |" if not fake else ""))
    print("|---|---|---|" + ("---|---|" if not fake else ""))
    for label, r in results:
        line = f"| {label} | {r['peak']:,.0f} | {r['peak'] / full:.3f}x |"
        if not fake:
            line += f" {1000 * r['seconds']:.1f} | {r['loss']:.6f} |"
        print(line)


if __name__ == "__main__":
    main()
