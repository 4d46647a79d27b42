"""The peak memory of one training step, planned before training: the step is traced under PyTorch's
FakeTensorMode (tensors with shapes and dtypes but no storage, so an 8B model costs no memory) with
``torch.distributed._tools.mem_tracker.MemTracker`` counting live tensors by kind, as torchtitan's memory
estimator does. Tracing rather than a formula per architecture: whatever the model does (its attention
implementation, activation checkpointing mode, chunked loss, LoRA, a vision tower) is what gets counted.

One step is traced (forward, backward, AdamW step, ``zero_grad(set_to_none=True)``) after AdamW's state was made
(an untraced step on zero gradients), so the peak includes the optimizer state every step after the first holds. Integer inputs (token ids, image grids, positions) are fake
tensors that keep their values (FakeTensorMode's constants), so the python-int bookkeeping of a VLM's vision tower
runs as usual.

FSDP is not traced: with degree N the weights, gradients and optimizer state are divided by N, plus the largest
transformer layer gathered whole (and the next one prefetched).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:  # (torch is imported where it runs: a config naming a device parses without it)
    import torch
    from torch import nn

GiB = 1 << 30
DEVICES: dict[str, int] = {
    "a100-40gb": 40 * GiB, "a100-80gb": 80 * GiB, "h100-80gb": 80 * GiB, "h100-94gb": 94 * GiB,
    "h200": 141 * 10**9, "l40s": 48 * GiB, "a10g": 24 * GiB, "l4": 24 * GiB, "rtx4090": 24 * GiB,
}
"""Device names ``--device`` / ``data.device_memory`` accept, and their memory in bytes (the nominal size)."""
MARGIN = 0.10
"""The share of the device's memory the plan leaves free (allocator fragmentation, CUDA context, kernels'
workspaces)."""
PARTS = ("weights", "gradients", "optimizer", "activations", "temporaries")
"""The parts of the estimate: parameters and buffers; gradients; AdamW's state; tensors saved for backward
(MemTracker's activations, which include the step's inputs); temporaries (what lives only inside an op or
between ops: the loss' logits chunk, attention scores, upcasts)."""
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def device_memory(value: str | int) -> int:
    """Bytes of a device given by name (:data:`DEVICES`) or size (``80GiB``, ``80GB``, ``85899345920``)."""
    if isinstance(value, int):
        return value
    text = value.strip().lower()
    if text in DEVICES:
        return DEVICES[text]
    match = re.fullmatch(r"([0-9.]+)\s*([kmgt]i?b|b)?", text)
    if not match:
        raise ConfigError(f"device memory {value!r} is neither a size (80GiB, 40GB) nor a device: "
                          f"{', '.join(DEVICES)}.")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def gib(n: float) -> str:
    """Bytes as GiB (MiB below 1 GiB)."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.2f} MiB"


@dataclass
class MemoryPlan:
    """One training step's peak memory per part (bytes, per device), for ``tokens`` tokens per micro-batch."""

    parts: dict[str, int]
    tokens: int
    device_bytes: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def fits(self, margin: float = MARGIN) -> bool:
        """Whether the peak fits the device with ``margin`` of its memory left free (True with no device)."""
        return self.device_bytes is None or self.total <= (1 - margin) * self.device_bytes

    def table(self) -> str:
        """The estimate as printed by ``vlmtrain plan``: one line per part, the total and the device."""
        lines = [f"{name:<12} {gib(n):>12}" for name, n in self.parts.items()]
        lines.append(f"{'total':<12} {gib(self.total):>12}   (peak of one step, {self.tokens} tokens per micro-batch)")
        if self.device_bytes is not None:
            usable = (1 - MARGIN) * self.device_bytes
            verdict = "fits" if self.fits() else "does NOT fit"
            lines.append(f"{'device':<12} {gib(self.device_bytes):>12}   {verdict} ({gib(usable)} usable with a "
                         f"{MARGIN:.0%} margin)")
        return "\n".join(lines + self.notes)


@contextlib.contextmanager
def _constants_kept() -> Iterator[None]:
    """FakeTensorMode keeps the values of constant tensors up to CONSTANT_NUMEL_LIMIT elements (1); raised, ops on
    token ids and image grids run for real, so ``.tolist()`` and data-dependent shapes work."""
    import torch._subclasses.fake_tensor as fake

    before = fake.CONSTANT_NUMEL_LIMIT
    fake.CONSTANT_NUMEL_LIMIT = 1 << 40
    try:
        yield
    finally:
        fake.CONSTANT_NUMEL_LIMIT = before


def trace_step_memory(model: nn.Module, batch: Mapping[str, Any], *, autocast: torch.dtype | None = None,
                      weight_decay: float = 0.0, steps: int = 1) -> dict[str, int]:
    """Peak bytes per part (:data:`PARTS`) of ``steps`` training steps of ``model`` (on the meta device) on
    ``batch`` (real tensors: integer ones keep their values, float ones only their shapes), with AdamW.
    ``autocast``: the compute dtype of mixed precision (train.bf16)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with _constants_kept(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        model.to_empty(device="cpu")  # meta -> fake tensors of the same shapes and dtypes
        convert = mode.fake_tensor_converter

        def fake(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            keep = not t.is_floating_point()
            return convert.from_real_tensor(mode, t, make_constant=keep) if keep else torch.empty_like(t)

        inputs = {k: fake(v) for k, v in batch.items()}
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=weight_decay, foreach=False)
        for p in params:  # AdamW's state exists from the first step on: made here, without a traced step
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tracker = _tracker()
        tracker.track_external(model, optimizer)
        amp = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
        model.train()
        with tracker:
            for _ in range(steps):
                with amp:
                    loss = model(**inputs)["loss"]
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                tracker.reset_mod_stats()
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    by_kind = {str(k.value).lower() if hasattr(k, "value") else str(k): v for k, v in peak.items()}
    return {"weights": by_kind.get("parameter", 0) + by_kind.get("buffer", 0),
            "gradients": by_kind.get("gradient", 0), "optimizer": by_kind.get("optstate", 0),
            "activations": by_kind.get("activation", 0),
            "temporaries": by_kind.get("temp", 0) + by_kind.get("other", 0)}


def _tracker() -> Any:
    """torch's MemTracker, except that it hooks only the gradients of trainable parameters (its own registers a
    hook on every parameter, which a frozen one refuses: LoRA, a frozen vision tower)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class Tracker(MemTracker):
        def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True
                                             ) -> tuple[int, int]:
            out = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            for p in module.parameters() if install_grad_hooks else ():
                if p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                    def hook(grad: torch.Tensor) -> None:
                        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

                    self._param_to_grad_hook_handles[p] = (
                        p.register_hook(hook), p.register_post_accumulate_grad_hook(lambda q: hook(q.grad)))
            return out

    return Tracker()


