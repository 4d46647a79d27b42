"""Parts of benchmarks/gpu_hub_vlm.py: the models and the contenders (data: gpu_hub_vlm_data.py, the meter:
gpu_hub_vlm_meter.py)."""

from __future__ import annotations

import contextlib
import copy
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
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

import vlmtrain
from vlmtrain.errors import ConfigError
from vlmtrain.models.families import get_family
from vlmtrain.models.families import qwen3_vl as qwen
from vlmtrain.models.families.qwen_common import build_tiny_tokenizer, text_ids, tiny_image_processor
from vlmtrain.models.flops import IMAGE_TOKENS_ATTR, flop_counter
from vlmtrain.models.protocol import MODULE_GROUPS_ATTR
from vlmtrain.models.vision_attention import use_varlen_vision_attention

FAMILY = get_family("qwen3_vl")
REAL_VOCAB = 151_936
# The published Qwen3-VL-2B / -8B-Instruct configurations (config.json on the Hub), special-token ids aside:
# those come from the offline tokenizer (vlmtrain's tiny Qwen tokenizer: bytes + Qwen's special tokens).
SIZES: dict[str, dict[str, Any]] = {
    "2b": {"text": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128},
           "vision": {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
                      "out_hidden_size": 2048, "deepstack_visual_indexes": [5, 11, 17]},
           "tie_word_embeddings": True},
    "8b": {"text": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128},
           "vision": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                      "out_hidden_size": 4096, "deepstack_visual_indexes": [8, 16, 24]},
           "tie_word_embeddings": False},
}
_TEXT_COMMON = {"vocab_size": REAL_VOCAB, "max_position_embeddings": 262_144, "rms_norm_eps": 1e-6,
                "hidden_act": "silu", "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0,
                                                          "mrope_section": [24, 20, 20], "mrope_interleaved": True}}
_VISION_COMMON = {"patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
                  "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh"}
LORA = {"r": 16, "alpha": 32}  # vlmtrain's default targets: every linear layer of the language model
LORA_TARGETS = r"model\.language_model\.(?:.*\.)?(?:down_proj|gate_proj|k_proj|o_proj|q_proj|up_proj|v_proj)"


