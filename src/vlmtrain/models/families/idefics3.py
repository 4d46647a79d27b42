"""SmolVLM / Idefics3 (model_types ``idefics3`` and ``smolvlm``): HuggingFaceTB/SmolVLM-Instruct and SmolVLM2.

- Processor: ``Idefics3Processor`` (or an image-only ``SmolVLMProcessor``: the real one insists on a video
  processor, which needs torchvision, and on num2words) with the PIL image processor.
- Template: SmolVLM-Instruct's. It renders only content blocks (string content is dropped), so samples must
  use ``[{"type": "text", ...}]`` content. The generation prompt is ``Assistant:``; what the model generates
  after it is ``" " + text + "<end_of_utterance>"`` (the trailing newline is not generated), so that is what
  the training template marks.
- Batching: each image becomes up to 1 + rows x cols crops; ``pixel_values`` [N_crops, C, H, W] and
  ``pixel_attention_mask`` [N_crops, H, W] are zero-padded per sample to [B, max N_crops, ...] (the model
  drops all-zero crops), as the processor's own batched call does.
- Modules: ``model.vision_model`` (SigLIP), ``model.connector`` (pixel shuffle + projection),
  ``model.text_model`` (Llama / SmolLM) and ``lm_head``.
- Image size: ``data.max_pixels`` / ``min_pixels`` / ``max_image_tokens`` do not apply. The processor resizes
  an image to the checkpoint's ``size.longest_edge`` and cuts it into crops of ``max_image_size`` (plus one
  global view), ``image_seq_len`` tokens each, so the checkpoint's settings already bound its token count.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from typing import Any

from .base import Family

# SmolVLM-Instruct's chat template (chat_template.json), byte for byte.
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# The same, with the assistant's reply after 'Assistant:' and its <end_of_utterance> in generation markers.
TRAINING_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['role'] == 'assistant' %}{{':'}}{% generation %}"
    "{% if message['content'][0]['type'] != 'image' %}{{' '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>"
    "{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# SmolVLM2's (HuggingFaceTB/SmolVLM2-*-Instruct): the same plus a video branch.
SMOLVLM2_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}",
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% elif line['type'] == 'video' %}{{ '<video>' }}{% endif %}")

END_OF_TURN = "<end_of_utterance>"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>", "<image>",
            END_OF_TURN, "<global-img>"] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]

# Tiny sizes: 32 px crops, patch 8, pixel shuffle 2 -> 4 tokens per crop; images are resized to a longest edge
# of 64 px, so an image is at most 2 x 2 crops + the global one.
CROP, PATCH, SCALE = 32, 8, 2


def byte_level_tokenizer(specials: list[str], *, bos: str | None, eos: str, pad: str, unk: str | None = None,
                         add_bos: bool = False, **extra: Any) -> Any:
    """A tokenizer with one token per byte (no merges) after ``specials`` (ids 0..len-1), built offline.

    ``add_bos`` prepends ``bos`` on encode (as Gemma's tokenizer does); ``extra`` goes to the tokenizer
    (e.g. ``extra_special_tokens``)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(specials)}
    for ch in pre_tokenizers.ByteLevel.alphabet():
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, vocab[bos])])
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                   unk_token=unk, padding_side="right", clean_up_tokenization_spaces=False,
                                   **extra)


def saved_processor_kwargs(path: str) -> dict[str, Any]:
    """processor_config.json's init arguments (e.g. image_seq_len), if the directory has one."""
    file = os.path.join(path, "processor_config.json")
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        return {k: v for k, v in json.load(f).items() if k not in ("processor_class", "auto_map")}


def saved_chat_template(path: str, tokenizer: Any) -> str:
    """The chat template a checkpoint directory holds (chat_template.jinja / .json, else the tokenizer's);
    a ConfigError naming the directory if it has none."""
    for name in ("chat_template.jinja", "chat_template.json"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file) as f:
                text = f.read()
            return json.loads(text)["chat_template"] if name.endswith(".json") else text
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        from ...errors import ConfigError

        raise ConfigError(f"{path}: no chat template (chat_template.jinja, chat_template.json or "
                          f"tokenizer_config.json); a Hub VLM checkpoint needs its chat template.")
    return template