def shard(parts: dict[str, int], model: nn.Module, degree: int) -> dict[str, int]:
    """``parts`` per device under FSDP with ``degree`` devices: weights, gradients and optimizer state divided,
    plus the largest transformer layer's weights gathered whole twice (the running layer and the prefetched one)."""
    if degree <= 1:
        return dict(parts)
    from ..models.speed.training_prep import transformer_layers

    layers = transformer_layers(model)
    gathered = 2 * max((sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers),
                       default=0)
    out = dict(parts)
    for name in ("weights", "gradients", "optimizer"):
        out[name] = -(-parts[name] // degree)
    out["weights"] += gathered
    return out


def largest_fitting(estimate: Callable[[int], MemoryPlan], low: int, high: int, step: int = 64,
                    margin: float = MARGIN) -> tuple[int, MemoryPlan] | None:
    """The largest multiple of ``step`` in [low, high] whose plan fits (plans grow with the budget), or None
    when ``low`` does not fit. Two traces give the memory per token; the budget they predict is then checked and
    lowered until a trace confirms it (a dense attention mask grows faster than linearly)."""
    first = estimate(low)
    if not first.fits(margin):
        return None
    second = estimate(min(high, 2 * low))
    if second.fits(margin) and second.tokens >= high:
        return second.tokens, second
    best = (low, first) if not second.fits(margin) else (second.tokens, second)
    per_token = max(1.0, (second.total - first.total) / max(1, second.tokens - first.tokens))
    usable = (1 - margin) * first.device_bytes  # type: ignore[operator]
    guess = min(high, int(first.tokens + (usable - first.total) / per_token) // step * step)
    for _ in range(6):
        if guess <= best[0]:
            break
        plan = estimate(guess)
        if plan.fits(margin):
            return guess, plan
        guess = max(best[0], int(guess * 0.9) // step * step)
    return best
