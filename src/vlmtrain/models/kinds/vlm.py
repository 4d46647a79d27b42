"""model.kind: vlm — vlmtrain's own nanoVLM-style VisionLanguageModel (vision encoder + pixel-shuffle
projector + causal LM decoder), on any the_cauldron-schema source."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any

from vlmtrain.errors import ConfigError
from vlmtrain.models.kinds import ModelKind, choose_collator


def check(cfg: Any) -> None:
    if cfg.model.vision is None or cfg.model.text is None:
        raise ConfigError("model.kind='vlm' needs model.vision and model.text (Hub names, dirs or config "
                          "dicts with model_type).")


def validate(cfg: Any) -> None:
    from vlmtrain.models.own_vlm.build import resolve_config

    m = cfg.model
    for key, spec, causal in (("model.vision", m.vision, False), ("model.text", m.text, True)):
        if isinstance(spec, dict):
            resolve_config(spec, key, causal)  # unknown model types fail before any data is built


def build(cfg: Any, source: dict[str, Any], checkpoint: str | None = None) -> dict[str, Any]:
    """Tokenizer (the checkpoint's, model.tokenizer, or a BPE trained on the first training texts), model,
    processor, collator and the exact-match metric of generated answers."""
    import torch

    from vlmtrain.data.metrics import exact_match_metric
    from vlmtrain.data.processing import VLMProcessor, build_chat_tokenizer
    from vlmtrain.data.vlm_collate import VLMCollator
    from vlmtrain.models.meta import model_init
    from vlmtrain.models.own_vlm.build import build_vlm

    m, d = cfg.model, cfg.data
    train = source["train_dataset"]
    saved = checkpoint if checkpoint and os.path.isfile(os.path.join(checkpoint, "tokenizer_config.json")) else None
    if m.tokenizer is not None or saved:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(saved or m.tokenizer)
    else:
        first = items_across_training(train, 2000, cfg.train.max_steps)
        # The role names too: the chat template writes one per turn, and a BPE that never saw them spends
        # 4-9 tokens a turn spelling "user" / "assistant" (a third of a shapes demo row).
        texts = [s for sample in first for t in (sample.get("texts") or []) if isinstance(t, dict)
                 for k, v in t.items() if isinstance(v, str) for s in (k, v)]
        tokenizer = build_chat_tokenizer(texts, vocab_size=d.tokenizer_vocab_size)
    torch.manual_seed(cfg.train.seed)
    with model_init():  # (meta device on FSDP ranks that receive their shards from rank 0)
        model = build_vlm(m.vision, m.text, pixel_shuffle_factor=m.pixel_shuffle_factor,
                          projector_type=m.projector_type, tokenizer=tokenizer, load_backbone=m.load_backbone,
                          vision_position_scale=m.vision_position_scale,
                          image_index_embeddings=m.image_index_embeddings)
    processor = VLMProcessor(tokenizer, image_size=model.config.image_size,
                             image_token_length=model.config.image_token_length, max_length=d.max_length,
                             max_images=d.max_images, split_large_images=d.split_large_images,
                             mean=d.image_mean, std=d.image_std, images_after_text=d.images_after_text)
    # Saved with the weights (config.json), so `vlmtrain generate` preprocesses images as training did.
    model.config.preprocessing = {"image_mean": list(d.image_mean), "image_std": list(d.image_std),
                                  "split_large_images": d.split_large_images,
                                  "images_after_text": d.images_after_text}
    padded = VLMCollator(processor)
    collator = choose_collator(cfg, model, len(tokenizer), padded,
                               lambda n: VLMCollator(processor, n, d.max_images_per_pack), d.max_length)
    return {**source, "model": model, "tokenizer": tokenizer, "data_collator": collator,
            "compute_metrics": exact_match_metric(tokenizer), "padded_collator": padded,
            "process": processor.process}


def items_across_training(dataset: Any, n: int, total_steps: int) -> Iterator[Any]:
    """Up to ``n`` training items to build a tokenizer from: the first ``n`` of a dataset, but a step-following
    dataset's item ``i`` as step ``i * total_steps // n`` sees it, so that every phase of its curriculum is in
    (its step-0 items may lack whole question types). A step-following dataset is the trainer's
    (data/step_data.py): ``follows_step = True`` and ``get_item_at_step(index, step)``."""
    if not getattr(dataset, "follows_step", False) or total_steps <= 0:
        return itertools.islice(iter(dataset), n)  # (a stream has no len: its first samples)
    n = min(n, len(dataset))
    return (dataset.get_item_at_step(i, i * total_steps // n) for i in range(n))


def owns_checkpoint(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "vlmtrain_vlm"


def load_generator(checkpoint: str, device: str | None = None) -> Callable[..., str]:
    """Load the checkpoint once; the returned answer(prompt, images, max_new_tokens) generates greedily."""
    import torch
    from transformers import AutoTokenizer

    from vlmtrain.data.processing import SkipSample, VLMProcessor
    from vlmtrain.models.own_vlm.vlm import VisionLanguageModel

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    device = torch.device(device or "cpu")
    model = VisionLanguageModel.from_pretrained(checkpoint).to(device).eval()

    def answer(prompt: str, images: list[Any] | None = None, max_new_tokens: int = 32) -> str:
        processor = VLMProcessor.for_checkpoint(tokenizer, model.config, max_images=len(images or []))
        try:  # the template needs an answer to build the sample; generation starts before it
            sample = processor.process({"images": list(images or []), "texts": [{"user": prompt, "assistant": "-"}]})
        except SkipSample as e:
            raise ConfigError(f"cannot use this input: {e.reason} ({e})") from None
        ids = sample["prompt_input_ids"][None].to(device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, pixel_values=sample["pixel_values"].to(device),
                                 attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()

    return answer


def generate(checkpoint: str, prompt: str, images: list[str] | None = None, max_new_tokens: int = 32) -> str:
    return load_generator(checkpoint)(prompt, images, max_new_tokens)


def record_check(cfg: Any) -> Callable[[dict[str, Any]], Any]:
    """The checks the VLMProcessor makes on a raw sample before tokenizing, with the run's data.max_images."""
    import functools

    from vlmtrain.data.processing import VLMProcessor

    return functools.partial(VLMProcessor.check_record, max_images=cfg.data.max_images)


KIND = ModelKind("vlm", build=build, check=check, validate=validate, owns_checkpoint=owns_checkpoint,
                 generate=generate, load_generator=load_generator, record_check=record_check)