# -- models ---------------------------------------------------------------------------------------------------
def model_config(size: str, attn: str) -> Any:
    """Qwen3VLConfig of a published size ('2b' / '8b') or 'tiny' (the family's tiny test config, --smoke)."""
    if size == "tiny":
        cfg = qwen.tiny_config()
    else:
        spec, ids = SIZES[size], text_ids()
        tokens = {k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                      "vision_end_token_id")}
        special = {k: ids[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
        cfg = transformers.Qwen3VLConfig(
            text_config={**_TEXT_COMMON, **spec["text"], **special, "tie_word_embeddings": spec["tie_word_embeddings"]},
            vision_config={**_VISION_COMMON, **spec["vision"]}, tie_word_embeddings=spec["tie_word_embeddings"],
            **tokens, **special)
    cfg._attn_implementation = attn
    cfg.text_config._attn_implementation = cfg.vision_config._attn_implementation = attn
    return cfg


def build_model(config: Any, device: torch.device, seed: int, vision_attn: str = "same") -> torch.nn.Module:
    """Random init on the meta device, then materialised on ``device`` in bf16 and initialised under ``seed``
    (the same weights on every call in a process: checked by :func:`checksum`). The family's module groups and
    image-token counts are attached, as the hub_vlm kind does, so vlmtrain's FLOP counter can read them.
    ``vision_attn`` 'varlen': the vision tower's attention as one call (vlmtrain.models.vision_attention, what
    model.attn_implementation: varlen_torch sets; after the model is built, because transformers' checks at
    construction would look for a flash-attention kernel)."""
    with torch.device("meta"):
        # (a copy: the model keeps and may change its config, e.g. vision_attn below)
        model = transformers.Qwen3VLForConditionalGeneration._from_config(copy.deepcopy(config), dtype=torch.bfloat16)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()  # also recomputes the rotary buffers that to_empty left uninitialised
    model.config.use_cache = False
    setattr(model, MODULE_GROUPS_ATTR, dict(FAMILY.module_groups))
    setattr(model, IMAGE_TOKENS_ATTR, lambda batch: FAMILY.image_tokens(model.config, batch))
    if vision_attn == "varlen":
        use_varlen_vision_attention(model)
    return model


def checksum(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return float(sum(p.detach().float().sum() for p in model.parameters()))


def processor_for(size: str) -> Any:
    """Qwen3-VL's processor built offline: the tiny byte-level tokenizer with Qwen's special tokens and chat
    template, and the real checkpoints' image processing (patch 16, merge 2, temporal 2; --smoke: patch 8)."""
    patch = 8 if size == "tiny" else 16
    ip = tiny_image_processor(patch, 2, (0.5,) * 3, (0.5,) * 3)
    ip.size = {"shortest_edge": 4 * 16**2 if size == "tiny" else 65_536, "longest_edge": 16_777_216}
    proc = qwen.processor_class()(image_processor=ip, tokenizer=build_tiny_tokenizer(qwen.CHAT_TEMPLATE),
                                  chat_template=qwen.CHAT_TEMPLATE)
    FAMILY.image_size(proc, None, None, None)  # the family's default cap (1,024 tokens per image), as vlmtrain's
    return proc


def write_model_dir(out: str, config: Any, processor: Any) -> str:
    """config.json + processor files (no weights): what the hub_vlm kind reads its family and processor from."""
    os.makedirs(out, exist_ok=True)
    config.save_pretrained(out)
    processor.image_processor.save_pretrained(out)
    processor.tokenizer.save_pretrained(out)
    with open(os.path.join(out, "chat_template.jinja"), "w") as f:
        f.write(processor.tokenizer.chat_template)
    return out


@contextlib.contextmanager
def hub_models_from(make: Any) -> Iterator[None]:
    """While active, the hub_vlm kind's ``from_pretrained`` returns ``make()`` (the in-memory random-init model)
    instead of reading weights: the benchmark writes no multi-GB checkpoint."""
    import vlmtrain.models.meta as meta

    original = meta.from_pretrained
    meta.from_pretrained = lambda cls, name, **kw: make()
    try:
        yield
    finally:
        meta.from_pretrained = original


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


def run_transformers(s: Setup, meter: Meter) -> list[dict[str, Any]]:
    """transformers.Trainer + BatchedCollator (+ peft LoRA on the language model, as users write it), the same
    sampler order as vlmtrain's (StatefulDistributedSampler, seed), loader waits timed in get_batch_samples."""
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
                                          != "cuda", remove_unused_columns=False, **s.common_args())
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
    """vlmtrain through run.build on a config (model.kind hub_vlm, data.source jsonl, data.packing), the
    kind's loader handed the in-memory model; loader waits timed around the training loader's iterator.
    ``budget``: token-budget micro-batches (gpu_hub_vlm_budget.py). Raises ConfigError when the installed
    vlmtrain refuses the configuration (e.g. data.packing)."""
    from vlmtrain import run
    from vlmtrain.config import load_run_config

    name = "vlmtrain_budget" if budget else "vlmtrain_packed" if packed else "vlmtrain_padded"
    train = {k: v for k, v in s.common_args().items() if k not in ("gradient_checkpointing_kwargs",)}
    if s.opts.activation_checkpointing:
        train["activation_checkpointing_kwargs"] = {"use_reentrant": False}
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


__all__ = ["ConfigError", "Counted", "Meter", "Setup", "batch_stats", "build_model", "checksum", "clock_callback",
           "first_loss", "model_config", "parameter_count", "processor_for", "release", "run_transformers",
           "run_vlmtrain", "write_model_dir", "write_samples", "BatchedCollator", "JsonlSamples"]