def load_processor(path: str) -> Any:
    """An image-only processor for an Idefics3 or SmolVLM checkpoint (Hub id or directory): PIL image
    processor, tokenizer and the checkpoint's chat template; no video processor, so no torchvision."""
    from transformers import AutoImageProcessor, AutoTokenizer, Idefics3Processor

    from . import model_type_of

    if not os.path.isdir(path):
        from huggingface_hub import snapshot_download

        path = snapshot_download(path, allow_patterns=["*.json", "*.jinja", "*.txt", "*.model"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
    kwargs = saved_processor_kwargs(path)
    chat_template = saved_chat_template(path, tokenizer)
    cls = _image_only_smolvlm() if model_type_of(path) == "smolvlm" else Idefics3Processor
    processor = cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template,
                    image_seq_len=kwargs.get("image_seq_len", 169))
    processor.source = path  # (SmolVLM: its video processor settings go along when saved: SavedAsRealClass)
    return processor


@functools.cache
def _image_only_smolvlm() -> type:
    """SmolVLMProcessor without its video processor (torchvision) and num2words (only for video prompts)."""
    from transformers import SmolVLMProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlySmolVLMProcessor(SmolVLMProcessor):
        """SmolVLM's processor for images: everything of SmolVLMProcessor but the video processor."""

        def __init__(self, image_processor, tokenizer, image_seq_len: int = 169, chat_template=None, **kwargs):
            self.fake_image_token = getattr(tokenizer, "fake_image_token", "<fake_token_around_image>")
            self.image_token = getattr(tokenizer, "image_token", "<image>")
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.end_of_utterance_token = getattr(tokenizer, "end_of_utterance_token", END_OF_TURN)
            self.global_image_token = getattr(tokenizer, "global_image_token", "<global-img>")
            self.image_seq_len = image_seq_len
            self.video_token = getattr(tokenizer, "video_token", "<video>")
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

        def apply_chat_template(self, conversation, chat_template=None, **kwargs):
            return ProcessorMixin.apply_chat_template(self, conversation, chat_template, **kwargs)

    from .base import saved_as_real_class

    return saved_as_real_class(ImageOnlySmolVLMProcessor)  # saved as SmolVLMProcessor


def image_tokens(config: Any, batch: Any) -> list[tuple[int, int]]:
    """(patches, image tokens) per crop the vision tower sees: every crop of ``pixel_values`` [B, N, C, H, W]
    that is not all zeros (the model drops those, as padding); its (H / patch) x (W / patch) patches attend to
    each other, and the connector's pixel shuffle makes scale_factor^2 of them one image token."""
    pixels = batch.get("pixel_values")
    if pixels is None:
        return []
    crops = pixels.reshape(-1, *pixels.shape[-3:])
    real = int(((crops == 0).flatten(1).sum(1) != crops[0].numel()).sum()) if len(crops) else 0
    patch = config.vision_config.patch_size
    patches = (crops.shape[-2] // patch) * (crops.shape[-1] // patch)
    return [(patches, patches // config.scale_factor**2)] * real


def build_tiny(out_dir: str, seed: int = 0, model_type: str = "idefics3") -> str:
    """A tiny random-init SmolVLM with its processor, written to ``out_dir``: ``model_type`` 'idefics3'
    (SmolVLM-Instruct: Idefics3ForConditionalGeneration) or 'smolvlm' (SmolVLM2: SmolVLMForConditionalGeneration)."""
    import torch
    import transformers

    if model_type not in ("idefics3", "smolvlm"):
        raise ValueError(f"model_type must be 'idefics3' or 'smolvlm', got {model_type!r}")
    smol = model_type == "smolvlm"
    prefix = "SmolVLM" if smol else "Idefics3"
    module = importlib.import_module(f"transformers.models.{model_type}.image_processing_pil_{model_type}")
    tokenizer = byte_level_tokenizer(SPECIALS, bos="<|im_start|>", eos=END_OF_TURN, pad="<|im_end|>",
                                     unk="<|endoftext|>")
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in SPECIALS}
    image_processor = getattr(module, f"{prefix}ImageProcessorPil")(
        size={"longest_edge": 2 * CROP}, max_image_size={"longest_edge": CROP}, do_image_splitting=True,
        image_mean=[0.5] * 3, image_std=[0.5] * 3)
    image_seq_len = (CROP // PATCH) ** 2 // SCALE**2
    processor_class = _image_only_smolvlm() if smol else transformers.Idefics3Processor
    processor = processor_class(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=image_seq_len,
                                chat_template=SMOLVLM2_CHAT_TEMPLATE if smol else CHAT_TEMPLATE)
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=ids["<|im_end|>"],
                bos_token_id=ids["<|im_start|>"], eos_token_id=ids[END_OF_TURN])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=CROP, patch_size=PATCH)
    config = getattr(transformers, f"{prefix}Config")(
        vision_config=vision, text_config=text, scale_factor=SCALE, image_token_id=ids["<image>"],
        pad_token_id=ids["<|im_end|>"], bos_token_id=ids["<|im_start|>"], eos_token_id=ids[END_OF_TURN],
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
    model.generation_config.pad_token_id = ids["<|im_end|>"]
    model.generation_config.bos_token_id = ids["<|im_start|>"]
    model.generation_config.eos_token_id = ids[END_OF_TURN]
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    if smol:  # as on the Hub: the real class, not our image-only subclass
        file = os.path.join(out_dir, "processor_config.json")
        with open(file) as f:
            data = json.load(f)
        data["processor_class"] = "SmolVLMProcessor"
        with open(file, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
    return out_dir


FAMILY = Family(
    name="idefics3",
    model_types=("idefics3", "smolvlm"),
    training_template=TRAINING_TEMPLATE,
    end_of_turn=END_OF_TURN,
    batch_layout={"pixel_values": "pad_images", "pixel_attention_mask": "pad_images"},
    module_groups={"vision": ("model.vision_model",), "projector": ("model.connector",),
                   "text": ("model.text_model", "lm_head")},
    text_module="model.text_model",
    load_processor=load_processor,
    build_tiny=build_tiny,
    image_tokens=image_tokens,
)
