"""transformers' public Trainer methods that the loop never calls, for scripts written for its Trainer: the ones
scripts call after training (log_metrics, save_metrics, save_state, is_world_process_zero, ...), optimizer and
batch introspection, and clear errors for those that need the Hub, accelerate or DeepSpeed. A mixin of
:class:`vlmtrain.Trainer` (vlmtrain/compat/trainer.py), kept out of the trainer core."""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..trainer import distributed as dist
from ..trainer.optim import _no_decay_names


def _refuse(method: str, why: str, instead: str) -> None:
    call = method if "(" in method else f"{method}()"
    raise NotImplementedError(f"Trainer.{call} is not supported by vlmtrain: {why}. Instead: {instead}.")


def _secs2timedelta(secs: float) -> str:
    return f"{datetime.timedelta(seconds=int(secs))}.{int(abs(secs) % 1 * 100):02d}"


class TransformersTrainerMethods:
    """Trainer methods with transformers' names and behaviour (see docs/migrating.md), over TrainerCore's
    attributes (args, state, model, optimizer, rank, world_size)."""

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
    def get_batch_samples(self, epoch_iterator: Iterator[Any], num_batches: int,
                          device: torch.device | None = None) -> tuple[list, torch.Tensor | None]:
        """The next ``num_batches`` batches and their number of label tokens (not -100; shifted for a causal
        LM), as transformers' helper of the same name."""
        from ..models.speed.lm_loss import _causal_lm_loss

        batches = list(itertools.islice(epoch_iterator, num_batches))
        labels = [b["labels"] for b in batches
                  if isinstance(b, Mapping) and isinstance(b.get("labels"), torch.Tensor)]
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
