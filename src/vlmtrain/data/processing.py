"""Chat template, loss mask and image transforms for VLM samples (the_cauldron schema).

A sample is ``{"images": [...], "texts": [{"user": str, "assistant": str}, ...]}``; images are paths,
bytes or PIL images. :class:`VLMProcessor` turns one into ``input_ids`` / ``labels`` / ``pixel_values``
/ ``prompt_input_ids``. Conventions shared with the model:

* every encoder input (an image, or a tile / global view of a split image) becomes exactly
  ``image_token_length`` consecutive image-token ids in ``input_ids``;
* ``pixel_values`` holds the encoder inputs in order of appearance, so the model splices the image
  embeddings into the placeholder positions in row-major order.
"""

from __future__ import annotations

import io
import logging
import math
import string
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers.models import BPE, WordLevel
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

IGNORE_INDEX = -100
_ENCODE_CACHE_SIZE = 65536  # texts of <= 256 characters a VLMProcessor keeps tokenised
logger = logging.getLogger(__name__)
IM_START, IM_END, IMAGE_TOKEN = "<|im_start|>", "<|im_end|>", "<image>"
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
# Order fixes the ids: <pad>=0 so zero-filled buffers are padding.
CHAT_SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, IM_START, IM_END, IMAGE_TOKEN)
# ChatML without a default system prompt; matches VLMProcessor for text-only samples.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SKIP_REASONS = ("empty_conversation", "malformed_text", "malformed_json", "missing_image", "corrupt_image",
                "too_many_images", "too_long", "placeholder_mismatch", "bad_head_label", "images_for_text_model",
                "duplicate_image", "no_target", "video_unsupported", "control_token_in_text",
                "placeholder_in_assistant", "bad_aspect_ratio", "image_too_small", "processor_error",
                "video_unreadable", "video_no_frames", "video_too_short", "video_placeholder_mismatch",
                "video_over_token_cap", "too_many_patches", "not_a_pair", "identical_answers",
                "prompt_fills_max_length", "not_a_prompt")


