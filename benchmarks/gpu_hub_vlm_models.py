"""The models of benchmarks/gpu_hub_vlm.py: Qwen3-VL's published 2B / 8B configurations (or the family's tiny one
for --smoke) built on the meta device and initialised in bf16 on the GPU under a seed, the offline processor,
the model directory the hub_vlm kind reads, and the in-memory model handed to it."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from typing import Any

import torch
import transformers

from vlmtrain.models.families import get_family
from vlmtrain.models.families import qwen3_vl as qwen
from vlmtrain.models.families.qwen_common import build_tiny_tokenizer, text_ids, tiny_image_processor
from vlmtrain.models.protocol import MODULE_GROUPS_ATTR
from vlmtrain.models.speed.flops import IMAGE_TOKENS_ATTR
from vlmtrain.models.vision.vision_attention import use_varlen_vision_attention

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
    ``vision_attn`` 'varlen': the vision tower's attention as one call (vlmtrain.models.vision.vision_attention, what
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
