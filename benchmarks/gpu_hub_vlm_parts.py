"""Parts of benchmarks/gpu_hub_vlm.py: the contenders (models: gpu_hub_vlm_models.py; data: gpu_hub_vlm_data.py;
the meter: gpu_hub_vlm_meter.py; token-budget settings: gpu_hub_vlm_budget.py)."""

from __future__ import annotations

import contextlib
import gc
import io
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import transformers
import yaml
from gpu_hub_vlm_budget import config as budget_config  # (beside this file)
from gpu_hub_vlm_budget import max_image_patches
from gpu_hub_vlm_data import BatchedCollator, JsonlSamples, write_samples
from gpu_hub_vlm_meter import Counted, Meter, batch_stats, clock_callback
from gpu_hub_vlm_models import (  # (beside this file)
    FAMILY,
    build_model,
    checksum,
    hub_models_from,
    model_config,
    processor_for,
    write_model_dir,
)
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

import vlmtrain
from vlmtrain.errors import ConfigError
from vlmtrain.models.speed.flops import flop_counter
from vlmtrain.models.speed.liger import liger_version, modeling_globals_restored

LORA = {"r": 16, "alpha": 32}  # vlmtrain's default targets: every linear layer of the language model
LORA_TARGETS = r"model\.language_model\.(?:.*\.)?(?:down_proj|gate_proj|k_proj|o_proj|q_proj|up_proj|v_proj)"


def first_loss(history: list[dict[str, Any]]) -> float:
    return next((float(r["loss"]) for r in history if "loss" in r and r.get("step") == 1), math.nan)


def trainable(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def parameter_count(config: Any) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in transformers.Qwen3VLForConditionalGeneration._from_config(config).parameters())


