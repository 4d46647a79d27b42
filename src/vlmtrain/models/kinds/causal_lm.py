"""model.kind: causal_lm — any transformers AutoModelForCausalLM, random init from model.config or loaded
from model.pretrained, on a tokenized source (addition) or any text source (jsonl / stream)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from vlmtrain.errors import ConfigError
from vlmtrain.models.kinds import ModelKind, choose_collator


def _tokenized(sample: dict[str, Any]) -> dict[str, Any]:
    return sample  # tokenized sources (a module-level function: it goes to DataLoader workers)


def validate(cfg: Any) -> None:
    from vlmtrain.models.hub.causal_lm import check_model_type

    if cfg.model.pretrained is None:
        check_model_type(cfg.model.config)  # a bad model_type fails before any data is built


def _tokenizer(cfg: Any, checkpoint: str | None) -> Any:
    from transformers import AutoTokenizer

    saved = checkpoint if checkpoint and os.path.isfile(os.path.join(checkpoint, "tokenizer_config.json")) else None
    name = saved or cfg.model.tokenizer or cfg.model.pretrained
    if name is None:
        raise ConfigError(f"model.kind='causal_lm' on data.source={cfg.data.source!r} needs a tokenizer: set "
                          f"model.tokenizer or model.pretrained.")
    tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token is None:  # many causal LMs ship none: pad with eos (padding is masked anyway)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenizer_for(cfg: Any) -> Any:
    """The tokenizer a run of ``cfg`` trains with (model.tokenizer, else model.pretrained's)."""
    return _tokenizer(cfg, None)


def build(cfg: Any, source: dict[str, Any], checkpoint: str | None = None) -> dict[str, Any]:
    import torch

    from vlmtrain.data.packing import PackingCollator
    from vlmtrain.models.hub.causal_lm import build_causal_lm
    from vlmtrain.models.meta import model_init
    from vlmtrain.models.speed.lm_loss import enable_lm_loss

    parts = dict(source)
    if "tokenizer" not in parts:  # raw text samples: tokenized by the model's tokenizer
        from vlmtrain.data.metrics import exact_match_metric
        from vlmtrain.data.text import TextChatProcessor, TextCollator

        tokenizer = _tokenizer(cfg, checkpoint)
        processor = TextChatProcessor(tokenizer, max_length=cfg.data.max_length)
        padded = TextCollator(processor)
        parts.update(tokenizer=tokenizer, data_collator=padded, compute_metrics=exact_match_metric(tokenizer),
                     process=processor.process, packed=lambda n: TextCollator(processor, n))
    else:
        pad_id = parts["tokenizer"].pad_token_id
        padded = parts["data_collator"]
        parts.update(process=_tokenized,
                     packed=lambda n: PackingCollator(n, pad_id, padding_collator=padded))
    tokenizer = parts["tokenizer"]
    dtype = getattr(torch, cfg.model.torch_dtype)
    with model_init():  # (meta device on FSDP ranks that receive their shards from rank 0)
        parts["model"] = build_causal_lm(config=cfg.model.config or None, pretrained=cfg.model.pretrained,
                                         tokenizer=tokenizer, seed=cfg.train.seed, dtype=dtype)
    enable_lm_loss(parts["model"])  # the LM head only at the targets, chunked (for the types it knows)
    if cfg.model.lora:
        from vlmtrain.models.hub.lora import apply_lora

        torch.manual_seed(cfg.train.seed)  # a reproducible adapter init (as TRL's trainers: after set_seed)
        parts["model"] = apply_lora(parts["model"], cfg.model.lora, text_module="")
    default_length = 64 if "tokenizer" in source else cfg.data.max_length  # (tokenized: short samples)
    parts["data_collator"] = choose_collator(cfg, parts["model"], len(tokenizer), padded, parts.pop("packed"),
                                             default_length)
    parts["padded_collator"] = padded
    return parts


def pairs(cfg: Any, tokenizer: Any = None) -> Any:
    """The pair collator of train.objective dpo (text pairs: data/pairs.py); tokenizer None: the run's."""
    from vlmtrain.data.pairs import PairCollator, TextPairProcessor

    tokenizer = tokenizer if tokenizer is not None else _tokenizer(cfg, None)
    processor = TextPairProcessor(tokenizer, cfg.data.max_length, cfg.train.truncation_mode)
    return PairCollator(processor.process, tokenizer.pad_token_id, cfg.data.max_length, cfg.train.truncation_mode,
                        tokenizer, padding_free=bool(cfg.data.packing))


def load_generator(checkpoint: str, device: str | None = None) -> Callable[..., str]:
    """Load the checkpoint once; the returned answer(prompt, images, max_new_tokens) generates greedily."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    device = torch.device(device or "cpu")
    model = AutoModelForCausalLM.from_pretrained(checkpoint).to(device).eval()

    def answer(prompt: str, images: list[Any] | None = None, max_new_tokens: int = 32) -> str:
        if images:
            raise ConfigError(f"{checkpoint} holds a text-only model: it cannot be given images.")
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        if tokenizer.bos_token_id is not None:
            ids = torch.cat([torch.tensor([[tokenizer.bos_token_id]]), ids], dim=1)
        ids = ids.to(device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()

    return answer


def generate(checkpoint: str, prompt: str, images: list[str] | None = None, max_new_tokens: int = 32) -> str:
    if images:
        raise ConfigError(f"{checkpoint} holds a text-only model: --image cannot be used with it.")
    return load_generator(checkpoint)(prompt, None, max_new_tokens)


KIND = ModelKind("causal_lm", build=build, validate=validate, generate=generate, load_generator=load_generator,
                 pairs=pairs)