class SkipSample(Exception):
    """A sample that cannot be used; ``reason`` is one of :data:`SKIP_REASONS` (collators count them)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        if reason not in SKIP_REASONS:
            raise ValueError(f"unknown skip reason {reason!r}; expected one of {SKIP_REASONS}")
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)

    def __reduce__(self) -> tuple:  # survives pickling (worker processes), unlike the default args tuple
        return type(self), (self.reason, self.detail)


def process_or_skip(process: Callable[[Any], dict[str, Any]], sample: Any, totals: Counter[str],
                    skipped: Counter[str], keys: list[str]) -> dict[str, Any] | None:
    """What every collator does with one raw sample: count what a stream dropped before it, pass an already
    processed item (a dict with ``input_ids``) through, else ``process`` it; a :class:`SkipSample` is counted
    by reason in ``totals`` (the collator's running total; warned once per reason) and ``skipped`` (this
    batch's), its name (:func:`sample_name`) added to ``keys``, and None returned. A record its source could not
    parse (``__bad__``, e.g. a malformed JSON line) is counted by that reason."""
    from vlmtrain.data.sources import drop_counts, is_counts_only

    for reason, n in drop_counts(sample).items():  # what a stream dropped before this sample
        totals[reason] += n
        skipped[reason] += n
    if is_counts_only(sample):  # the end of a stream: its counts, no sample
        return None
    if isinstance(sample, Mapping) and "input_ids" in sample:
        return dict(sample)
    try:
        if isinstance(sample, Mapping):
            skip_unreadable(sample)
        return process(sample)
    except SkipSample as err:
        key = sample_name(sample)
        if not totals[err.reason]:  # warn once per reason, then only count
            logger.warning("skipping bad sample %s (%s); further ones are only counted", key, err)
        totals[err.reason] += 1
        skipped[err.reason] += 1
        keys.append(f"{key} ({err.reason})")
        return None


def skip_unreadable(sample: Mapping[str, Any]) -> None:
    """A SkipSample for a record its source could not parse (``__bad__``, e.g. a malformed JSON line), with what
    the source said was wrong (the JSON parser's message: line and column)."""
    from vlmtrain.data.sources import BAD_DETAIL

    if sample.get("__bad__"):
        raise SkipSample(str(sample["__bad__"]), str(sample.get(BAD_DETAIL) or "unreadable record"))


def sample_name(sample: Any) -> str:
    """How messages name a sample: its source's key (``file:line`` for JSONL, ``shard:key`` for WebDataset,
    ``<name>:<index>`` for an HF dataset), else its ``id``, else the start of its first user text."""
    from vlmtrain.data.sources import KEY

    if not isinstance(sample, Mapping):
        return f"a {type(sample).__name__} sample"
    if sample.get(KEY) is not None:
        return str(sample[KEY])
    if sample.get("id") is not None:
        return str(sample["id"])
    texts = sample.get("texts")
    first = texts[0] if isinstance(texts, list) and texts else texts
    user = first.get("user") if isinstance(first, Mapping) else None
    return f"(no id, user text {user[:30]!r})" if isinstance(user, str) else "(no id)"


def build_chat_tokenizer(texts_for_training: list[str] | None = None, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A small chat tokenizer trained locally (no Hub access).

    With ``texts_for_training``, a byte-level BPE (every string encodes, never ``<unk>``); with None, a
    character-level vocabulary over printable ASCII (other characters become ``<unk>``). Ids 0-6 are
    ``<pad> <s> </s> <unk> <|im_start|> <|im_end|> <image>``. ``eos_token`` is ``<|im_end|>`` (chat
    generation stops at the end of the assistant turn); ``tokenizer.image_token(_id)`` names the
    placeholder. ``chat_template`` is ChatML.
    """
    if texts_for_training is not None:
        tok = Tokenizer(BPE(unk_token=UNK))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(CHAT_SPECIAL_TOKENS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(list(texts_for_training), trainer=trainer)
    else:
        vocab = {t: i for i, t in enumerate(CHAT_SPECIAL_TOKENS)}
        for ch in string.printable:
            vocab.setdefault(ch, len(vocab))
        tok = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK))
        # One "word" per character, whitespace included; Fuse decodes without inserting spaces.
        tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
        tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(CHAT_SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=IM_END, unk_token=UNK,
        extra_special_tokens={"image_token": IMAGE_TOKEN, "im_start_token": IM_START,
                              "end_of_text_token": EOS},
        padding_side="right", clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


ImageLike = Any  # str | Path | bytes | PIL.Image.Image | {"bytes": ..., "path": ...}


def load_image(image: ImageLike) -> Image.Image:
    """Open a path / bytes / PIL image (or an HF ``{"bytes", "path"}`` dict) as RGB; raise SkipSample."""
    if isinstance(image, dict):  # HF datasets Image(decode=False)
        image = image.get("bytes") or image.get("path")
    if image is None:
        raise SkipSample("missing_image", "image is None")
    if isinstance(image, Image.Image):
        img = image
    elif isinstance(image, (str, Path)):
        if not Path(image).is_file():
            raise SkipSample("missing_image", str(image))
        img = _decode(image, str(image))
    elif isinstance(image, (bytes, bytearray, memoryview)):
        img = _decode(io.BytesIO(bytes(image)), f"{len(image)} bytes")
    else:
        raise SkipSample("corrupt_image", f"unsupported image type {type(image).__name__}")
    return img if img.mode == "RGB" else img.convert("RGB")


def _decode(source: Any, what: str) -> Image.Image:
    try:
        img = Image.open(source)
        img.load()  # force the decode now: a truncated file must fail here, not in the collate step
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise SkipSample("corrupt_image", f"{what}: {err}") from err
    return img


def split_grid(width: int, height: int, image_size: int, max_tiles: int) -> tuple[int, int]:
    """(rows, cols) of tiles for an image: (1, 1) when it fits in ``image_size``; else the grid of at
    most ``max_tiles`` tiles (no more than needed to cover the image) whose aspect ratio is closest to
    the image's, preferring more tiles on ties."""
    need_r, need_c = math.ceil(height / image_size), math.ceil(width / image_size)
    if need_r * need_c <= 1 or max_tiles <= 1:
        return 1, 1
    target = math.log(width / height)
    best = (1, 1)
    best_key = (abs(target), -1)
    for r in range(1, need_r + 1):
        for c in range(1, need_c + 1):
            if r * c > max_tiles:
                continue
            key = (round(abs(math.log(c / r) - target), 9), -r * c)
            if key < best_key:
                best, best_key = (r, c), key
    return best


class VLMProcessor:
    """Turns the_cauldron samples into model inputs with a ChatML template and an exact loss mask.

    Per turn: ``<|im_start|>user\\n`` + image placeholders (all of the sample's images, first user turn
    only) + user text + ``<|im_end|>\\n<|im_start|>assistant\\n`` + assistant text + ``<|im_end|>`` +
    ``\\n``; with ``images_after_text`` the placeholders follow the first user text instead. Labels are the
    ids of the assistant text and its closing ``<|im_end|>``; everything else is -100. Each piece is tokenised
    on its own and the ids are concatenated, so the mask is exact.
    User/assistant text is tokenised with special tokens split, so a literal ``<image>`` in the text
    can never add a placeholder.

    Images are resized to ``image_size`` (bicubic) and normalised with ``mean``/``std``. With
    ``split_large_images``, an image larger than ``image_size`` becomes a grid of up to ``max_tiles``
    tiles (row-major) followed by a global view, each its own encoder input with its own placeholders.

    Bad samples raise :class:`SkipSample`; an over-long sample is dropped (``too_long``), never
    truncated, so an image's token run is never cut.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, image_size: int, image_token_length: int,
                 max_length: int = 512, max_images: int = 4, image_token: str = IMAGE_TOKEN,
                 split_large_images: bool = False, max_tiles: int = 4,
                 mean: Sequence[float] = (0.5, 0.5, 0.5), std: Sequence[float] = (0.5, 0.5, 0.5),
                 images_after_text: bool = False) -> None:
        if image_size < 1 or image_token_length < 1 or max_length < 1 or max_images < 0 or max_tiles < 1:
            raise ValueError("image_size, image_token_length, max_length and max_tiles must be >= 1, "
                             "max_images >= 0")
        self.tokenizer = tokenizer
        self.image_size, self.image_token_length = image_size, image_token_length
        self.max_length, self.max_images = max_length, max_images
        self.image_token, self.split_large_images, self.max_tiles = image_token, split_large_images, max_tiles
        self.images_after_text = images_after_text
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
        self._encoded: dict[tuple[str, bool], list[int]] = {}
        self.image_token_id = self._single_token_id(image_token)
        self.im_end_id = self._single_token_id(IM_END)
        self._single_token_id(IM_START)
        # Template pieces, tokenised once.
        self._user_start = self._encode(f"{IM_START}user\n", split_special=False)
        self._assistant_start = self._encode(f"{IM_END}\n{IM_START}assistant\n", split_special=False)
        self._turn_end = self._encode("\n", split_special=False)

    @classmethod
    def for_checkpoint(cls, tokenizer: PreTrainedTokenizerBase, model_config: Any, **kwargs: Any) -> VLMProcessor:
        """The processor a saved VLM was trained with: image size and tokens per image from its config, image
        normalisation and splitting from the ``preprocessing`` entry the training run saved there."""
        pre = getattr(model_config, "preprocessing", None) or {}
        return cls(tokenizer, image_size=model_config.image_size, image_token_length=model_config.image_token_length,
                   split_large_images=pre.get("split_large_images", False),
                   mean=pre.get("image_mean", (0.5, 0.5, 0.5)), std=pre.get("image_std", (0.5, 0.5, 0.5)),
                   images_after_text=pre.get("images_after_text", False), **kwargs)

    def _single_token_id(self, token: str) -> int:
        ids = self.tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1 or ids[0] == self.tokenizer.unk_token_id:
            raise ValueError(f"tokenizer has no single token for {token!r} (got ids {ids}); add it as a "
                             f"special token, e.g. tokenizer.add_special_tokens(...)")
        return int(ids[0])

    def _encode(self, text: str, split_special: bool = True) -> list[int]:
        # Questions and answers repeat across a dataset (templates, short answers): a tokenizer call costs
        # ~0.1 ms, several per sample. Bounded, so a corpus of unique texts only fills it once.
        key = (text, split_special)
        ids = self._encoded.get(key)
        if ids is None:
            ids = list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=split_special)["input_ids"])
            if len(self._encoded) < _ENCODE_CACHE_SIZE and len(text) <= 256:
                self._encoded[key] = ids
        return list(ids)

    # -- images ---------------------------------------------------------------------------------
    def to_tensor(self, img: Image.Image) -> torch.Tensor:
        """Resize an RGB image to image_size x image_size (bicubic) and normalise: float [3, S, S]."""
        s = self.image_size
        if img.size != (s, s):
            img = img.resize((s, s), Image.Resampling.BICUBIC)
        x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float().div_(255.0)
        return (x - self.mean) / self.std

    def image_views(self, img: Image.Image) -> list[Image.Image]:
        """The encoder inputs of one image: itself, or (when split) its tiles in row-major order + global view."""
        if not self.split_large_images:
            return [img]
        rows, cols = split_grid(img.width, img.height, self.image_size, self.max_tiles)
        if rows * cols == 1:
            return [img]
        s = self.image_size
        grid = img.resize((cols * s, rows * s), Image.Resampling.BICUBIC)
        tiles = [grid.crop((c * s, r * s, (c + 1) * s, (r + 1) * s)) for r in range(rows) for c in range(cols)]
        return [*tiles, img]

    def process_images(self, images: Sequence[ImageLike]) -> torch.Tensor:
        """All encoder inputs of a list of images, stacked: [n_views, 3, S, S] (n_views may be 0)."""
        views = [v for image in images for v in self.image_views(load_image(image))]
        if not views:
            return torch.zeros(0, 3, self.image_size, self.image_size)
        return torch.stack([self.to_tensor(v) for v in views])

    # -- text -----------------------------------------------------------------------------------
    @classmethod
    def check_record(cls, sample: Any, max_images: int | None = None) -> tuple[list[tuple[str, str]], list[Image.Image]]:
        """The checks :meth:`process` makes before tokenizing (no tokenizer needed): (the sample's turns, its
        images opened as RGB), or SkipSample. What `vlmtrain data inspect --config` runs for a ``vlm`` run."""
        if not isinstance(sample, dict):
            raise SkipSample("malformed_text", f"sample is a {type(sample).__name__}, expected a dict")
        skip_unreadable(sample)
        turns = cls._check_texts(sample.get("texts"))
        images = cls._as_image_list(sample.get("images"))
        if max_images is not None and len(images) > max_images:
            raise SkipSample("too_many_images", f"{len(images)} > max_images={max_images}")
        return turns, [load_image(image) for image in images]

    @staticmethod
    def _check_texts(texts: Any) -> list[tuple[str, str]]:
        if texts is None or (isinstance(texts, (list, tuple)) and not texts):
            raise SkipSample("empty_conversation", "no texts")
        if isinstance(texts, dict):  # a single turn given without the list
            texts = [texts]
        if not isinstance(texts, (list, tuple)):
            raise SkipSample("malformed_text", f"texts is a {type(texts).__name__}, expected a list")
        turns = []
        for i, turn in enumerate(texts):
            if not isinstance(turn, dict):
                raise SkipSample("malformed_text", f"turn {i} is a {type(turn).__name__}")
            user, assistant = turn.get("user"), turn.get("assistant")
            if not isinstance(user, str) or not isinstance(assistant, str):
                raise SkipSample("malformed_text", f"turn {i}: user/assistant must be strings")
            if not user.strip() or not assistant.strip():
                raise SkipSample("malformed_text", f"turn {i}: empty user or assistant text")
            turns.append((user, assistant))
        return turns

    @staticmethod
    def _as_image_list(images: Any) -> list[ImageLike]:
        if images is None:
            return []
        if isinstance(images, (list, tuple)):
            return list(images)
        return [images]  # a single image given without the list

    def process(self, sample: dict[str, Any]) -> dict[str, Any]:
        """One sample -> ``input_ids``, ``labels``, ``prompt_input_ids`` (LongTensors), ``pixel_values``
        [n_views, 3, S, S] and ``num_images`` (images before splitting; n_views counts tiles too).

        ``prompt_input_ids`` is ``input_ids`` up to and including the last ``<|im_start|>assistant\\n``:
        generation answers the last assistant turn. Raises :class:`SkipSample` for a bad sample.
        """
        turns, images = self.check_record(sample, self.max_images)
        # Images first: the placeholder count depends on tiling, which needs the image sizes.
        pixel_values = self.process_images(images)
        n_placeholders = pixel_values.shape[0] * self.image_token_length

        ids: list[int] = []
        labels: list[int] = []
        prompt_len = 0
        for i, (user, assistant) in enumerate(turns):
            placeholders = [self.image_token_id] * n_placeholders if i == 0 else []
            text = self._encode(user)
            ctx = self._user_start + (text + placeholders if self.images_after_text else placeholders + text)
            ctx += self._assistant_start
            ids += ctx
            labels += [IGNORE_INDEX] * len(ctx)
            prompt_len = len(ids)  # ends right after this turn's "<|im_start|>assistant\n"
            answer = self._encode(assistant) + [self.im_end_id]  # end-of-turn is supervised
            ids += answer + self._turn_end
            labels += answer + [IGNORE_INDEX] * len(self._turn_end)
            if len(ids) > self.max_length:  # stop tokenising early; the sample is dropped anyway
                raise SkipSample("too_long", f"> max_length={self.max_length} tokens")
        return {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
            "prompt_input_ids": torch.tensor(ids[:prompt_len], dtype=torch.long),
            "pixel_values": pixel_values,
            "num_images": len(images),
        }

    __call__ = process
