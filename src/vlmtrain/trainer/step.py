"""One optimizer step of the loop: forward and backward of each micro-batch (training_step, compute_loss, under
autocast), then the optimizer step with gradient scaling, clipping and the skip of a non-finite step. A mixin of
TrainerCore, kept apart so each file reads on its own.

Gradient scaling: the gradient of a step is that of one big batch (the step's micro-batches on every rank)
however it is split, for every loss the model returns.

- A model with ``count_items(batch) -> {loss name: item count}`` (score heads: ``WithHeads``) has each loss
  normalized by its own count. The loop fetches the whole accumulation window before the first forward, sums
  each count over the window's micro-batches and all ranks (one all-reduce per window) and passes the totals as
  ``forward(..., num_items_in_batch={name: N})``; the model returns ``loss`` = sum over its losses of
  ``weight * (this micro-batch's summed loss) / N``. Backward takes that loss (times world_size: DDP and FSDP
  average over ranks) and the summed gradients are used as they are. A loss (e.g. the LM one of score-only
  samples) thus gets the gradient of its mean over the window's items, whatever the other losses' counts.
  The logged ``loss`` is then the mean, over the logging window's steps, of each step's one-big-batch loss.
- Any other model: each micro-batch's backward uses ``loss * num_items`` (or ``loss * 1`` when the model does
  not report num_items), and the summed gradients are divided by the window's total weight (over all ranks)
  just before the optimizer step. The logged ``loss`` is the mean over the logging window's items (a
  micro-batch without targets adds nothing, even though its own mean loss is NaN); ``train_loss`` the mean of
  the run's step losses, each its step's mean over its items (as transformers' Trainer makes it).

Every ``loss_<name>`` with a ``num_items_<name>`` is logged as its mean over its own items in the log window.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.cuda import empty_cache as empty_device_cache  # (a no-op until CUDA is initialized)

from . import distributed as dist
from .optim import learning_rates
from .stats import extra_losses, item_counts, num_items_of

STEP_HOOK_ATTR = "vlmtrain_step_hook"
"""A module of the model may carry under this attribute an object with ``before_optimizer_step(module, any_rank)``,
called on every rank at each optimizer step before the gradients are scaled, clipped and counted in grad_norm
(``any_rank(flag) -> bool``: whether the flag is set on any rank), and ``clear()``, called where the forwards since
the last step are dropped (training starts, a callback ends the epoch mid-window). models/protocol.py spells it
for the models. Found through wrappers (score heads, peft)."""


def step_hooks(model: nn.Module) -> list[tuple[nn.Module, Any]]:
    """(module, its STEP_HOOK_ATTR object) for each module of ``model`` that has one, cleared."""
    found = [(m, h) for m in model.modules() if (h := getattr(m, STEP_HOOK_ATTR, None)) is not None]
    for _, hook in found:
        hook.clear()
    return found


class StepMixin:
    """TrainerCore methods that run one optimizer step over an accumulation window's micro-batches."""

    def _count_window(self, count_items: Any, window: list[Any]) -> dict[str, torch.Tensor]:
        """Each loss's item count over an accumulation window's micro-batches and all ranks (one CPU all-reduce),
        as the `num_items_in_batch` every micro-batch of the window passes to the model. The losses counted are
        agreed over ranks (a rank whose count_items leaves one out counts 0 for it)."""
        totals: dict[str, list[float]] = {}
        for batch in window:
            for key, n in count_items(batch).items():
                totals[key] = [totals.get(key, [0.0])[0] + float(n)]
        summed = self._count_names.reduce(totals, 1)
        return {k: torch.tensor(n[0], dtype=torch.float32, device=self.device) for k, n in sorted(summed.items())}

    def training_step(self, model: nn.Module, inputs: Mapping[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """Forward + backward of one micro-batch; returns the detached loss. With `num_items_in_batch` (each
        loss's item count over the accumulation window and all ranks) the model normalizes its losses by those
        counts, and the gradients are summed as they are (see the module docstring)."""
        if not self.model.training:  # (self.model: a torch.compile wrapper does not see evaluation's .eval())
            model.train()
        inputs = self._prepare_inputs(inputs)
        if self._forward_takes_use_cache:
            inputs.setdefault("use_cache", False)  # a KV cache is wasted work in training
        if self._forward_takes_loss_only:
            inputs.setdefault("loss_only", True)  # no logits: training uses the losses alone
        with self.autocast():
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True,
                                              num_items_in_batch=num_items_in_batch)
        empty_every = self.args.torch_empty_cache_steps
        if empty_every is not None and self.state.global_step % empty_every == 0:  # (where transformers does)
            empty_device_cache()
        # Weighted by targets, so that 1 x batch 4 == 2 x batch 2 (micro-batches and ranks alike).
        outputs = outputs if isinstance(outputs, Mapping) else {}  # (a tuple: (loss, logits, ...))
        n, extras = num_items_of(outputs, self.model, inputs, self.parts.loss_targets), extra_losses(outputs)
        counts = item_counts(outputs)  # loss_<name> with its own num_items_<name>: averaged over those
        del outputs  # free logits before backward
        if num_items_in_batch is not None:
            # Already normalized by the window's counts over all ranks; DDP / FSDP average over ranks, hence the
            # world_size factor. The logged `loss` is the window's sum of them: the step's one-big-batch loss.
            (loss * self.world_size if self.world_size > 1 else loss).backward()
            first = self._window_weight is None
            self._window_weight = 1.0  # (something is accumulated)
            self._step_losses.add(extras, 1.0 if n is None else n, counts)
            self._step_losses.add_sum({"loss": loss * self.world_size}, 1.0 if first else 0.0)
            return loss.detach()
        if n is None:  # plain mean loss: weight 1 per micro-batch, no tensor work
            weight = 1.0
            loss.backward()
        else:
            weight = n.to(loss.device)
            (loss * weight).backward()
        self._window_weight = weight if self._window_weight is None else self._window_weight + weight
        self._step_losses.add({"loss": loss, **extras}, weight, counts)  # joins the log averages if the step is finite
        return loss.detach()

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        labels = None
        if (self.compute_loss_func is not None or self._label_smoother is not None) and "labels" in inputs:
            # compute_loss_func / label_smoothing_factor get the labels, the model none (as transformers)
            labels, inputs = inputs["labels"], {k: v for k, v in inputs.items() if k != "labels"}
        if num_items_in_batch is not None:
            inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
        outputs = model(**inputs)
        if labels is not None:
            if self.compute_loss_func is not None:  # (before label smoothing, as transformers)
                loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
            else:
                loss = self._label_smoother(outputs, labels)
                outputs = outputs if isinstance(outputs, Mapping) else {"loss": loss, "logits": outputs[0]}
        elif isinstance(outputs, Mapping):
            if outputs.get("loss") is None:
                raise ValueError(f"The model returned no 'loss' (its output keys: {list(outputs.keys())}; the batch "
                                 f"had {list(inputs)}). Pass labels in the batch, or override compute_loss.")
            loss = outputs["loss"]
        elif isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
            loss = outputs[0]  # (loss, logits, ...) as transformers' return_dict=False outputs
        else:
            raise ValueError(f"The model returned {type(outputs).__name__}; vlmtrain needs a mapping with 'loss'.")
        return (loss, outputs) if return_outputs else loss

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.args.bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _optimizer_step(self, model: nn.Module) -> None:
        for module, hook in self._step_hooks:  # (e.g. models/vision/dummy_vision.py's, on the dummy's gradients)
            hook.before_optimizer_step(module, lambda flag: bool(dist.reduce_cpu([float(flag)], "max")[0]))
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        # Sum of weights over micro-batches (and ranks); DDP averages gradients, hence the world_size factor.
        grads = [p.grad for p in params]
        if self._unsynced:  # a stream ended mid-window under no_sync: average the gradients as DDP would
            for g in grads:
                g.copy_(dist.all_reduce_sum(g) / self.world_size)
            self._unsynced = False
        w, step_total = self._window_weight, None
        if self._window_counts is not None:  # the model normalized each loss by its window total: no division
            self._window_counts = None
        elif self.world_size > 1 or isinstance(w, torch.Tensor) or w != 1.0:  # else the mean is already right
            step_total = total = dist.all_reduce_sum(torch.as_tensor(w, device=self.device).float())
            if grads:
                torch._foreach_mul_(grads, (self.world_size / total).to(grads[0].device))
        if self.args.max_grad_norm > 0:
            self._grad_norm = torch.nn.utils.clip_grad_norm_(params, self.args.max_grad_norm)
        else:
            self._grad_norm = torch.nn.utils.get_total_norm(grads) if grads else None
        if hasattr(self._grad_norm, "full_tensor"):  # FSDP: a DTensor, already reduced over the shards
            self._grad_norm = self._grad_norm.full_tensor()
        self.control = self._event("on_pre_optimizer_step")
        # DDP: gradients (and so their norm) are already identical on every rank: all skip alike.
        if self._grad_norm is None or bool(torch.isfinite(self._grad_norm)):
            self.optimizer.step()
            self.control = self._event("on_optimizer_step")
            self._train_losses.merge(self._step_losses)
            # train_loss: the mean of the steps' losses (each already one where the model counted its items)
            steps = self._step_losses if step_total is None else self._step_losses.step_share(
                "loss", step_total, self.world_size)
            self._run_loss.merge(steps, keys=("loss",))
            self._nonfinite.ok()
        else:
            self._nonfinite.skipped(self.state.global_step + 1, float(self._grad_norm))
        self._step_losses.reset()
        self._last_lrs = learning_rates(self.optimizer)
        self.lr_scheduler.step()
        model.zero_grad(set_to_none=True)
        self._window_weight = None
        self.state.global_step += 1
        steps = self._steps_in_epoch
        self.state.epoch = self._epoch_index + (self._micro_step / steps if steps else 0.0)
        self.control = self._event("on_step_end")
        if self._preemption is not None and self._preemption.requested():
            self.preempted = self.control.should_save = self.control.should_training_stop = True
            warnings.warn(f"preemption signal: stopping after step {self.state.global_step} with a checkpoint; "
                          f"resume with resume_from_checkpoint=True", stacklevel=2)
        self._maybe_log_save_evaluate()
