"""The next-token loss without vocabulary-sized tensors for positions that are not trained.

A language model's loss only needs the logits where a target is predicted (shifted labels != -100); on a VQA
batch most positions are prompt and image tokens. :func:`lm_loss_sum` gathers the final hidden states at those
positions first, then applies the output layer and the cross-entropy in chunks of at most ``chunk_rows`` rows,
so a long answer never holds more than ``chunk_rows x vocab`` logits at once, in forward or backward:

- an output layer that is a plain ``nn.Linear`` (the usual ``lm_head``) goes through a fused linear +
  cross-entropy: each chunk's logits, their softmax and the gradients of the hidden rows, the weight and bias
  are computed in forward and freed before the next chunk; backward only scales them. No recomputation: the
  same FLOPs as the full path restricted to the targets (``2 x rows x weight`` forward, as much per gradient).
- any other output layer (a peft LoRA or modules_to_save wrapper, a quantized layer) runs each chunk under
  ``torch.utils.checkpoint``: its logits are recomputed in backward, one chunk at a time.

The loss is summed in float32 (as transformers upcasts its logits), and so are the head's weight and bias
gradients over the chunks (in bf16 each chunk would round the running sum again); the caller divides by the
target count (or by a count over several micro-batches) as before. :func:`enable_lm_loss` gives a transformers
causal LM or Hub VLM a ``loss_only=True`` forward that uses it.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["CHUNK_ROWS", "LOSS_ONLY_MODEL_TYPES", "decoder_and_head", "enable_lm_loss", "linear_cross_entropy",
           "lm_loss_sum"]

IGNORE_INDEX = -100
CHUNK_ROWS = 1024
"""Rows (target positions) per chunk of the output layer + cross-entropy: at a 151,936-token vocabulary a chunk's
float32 logits are 0.6 GB (see benchmarks/loss_memory.py)."""

LOSS_ONLY_MODEL_TYPES = ("qwen3_vl", "qwen2_5_vl", "idefics3", "llava_onevision", "gemma3",  # Hub VLM families
                         "llama", "mistral", "qwen2", "qwen3", "gemma", "smollm3", "olmo2", "phi3")  # causal LMs
"""transformers models whose forward is ``logits = lm_head(base_model(...)[0])`` and the causal-LM loss on them
and nothing else (no logit soft-capping or scaling, no auxiliary loss): checked in tests/test_lm_loss.py."""

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def causal_lm_targets(model: Any, inputs: dict[str, Any]) -> torch.Tensor | None:
    """How many targets a transformers model's loss averaged over when its output does not say: for a loss that
    is the causal-LM one (causal LMs, and VLMs such as Qwen3-VL whose loss_type is ForConditionalGeneration:
    both average over the shifted labels), those labels counted; an encoder-decoder's (Bart, T5: the same
    loss_type, but the decoder's labels are its targets, unshifted) all its labels; else None. The trainer's
    ``loss_targets`` part."""
    labels = inputs.get("labels")
    if _causal_lm_loss(model) and isinstance(labels, torch.Tensor):
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            return (labels != IGNORE_INDEX).sum().float()
        return (labels[..., 1:] != IGNORE_INDEX).sum().float()
    return None


def _causal_lm_loss(model: Any) -> bool:
    loss_type = getattr(model, "loss_type", None)
    if loss_type is None:
        return False
    from transformers.loss.loss_utils import LOSS_MAPPING

    return loss_type in LOSS_MAPPING and LOSS_MAPPING[loss_type] is LOSS_MAPPING["ForCausalLM"]


def _plain_linear(head: nn.Module) -> bool:
    return isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(head(rows[i]), targets[i]) with the gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, chunk_rows: int, head: nn.Module) -> torch.Tensor:
        need_rows, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_bias = bias is not None and ctx.needs_input_grad[2]
        total = torch.zeros((), dtype=torch.float32, device=rows.device)
        grad_rows = torch.empty_like(rows) if need_rows else None
        grad_weight = grad_bias = None
        for start in range(0, rows.shape[0], chunk_rows):
            x, y = rows[start:start + chunk_rows].detach(), targets[start:start + chunk_rows]
            logits = head(x)  # (the module: its hooks run, autocast applies as in the full path)
            dtype = logits.dtype
            z = logits.float()
            del logits
            z.sub_(z.amax(dim=-1, keepdim=True))
            picked = z.gather(1, y[:, None]).squeeze(1)
            z.exp_()
            sums = z.sum(dim=-1)
            total += (sums.log() - picked).sum()
            if not (need_rows or need_weight or need_bias):
                continue
            z.div_(sums[:, None])  # softmax; minus one at the target: d loss / d logits
            z.scatter_add_(1, y[:, None], z.new_full((y.shape[0], 1), -1.0))
            grad = z.to(dtype)
            del z
            if need_rows:  # (under autocast, mm casts the weight as the full path's linear did)
                grad_rows[start:start + chunk_rows] = torch.mm(grad, weight)
            if need_weight:  # accumulated over the chunks in float32 (in bf16 each chunk's sum would round)
                if grad_weight is None:
                    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                torch.addmm(grad_weight, grad.t().float(), x.float(), out=grad_weight)  # (FlopCounterMode sees it)
            if need_bias:
                part = grad.sum(dim=0, dtype=torch.float32)
                grad_bias = part if grad_bias is None else grad_bias + part
            del grad  # (before the next chunk's logits)
        if need_weight and grad_weight is None:  # no target: a zero gradient, so every rank reaches the weight
            grad_weight = torch.zeros_like(weight)
        if need_bias and grad_bias is None:
            grad_bias = torch.zeros_like(bias)
        ctx.grads = (grad_rows, grad_weight, grad_bias)
        ctx.dtypes = (rows.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple:
        if ctx.grads is None:
            raise RuntimeError("the fused LM loss's backward ran twice: its gradients were computed in forward and "
                               "are used once (backward(retain_graph=True) twice is not supported).")
        grads, ctx.grads = ctx.grads, None
        out = [None if g is None else g.mul_(grad_total.to(g.dtype)).to(dtype) for g, dtype in zip(grads, ctx.dtypes)]
        return out[0], out[1], out[2], None, None, None


def _chunk_loss(head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(x).float(), y, reduction="sum")


def linear_cross_entropy(rows: torch.Tensor, head: nn.Module, targets: torch.Tensor,
                         chunk_rows: int | None = None) -> torch.Tensor:
    """Summed cross-entropy (float32) of ``head(rows)`` [N, V] against ``targets`` [N], computed ``chunk_rows``
    (default :data:`CHUNK_ROWS`) rows at a time: at most one chunk's logits (and their gradient) exist at once,
    in forward and backward. Every target must be a class index (filter -100 out first)."""
    chunk_rows = CHUNK_ROWS if chunk_rows is None else chunk_rows
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    targets = targets.to(rows.device)
    if _plain_linear(head):
        return _LinearCrossEntropy.apply(rows, head.weight, head.bias, targets, chunk_rows, head)
    total = torch.zeros((), dtype=torch.float32, device=rows.device)
    if rows.shape[0] == 0:  # still reach the head's trainable parameters (DDP / FSDP expect a gradient)
        return total + head(rows).float().sum()
    for start in range(0, rows.shape[0], chunk_rows):
        total = total + checkpoint(_chunk_loss, head, rows[start:start + chunk_rows],
                                   targets[start:start + chunk_rows], use_reentrant=False)
    return total


def lm_loss_sum(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor | None = None,
                shift_labels: torch.Tensor | None = None,
                chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed next-token cross-entropy in float32, number of targets) of final hidden states [B, T, H] and
    ``labels`` [B, T] aligned with the input ids (position t predicts labels[t + 1]; -100 is ignored), or
    ``shift_labels`` [B, T] already shifted (transformers' convention). Only the hidden states of positions with
    a target reach ``head``, in chunks of ``chunk_rows`` (:func:`linear_cross_entropy`). The same value and
    gradients as transformers' causal-LM loss on the full logits (times the count), 0 without targets."""
    if shift_labels is None:
        if labels is None:
            raise ValueError("lm_loss_sum needs labels or shift_labels")
        shift_labels = F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    shift_labels = shift_labels.to(hidden.device)
    keep = shift_labels != IGNORE_INDEX
    total = linear_cross_entropy(hidden[keep], head, shift_labels[keep], chunk_rows)
    return total, keep.sum()


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(the decoder that gives the final hidden states, the output layer) of a transformers model whose logits
    are ``lm_head(decoder(...)[0])`` and nothing more (model_type in :data:`LOSS_ONLY_MODEL_TYPES`, no logit
    soft-capping or scaling in its config); else None."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in LOSS_ONLY_MODEL_TYPES:
        return None
    configs = [config, *([config.get_text_config()] if hasattr(config, "get_text_config") else [])]
    if any(getattr(c, key, None) for c in configs for key in _LOGIT_TRANSFORMS):
        return None
    decoder = getattr(model, getattr(model, "base_model_prefix", "") or "", None)
    head = getattr(model, "lm_head", None)
    if not isinstance(decoder, nn.Module) or decoder is model or not isinstance(head, nn.Module):
        return None
    return decoder, head


