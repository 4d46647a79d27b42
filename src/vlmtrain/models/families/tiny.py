"""What every Hub family's tiny builder shares: a byte-level tokenizer built offline and the random-init save."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def byte_level_tokenizer(specials: list[str] | tuple[str, ...], *, bos: str | None, eos: str, pad: str,
                         unk: str | None = None, add_bos: bool = False, specials_last: bool = False,
                         **extra: Any) -> Any:
    """A tokenizer with one token per byte (no merges) and ``specials``, built offline: the specials take ids
    0..len-1 and the bytes follow, or with ``specials_last`` the 256 bytes (sorted) come first (Qwen's layout).

    ``add_bos`` prepends ``bos`` on encode (as Gemma's tokenizer does); ``extra`` goes to the tokenizer
    (e.g. ``extra_special_tokens``)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # (a set: its order changes from process to process)
    vocab = {ch: i for i, ch in enumerate(alphabet)} if specials_last else {s: i for i, s in
                                                                                     enumerate(specials)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, vocab[bos])])
    tok.add_special_tokens(list(specials))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                   unk_token=unk, padding_side="right", clean_up_tokenization_spaces=False,
                                   **extra)


def save_tiny(out_dir: str, model_class: type, config: Any, processor: Any, seed: int,
              generation: Mapping[str, Any] | None = None, parts: bool = False) -> str:
    """Random-init ``model_class(config)`` under ``seed``, set its ``generation`` config ids, and save model and
    processor to ``out_dir``. ``parts``: the processor as image processor + tokenizer + chat_template.jinja (no
    processor_config.json); otherwise whole, an image-only processor naming its real class (as on the Hub)."""
    import torch

    from .processors import SavedAsRealClass, set_processor_class

    torch.manual_seed(seed)
    model = model_class(config).eval()
    for key, value in (generation or {}).items():
        setattr(model.generation_config, key, value)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    if parts:
        processor.image_processor.save_pretrained(out_dir)
        processor.tokenizer.save_pretrained(out_dir)
        with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
            f.write(processor.tokenizer.chat_template)
    else:
        processor.save_pretrained(out_dir)
        if isinstance(processor, SavedAsRealClass):
            set_processor_class(os.path.join(out_dir, "processor_config.json"), processor.saved_class_name,
                                tiny=True)
    return out_dir


def tiny_text(tokenizer: Any, **settings: Any) -> dict[str, Any]:
    """A tiny language model's config: hidden 64 / 2 layers / 4 heads (2 key-value), the tokenizer's vocabulary,
    untied embeddings; ``settings`` add to or change it."""
    return {**dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                   tie_word_embeddings=False), **settings}


def tiny_vision(image_size: int, patch_size: int, **settings: Any) -> dict[str, Any]:
    """A tiny vision tower's config: hidden 32 / 1 layer / 2 heads; ``settings`` add to or change it."""
    return {**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   image_size=image_size, patch_size=patch_size), **settings}


def token_ids(tokenizer: Any, **tokens: str) -> dict[str, int]:
    """Config key -> id of the token named, e.g. ``token_ids(tok, pad_token_id="<pad>")``."""
    return {key: tokenizer.convert_tokens_to_ids(token) for key, token in tokens.items()}