def release() -> None:
    """Free what the previous contender left (compiled graphs, reference cycles, the allocator's cache)."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- contenders -----------------------------------------------------------------------------------------------
@dataclass
class Setup:
    """What every contender of one model size shares."""

    size: str
    lora: bool
    config: Any
    processor: Any
    data: str
    model_dir: str
    device: torch.device
    opts: Any
    out: str

    def common_args(self) -> dict[str, Any]:
        o = self.opts
        return {"per_device_train_batch_size": o.batch_size, "max_steps": o.steps, "learning_rate": o.lr,
                "weight_decay": 0.0, "lr_scheduler_type": "linear", "warmup_steps": 0, "max_grad_norm": 1.0,
                "logging_steps": 1, "save_strategy": "no", "eval_strategy": "no", "report_to": "none",
                "disable_tqdm": True, "bf16": self.device.type == "cuda", "seed": o.seed,
                "optim": "adamw_torch_fused" if self.device.type == "cuda" else "adamw_torch",
                "dataloader_num_workers": o.workers, "dataloader_pin_memory": self.device.type == "cuda",
                "gradient_checkpointing": o.activation_checkpointing,
                "gradient_checkpointing_kwargs": {"use_reentrant": False} if o.activation_checkpointing else None,
                "torch_compile": o.torch_compile}


def liger_skip(device: torch.device) -> str | None:
    """Why the "transformers + liger" contender cannot run here (None: it can)."""
    if device.type != "cuda":
        return "Liger's kernels are Triton kernels: CUDA only"
    if liger_version() is None:
        return "liger-kernel is not installed (pip install liger-kernel, or its wheel in .whl/)"
    return None


def run_transformers(s: Setup, meter: Meter, liger: bool = False) -> list[dict[str, Any]]:
    """transformers.Trainer + BatchedCollator (+ peft LoRA on the language model, as users write it), the same
    sampler order as vlmtrain's (StatefulDistributedSampler, seed), loader waits timed in get_batch_samples.
    ``liger``: TrainingArguments(use_liger_kernel=True), Liger's defaults for Qwen3-VL (RMSNorm, RoPE and its
    fused linear cross-entropy loss)."""
    model = build_model(s.config, s.device, s.opts.seed, s.opts.vision_attn)
    meter.init = checksum(model)
    if s.lora:  # (right after the init, as vlmtrain does: the same random state, the same adapter weights)
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"],
                                                           lora_dropout=0.0, target_modules=LORA_TARGETS))
    dataset = JsonlSamples(s.data)

    class Metered(transformers.Trainer):
        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            return StatefulDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=s.opts.seed)

        def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
            start = time.perf_counter()
            batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)
            waited = time.perf_counter() - start
            for b in batches:
                meter.fetched(b, waited / max(1, len(batches)))
            return batches, items

    args = transformers.TrainingArguments(output_dir=os.path.join(s.out, "transformers"), use_cpu=s.device.type
                                          != "cuda", remove_unused_columns=False, use_liger_kernel=liger,
                                          **s.common_args())
    collator = Counted(BatchedCollator(s.processor), flop_counter(model))
    meter.trainable = trainable(model)
    trainer = Metered(model=model, args=args, train_dataset=dataset, data_collator=collator,
                      callbacks=[clock_callback(meter, transformers.TrainerCallback)])
    with transformers_quiet(), contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    history = trainer.state.log_history
    trainer.accelerator.free_memory()
    return history


def run_vlmtrain(s: Setup, meter: Meter, packed: bool, budget: bool = False) -> list[dict[str, Any]]:
    """vlmtrain through run.build on a config (model.kind hub_vlm, data.source jsonl, data.packing, --liger:
    train.use_liger_kernel), the kind's loader handed the in-memory model; loader waits timed around the
    training loader's iterator. ``budget``: token-budget micro-batches (gpu_hub_vlm_budget.py). Raises ConfigError
    when the installed vlmtrain refuses the configuration (e.g. data.packing, or use_liger_kernel without CUDA)."""
    from vlmtrain import run
    from vlmtrain.config import load_run_config

    name = "vlmtrain_budget" if budget else "vlmtrain_packed" if packed else "vlmtrain_padded"
    train = {k: v for k, v in s.common_args().items() if k not in ("gradient_checkpointing_kwargs",)}
    if s.opts.activation_checkpointing:
        train["activation_checkpointing_kwargs"] = {"use_reentrant": False, "mode": s.opts.checkpointing_mode}
    if s.opts.liger:  # (Liger's RMSNorm, RoPE, SwiGLU; vlmtrain's own chunked loss)
        train["use_liger_kernel"] = True
    attn = "varlen_torch" if packed and s.opts.text_attn == "varlen" else s.opts.attn  # (set on the text model)
    cfg = {"model": {"kind": "hub_vlm", "pretrained": s.model_dir, "torch_dtype": "bfloat16",
                     "attn_implementation": attn, **({"lora": dict(LORA)} if s.lora else {})},
           "data": {"source": "jsonl", "train_file": s.data, "num_eval": 0, "max_length": 8192,
                    "packing": packed, "pad_to_multiple_of": s.opts.pad_to_multiple_of},
           "train": {"output_dir": os.path.join(s.out, name), **train}}
    if budget:
        data, train_keys, cfg["model"]["attn_implementation"] = budget_config(s.opts, max_image_patches(s.processor))
        cfg["data"].update(data)
        cfg["train"].update(train_keys)
    path = os.path.join(s.out, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)

    def make() -> torch.nn.Module:
        model = build_model(s.config, s.device, s.opts.seed, s.opts.vision_attn)
        meter.init = checksum(model)
        return model

    with hub_models_from(make):
        trainer = run.build(load_run_config(path))
    trainer.data_collator = Counted(trainer.data_collator, flop_counter(trainer.model))  # (PeftModel with LoRA)
    meter.trainable = trainable(trainer.model)
    trainer.add_callback(clock_callback(meter, vlmtrain.TrainerCallback))
    make_loader = trainer.get_train_dataloader

    def metered_loader() -> StatefulDataLoader:
        loader = make_loader()

        class MeteredLoader(type(loader)):  # type: ignore[misc]
            def __iter__(self) -> Iterator[Any]:
                return meter.wrap(super().__iter__())

        loader.__class__ = MeteredLoader
        return loader

    trainer.get_train_dataloader = metered_loader
    with contextlib.redirect_stdout(io.StringIO()):  # (the per-step log lines)
        trainer.train()
    return trainer.state.log_history


@contextlib.contextmanager
def transformers_quiet() -> Iterator[None]:
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)


__all__ = ["BatchedCollator", "ConfigError", "Counted", "FAMILY", "JsonlSamples", "Meter", "Setup", "batch_stats",
           "build_model", "checksum", "clock_callback", "first_loss", "liger_skip", "model_config",
           "modeling_globals_restored", "parameter_count", "processor_for", "release", "run_transformers",
           "run_vlmtrain", "write_model_dir", "write_samples"]