def enable_lm_loss(model: nn.Module, chunk_rows: int | None = None) -> bool:
    """Give a transformers causal LM or VLM (see :func:`decoder_and_head`) a ``loss_only`` forward argument:
    ``model(**batch, labels=..., loss_only=True)`` returns ``{"loss", "num_items"}`` (the mean over the targets,
    or transformers' ``sum / num_items_in_batch`` when that is given, and the target count) computed by
    :func:`lm_loss_sum`, without logits. Without ``loss_only`` (or without labels) the forward is the model's
    own, logits included; ``generate`` and ``save_pretrained`` are unchanged. The model then says so to the
    Trainer (``vlmtrain_accepts_loss_only``, which passes ``loss_only=True`` in training and in evaluation
    that keeps no logits) and to the FLOP counter (``vlmtrain_target_logits_module``). Returns False (and
    changes nothing) for a model it does not know."""
    parts = decoder_and_head(model)
    if parts is None:
        return False
    head_name = next(name for name, module in model.named_children() if module is parts[1])
    decoder_params = set(inspect.signature(parts[0].forward).parameters)
    own_forward = type(model).forward

    @functools.wraps(own_forward)  # (generate reads the model's own signature)
    def forward(self: nn.Module, *args: Any, loss_only: bool = False, **kwargs: Any) -> Any:
        if not loss_only or (kwargs.get("labels") is None and kwargs.get("shift_labels") is None):
            return type(self).forward(self, *args, **kwargs)
        return _loss_only_forward(self, decoder_params, chunk_rows, *args, **kwargs)

    model.forward = types.MethodType(forward, model)
    model.vlmtrain_accepts_loss_only = True
    model.vlmtrain_target_logits_module = head_name
    return True


def _loss_only_forward(model: nn.Module, decoder_params: set[str], chunk_rows: int | None, *args: Any,
                       **kwargs: Any) -> dict[str, torch.Tensor]:
    decoder, head = decoder_and_head(model)  # (looked up per call: peft or FSDP may wrap them after install)
    labels, shift_labels = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("logits_to_keep", None)
    if "labels" in decoder_params:  # (Gemma 3's model takes them as its ForConditionalGeneration passes them)
        kwargs["labels"] = labels
    if "use_cache" in decoder_params or "kwargs" in decoder_params:  # no KV cache for a loss (transformers 5 builds
        kwargs.setdefault("use_cache", False)  # one in training from the config's use_cache otherwise)
    hidden = decoder(*args, **kwargs)[0]
    total, count = lm_loss_sum(hidden, head, labels, shift_labels, chunk_rows)
    if num_items_in_batch is not None:  # transformers' convention: the sum over the window's count
        loss = total / torch.as_tensor(num_items_in_batch, device=total.device)
    else:
        loss = total / count.clamp(min=1)
    return {"loss": loss, "num_items": count}
