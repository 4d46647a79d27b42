"""transformers' public Trainer methods beyond the training loop, for scripts written for its Trainer: the ones
scripts call after training (log_metrics, save_metrics, save_state, is_world_process_zero, ...), small helpers
(model_init, FLOP and token counts, optimizer introspection), and clear errors for those that need the Hub,
accelerate or DeepSpeed. A mixin of Trainer, kept apart so the loop stays small."""

from __future__ import annotations

import contextlib
import datetime
import inspect
import itertools
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from . import distributed as dist
from .loss_extras import input_tokens, tokens_over_ranks
from .optim import _no_decay_names

# Per-step figures vlmtrain logs besides transformers' keys: they go to on_log (metrics.jsonl, the console, the
# trackers) and never into state.log_history, whose rows stay what transformers' Trainer writes.
STEP_FIGURES = frozenset({
    "samples_per_second", "tokens_per_second", "data_wait_fraction", "data_wait_fraction_max", "tflops_per_second",
    "mfu", "pack_fill", "padding_fraction", "images_per_pack"})


def set_seed(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _refuse(method: str, why: str, instead: str) -> None:
    call = method if "(" in method else f"{method}()"
    raise NotImplementedError(f"Trainer.{call} is not supported by vlmtrain: {why}. Instead: {instead}.")


def _input_tokens_mode(args: Any) -> str:
    """transformers' include_num_input_tokens_seen as 'no' / 'all' / 'non_padding' (True means 'all')."""
    value = getattr(args, "include_num_input_tokens_seen", "no")
    if value is True:
        return "all"
    return "no" if value in (False, None, "no") else str(value)


def _secs2timedelta(secs: float) -> str:
    return f"{datetime.timedelta(seconds=int(secs))}.{int(abs(secs) % 1 * 100):02d}"


class TransformersMethodsMixin:
    """Trainer methods with transformers' names and behaviour (see docs/migrating.md)."""

    # -- construction ----------------------------------------------------------------------------------
    def _resolve_model(self, model: nn.Module | None, model_init: Callable[..., nn.Module] | None,
                       compute_loss_func: Callable[..., Any] | None, optimizers: tuple[Any, Any],
                       optimizer_cls_and_kwargs: tuple[type, dict[str, Any]] | None) -> nn.Module:
        """The model to train: ``model``, or ``model_init()`` (transformers: exactly one of them). Keeps
        ``compute_loss_func`` ((outputs, labels, num_items_in_batch=) -> loss, replacing the model's loss) and
        ``optimizer_cls_and_kwargs``, checked against ``optimizers`` as transformers checks them."""
        self.model_init = model_init
        self.compute_loss_func, self.optimizer_cls_and_kwargs = compute_loss_func, optimizer_cls_and_kwargs
        if model is None and model_init is None:
            raise RuntimeError("Trainer needs a model: Trainer(model=..., args=...) or Trainer(model_init=...).")
        if model is not None and model_init is not None:
            raise ValueError("Trainer takes either a `model` or a `model_init`, not both.")
        self._check_optimizer_arguments(optimizers, optimizer_cls_and_kwargs)
        return model if model is not None else self.call_model_init()

    def _check_optimizer_arguments(self, optimizers: tuple[Any, Any], optimizer_cls_and_kwargs: Any) -> None:
        if optimizer_cls_and_kwargs is not None and optimizers[0] is not None:
            raise RuntimeError("Passing both `optimizers` and `optimizer_cls_and_kwargs` is incompatible: pass one.")
        if self.model_init is not None and (optimizers[0] is not None or optimizers[1] is not None):
            raise RuntimeError("Passing a `model_init` is incompatible with the `optimizers` argument (each train() "
                               "builds a new model): subclass Trainer and override create_optimizer_and_scheduler.")

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """A fresh model from ``model_init`` (called with ``trial`` if it takes one argument)."""
        count = len(inspect.signature(self.model_init).parameters)
        if count > 1:
            raise RuntimeError("model_init should have 0 or 1 argument.")
        model = self.model_init(trial) if count == 1 else self.model_init()
        if model is None:
            raise RuntimeError("model_init should not return None.")
        return model

    def _reinit_model(self, trial: Any = None) -> None:
        """With ``model_init``, every train() starts from a new model (seeded by args.seed), optimizer and
        scheduler, as in transformers."""
        if trial is not None:
            _refuse("train(trial=...)", "hyperparameter-search trials are not supported", "call train() once per "
                    "setting, with Trainer(model_init=...)")
        if self.model_init is None:
            return
        set_seed(self.args.seed)
        self.model = self.call_model_init().to(self.device)
        if self.args.activation_checkpointing:
            from .model_prep import enable_activation_checkpointing

            enable_activation_checkpointing(self.model, self.args.activation_checkpointing_kwargs)
        self.optimizer = self.lr_scheduler = self._flos_params = None
        self.callback_handler.refs["model"] = self.model
        self._forward_takes_use_cache = "use_cache" in inspect.signature(self.model.forward).parameters

    def _begin_session(self, restarted: bool = False) -> float:
        """Just before on_train_begin: this train() call's start (time, step, tokens seen); with ``restarted`` (a
        resume was asked for and no checkpoint exists) callbacks' ``on_restart_without_checkpoint()`` (not a
        transformers event: transformers' callbacks never see it). Returns the start time."""
        if restarted:
            for cb in self.callback_handler.callbacks:
                getattr(cb, "on_restart_without_checkpoint", lambda: None)()
        self._train_start = time.time()
        self._initial_global_step, self._initial_tokens_seen = self.state.global_step, self.state.num_input_tokens_seen
        return self._train_start

    # -- processes -------------------------------------------------------------------------------------
    def is_world_process_zero(self) -> bool:
        """Whether this is the main process of all (rank 0)."""
        return self.rank == 0

    def is_local_process_zero(self) -> bool:
        """Whether this is the main process of its machine (LOCAL_RANK 0 under torchrun)."""
        return int(os.environ.get("LOCAL_RANK", self.rank)) == 0

    def end(self) -> None:
        """End torch.distributed (transformers: ``accelerator.end_training()``); call once, after the last use."""
        dist.shutdown()

    # -- metrics files -----------------------------------------------------------------------------------
    @staticmethod
    def metrics_format(metrics: dict[str, float]) -> dict[str, Any]:
        """Metrics made readable as transformers formats them (runtimes as h:mm:ss.xx, total_flos in GF, floats
        rounded to 4 digits)."""
        out = dict(metrics)
        for key, value in out.items():
            if "_mem_" in key:
                out[key] = f"{value >> 20}MB"
            elif "_runtime" in key:
                out[key] = _secs2timedelta(value)
            elif key == "total_flos":
                out[key] = f"{int(value) >> 30}GF"
            elif isinstance(value, float):
                out[key] = round(value, 4)
        return out

    def log_metrics(self, split: str, metrics: dict[str, float]) -> None:
        """Print ``metrics`` as a table under ``***** <split> metrics *****`` (rank 0)."""
        if not self.is_world_process_zero():
            return
        print(f"***** {split} metrics *****")
        formatted = self.metrics_format(metrics)
        k_width = max(len(str(k)) for k in formatted)
        v_width = max(len(str(v)) for v in formatted.values())
        for key in sorted(formatted):
            print(f"  {key: <{k_width}} = {formatted[key]:>{v_width}}")

    def save_metrics(self, split: str, metrics: dict[str, float], combined: bool = True) -> None:
        """Write ``<output_dir>/<split>_results.json`` and (``combined``) merge into ``all_results.json`` (rank 0)."""
        if not self.is_world_process_zero():
            return
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, f"{split}_results.json"), "w", encoding="utf-8") as f:
            json.dump(metrics, f, indent=4, sort_keys=True)
        if combined:
            path = os.path.join(self.args.output_dir, "all_results.json")
            merged = {}
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    merged = json.load(f)
            merged.update(metrics)
            with open(path, "w", encoding="utf-8") as f:
                json.dump(merged, f, indent=4, sort_keys=True)

    def save_state(self) -> None:
        """Write the trainer state to ``<output_dir>/trainer_state.json`` (rank 0)."""
        if not self.is_world_process_zero():
            return
        os.makedirs(self.args.output_dir, exist_ok=True)
        self.state.save_to_json(os.path.join(self.args.output_dir, "trainer_state.json"))

    def create_model_card(self, language: str | None = None, license: str | None = None,
                          tags: str | list[str] | None = None, model_name: str | None = None,
                          finetuned_from: str | None = None, tasks: str | list[str] | None = None,
                          dataset_tags: str | list[str] | None = None, dataset: str | list[str] | None = None,
                          dataset_args: str | list[str] | None = None) -> None:
        """Write a simple ``README.md`` model card (metadata, hyperparameters, final metrics) to output_dir.
        Nothing is uploaded."""
        if not self.is_world_process_zero():
            return
        listed = {"language": language, "license": license, "tags": tags, "base_model": finetuned_from,
                  "datasets": dataset, "pipeline_tag": tasks}
        meta = [f"{k}: {json.dumps(v)}" for k, v in listed.items() if v]
        name = model_name or os.path.basename(os.path.abspath(self.args.output_dir))
        lines = ["---", *meta, "library_name: vlmtrain", "---", "", f"# {name}", ""]
        if finetuned_from:
            lines += [f"This model is a fine-tuned version of {finetuned_from}.", ""]
        lines += ["## Training hyperparameters", ""]
        for key in ("learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "seed",
                    "optim", "lr_scheduler_type", "num_train_epochs", "max_steps"):
            lines.append(f"- {key}: {getattr(self.args, key)}")
        final = [h for h in self.state.log_history if any(k.startswith("eval_") for k in h)]
        if final:
            lines += ["", "## Evaluation results", ""]
            lines += [f"- {k}: {v}" for k, v in sorted(final[-1].items()) if k.startswith("eval_")]
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, "README.md"), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")

    # -- data ------------------------------------------------------------------------------------------
    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """Batches of a test set for predict(): the eval loader (per_device_eval_batch_size, never packed)."""
        return self.get_eval_dataloader(test_dataset)

    def num_examples(self, dataloader: Any) -> int:
        """Samples in a loader's dataset; without a length, batches x per_device_train_batch_size."""
        try:
            return len(dataloader.dataset)
        except (AttributeError, TypeError):
            return len(dataloader) * self.args.per_device_train_batch_size

    def get_batch_samples(self, epoch_iterator: Iterator[Any], num_batches: int,
                          device: torch.device | None = None) -> tuple[list, torch.Tensor | None]:
        """The next ``num_batches`` batches and their number of label tokens (not -100; shifted for a causal
        LM), as transformers' helper of the same name."""
        from .stats import _causal_lm_loss

        batches = list(itertools.islice(epoch_iterator, num_batches))
        labels = [b["labels"] for b in batches if isinstance(b, dict) and isinstance(b.get("labels"), torch.Tensor)]
        if not labels:
            return batches, None
        shift = _causal_lm_loss(self.model)
        count = sum(int(((lab[..., 1:] if shift else lab) != -100).sum()) for lab in labels)
        return batches, torch.tensor(count, device=device or self.device)

    # -- optimizer -------------------------------------------------------------------------------------
    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        """create_optimizer() then create_scheduler(num_training_steps)."""
        self.create_optimizer()
        self.create_scheduler(num_training_steps=num_training_steps)

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        """Names of the parameters that get weight decay (not biases, norms or other 1-D parameters)."""
        no_decay = _no_decay_names(model)
        return [name for name, _ in model.named_parameters() if name not in no_decay]

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: Any, model: nn.Module | None = None) -> tuple[Any, dict[str, Any]]:
        """The optimizer class and keyword arguments ``args.optim`` names (adamw_torch(_fused) or sgd)."""
        if args.optim == "sgd":
            return torch.optim.SGD, {"lr": args.learning_rate}
        return torch.optim.AdamW, {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2),
                                   "eps": args.adam_epsilon, "fused": args.optim == "adamw_torch_fused" or None}

    def _optimizer_from_cls_and_kwargs(self, model: nn.Module) -> torch.optim.Optimizer:
        """``Trainer(optimizer_cls_and_kwargs=(cls, kwargs))``: ``cls`` over vlmtrain's parameter groups (per-module
        learning rates, weight decay except on biases and norms), the groups' lr and weight_decay kept unless
        ``kwargs`` sets them."""
        from .optim import build_param_groups

        cls, kwargs = self.optimizer_cls_and_kwargs
        groups = build_param_groups(model, self.args)
        for group in groups:
            group.update({k: v for k, v in kwargs.items() if k in ("lr", "weight_decay")})
        return cls(groups, **{k: v for k, v in kwargs.items() if k not in ("lr", "weight_decay")},
                   lr=kwargs.get("lr", self.args.learning_rate))

    def get_learning_rates(self) -> list[float]:
        """The learning rate of each optimizer parameter group."""
        if self.optimizer is None:
            raise ValueError("Trainer optimizer is None: call create_optimizer() (or train()) first.")
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_optimizer_group(self, param: str | nn.Parameter | None = None) -> Any:
        """The optimizer group holding ``param``, else every group's parameters."""
        if self.optimizer is None:
            raise ValueError("Trainer optimizer is None: call create_optimizer() (or train()) first.")
        if param is not None:
            for group in self.optimizer.param_groups:
                if any(p is param for p in group["params"]):
                    return group
        return [group["params"] for group in self.optimizer.param_groups]

    def get_num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def get_total_train_batch_size(self, args: Any) -> int:
        """Samples per optimizer step: per-device batch x accumulation x ranks."""
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * self.world_size

    def get_tp_size(self) -> int:
        return 1

    def get_cp_size(self) -> int:
        return 1

    def get_sp_size(self) -> int:
        return 1

    # -- contexts --------------------------------------------------------------------------------------
    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> contextlib.AbstractContextManager:
        """bf16 autocast when args.bf16, else nothing."""
        return self.autocast()

    def compute_loss_context_manager(self) -> contextlib.AbstractContextManager:
        return self.autocast()

    # -- FLOPs and tokens ----------------------------------------------------------------------------------
    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """transformers' estimate of a batch's training FLOPs: 6 x input tokens x non-embedding parameters (0 for
        a model without ``num_parameters``). vlmtrain's analytic count is logged as tflops_per_second."""
        main = getattr(self.model, "main_input_name", "input_ids")
        if main in inputs and hasattr(self.model, "num_parameters"):
            if getattr(self, "_flos_params", None) is None:
                self._flos_params = self.model.num_parameters(exclude_embeddings=True)
            return 6 * inputs[main].numel() * self._flos_params
        return 0

    def store_flos(self) -> None:
        """Add this process's FLOPs since the last call (over all ranks) to ``state.total_flos``."""
        flos = float(getattr(self, "current_flos", 0.0))
        self.state.total_flos += dist.reduce_cpu([flos])[0] if self.world_size > 1 else flos
        self.current_flos = 0.0

    def _count_batch(self, batch: Any) -> None:
        """Per micro-batch, as transformers' loop: its FLOP estimate and (include_num_input_tokens_seen) its
        input tokens, summed over ranks."""
        if not isinstance(batch, dict):
            return
        self.current_flos = getattr(self, "current_flos", 0.0) + float(self.floating_point_ops(batch))
        mode = _input_tokens_mode(self.args)
        if mode == "no":
            return
        tokens = input_tokens(batch, mode, getattr(self.model, "main_input_name", "input_ids"),
                              getattr(self.processing_class, "pad_token_id", None))
        self.state.num_input_tokens_seen += tokens_over_ranks(tokens)

    def _log_row(self, logs: dict[str, Any], start_time: float | None) -> dict[str, Any]:
        """What state.log_history keeps of a log call: transformers' keys (vlmtrain's per-step figures left
        out), with num_input_tokens_seen (and train_tokens_per_second) when include_num_input_tokens_seen asks."""
        if _input_tokens_mode(self.args) != "no":
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
            if start_time is not None:
                seen = self.state.num_input_tokens_seen - getattr(self, "_initial_tokens_seen", 0)
                runtime = time.time() - start_time
                logs["train_runtime"] = round(runtime, 4)
                if runtime > 0:
                    logs["train_tokens_per_second"] = round(seen / runtime, 3)
        return {k: v for k, v in logs.items() if k not in STEP_FIGURES}

    def _train_speed_metrics(self, start: float, steps: int) -> dict[str, float]:
        """train_runtime / train_samples_per_second / train_steps_per_second over this train() call, counted as
        transformers counts them (planned samples x the share of the steps run)."""
        runtime = time.time() - start
        per_step = self.get_total_train_batch_size(self.args)
        if self.args.max_steps > 0 or self._steps_in_epoch is None:
            planned = self.state.max_steps * per_step
        else:
            planned = self.num_examples(self.train_dataloader) * self.args.num_train_epochs
        samples = planned * steps / max(self.state.max_steps, 1)
        out = {"train_runtime": round(runtime, 4)}
        if runtime > 0:
            out.update(train_samples_per_second=round(samples / runtime, 3),
                       train_steps_per_second=round(steps / runtime, 3))
        return out

    # -- refused ---------------------------------------------------------------------------------------
    def push_to_hub(self, *args: Any, **kwargs: Any) -> None:
        _refuse("push_to_hub", "vlmtrain never talks to the Hub", "trainer.save_model(dir), then "
                "`huggingface_hub.upload_folder(repo_id=..., folder_path=dir)` or `hf upload`")

    def init_hf_repo(self, *args: Any, **kwargs: Any) -> None:
        _refuse("init_hf_repo", "vlmtrain never talks to the Hub", "`huggingface_hub.create_repo(repo_id)`")

    def hyperparameter_search(self, *args: Any, **kwargs: Any) -> None:
        _refuse("hyperparameter_search", "it drives optuna / Ray Tune / wandb sweeps through transformers' "
                "integrations", "loop over your settings yourself, with Trainer(model_init=...) and one train() per "
                "trial, or run `vlmtrain train` under your sweep tool")

    def create_accelerator_and_postprocess(self) -> None:
        _refuse("create_accelerator_and_postprocess", "vlmtrain does not use accelerate", "nothing: the Trainer "
                "sets up devices and torch.distributed (torchrun) in __init__")

    def set_initial_training_values(self, *args: Any, **kwargs: Any) -> None:
        _refuse("set_initial_training_values", "vlmtrain works these out inside train()", "read "
                "trainer.state.max_steps / num_train_epochs in a callback's on_train_begin")

