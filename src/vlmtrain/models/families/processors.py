"""What every Hub family's processor shares: loading one offline-friendly (PIL image processor, tokenizer, the
checkpoint's chat template; never a video processor, so torchvision is not needed), the image-only subclasses of
transformers' processor classes, and saving them under the real class's name."""

from __future__ import annotations

import functools
import inspect
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

VIDEO_CONFIG = "video_preprocessor_config.json"


class SavedAsRealClass:
    """Mixin for vlmtrain's image-only processor subclasses: ``save_pretrained`` names the transformers class
    they derive from (e.g. ``Qwen3VLProcessor``) in processor_config.json and tokenizer_config.json, so
    ``transformers.AutoProcessor.from_pretrained(dir)`` builds the real processor (its video processor needs
    torchvision installed) instead of falling back to a bare tokenizer. vlmtrain's own loaders
    (``Family.load_processor``) still build the image-only class, without torchvision."""

    saved_class_name: str = ""
    """The transformers processor class written into the saved files."""

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()  # type: ignore[misc]
        out["processor_class"] = self.saved_class_name
        return out

    source: str | None = None
    """Where the processor was loaded from (a directory; set by :func:`load_processor`): the video processor
    settings transformers reads there are written along on save (:func:`video_settings`), so the real class
    finds its video processor's settings."""

    def save_pretrained(self, save_directory: str, *args: Any, **kwargs: Any) -> Any:
        files = super().save_pretrained(save_directory, *args, **kwargs)  # type: ignore[misc]
        set_processor_class(os.path.join(save_directory, "tokenizer_config.json"), self.saved_class_name)
        same = self.source is not None and os.path.abspath(self.source) == os.path.abspath(save_directory)
        settings = video_settings(self.source, self.saved_class_name) if self.source and not same else None
        if settings is not None:
            with open(os.path.join(save_directory, VIDEO_CONFIG), "w", encoding="utf-8") as f:
                json.dump(settings, f, indent=2, sort_keys=True)
                f.write("\n")
        return files


def video_settings(source: str, processor_class: str) -> dict[str, Any] | None:
    """The video processor settings transformers' AutoVideoProcessor reads from the checkpoint directory
    ``source`` (its own lookup, ``BaseVideoProcessor.get_video_processor_dict``: processor_config.json's
    ``video_processor``, else video_preprocessor_config.json, else the image processor's preprocessor_config.json),
    when the transformers class ``processor_class`` takes a video processor; None otherwise (no such class
    argument, or no settings anywhere)."""
    import transformers

    real = getattr(transformers, processor_class, None)
    if real is None or "video_processor" not in inspect.signature(real.__init__).parameters:
        return None
    from transformers.video_processing_utils import BaseVideoProcessor

    try:
        settings, _ = BaseVideoProcessor.get_video_processor_dict(source, local_files_only=True)
    except OSError:  # (no settings in any of the three places)
        return None
    return settings


def saved_as_real_class(cls: type) -> type:
    """``cls`` (a subclass of a transformers processor class) saving under its first transformers base's name."""
    real = next(b for b in cls.__mro__[1:] if b.__module__.startswith("transformers."))
    return type(cls.__name__, (SavedAsRealClass, cls), {"saved_class_name": real.__name__,
                                                       "__doc__": cls.__doc__, "__module__": cls.__module__})


def set_processor_class(path: str, name: str, *, tiny: bool = False) -> None:
    """Name ``name`` as ``processor_class`` in a saved JSON file (tokenizer_config.json, processor_config.json).
    ``tiny``: the layout the tiny builders have always written (keys sorted, no final newline)."""
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if tiny:
        config["processor_class"] = name
        with open(path, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    elif config.get("processor_class") not in (None, name):
        config["processor_class"] = name
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
            f.write("\n")


@functools.cache
def image_only_processor_class(base: type) -> type:
    """A subclass of a transformers processor class that takes no video processor (which would need torchvision);
    it saves under the real class's name (see :class:`SavedAsRealClass`)."""

    class ImageOnlyProcessor(base):  # type: ignore[misc, valid-type]
        __doc__ = f"{base.__name__} with an image processor and a tokenizer only (no video processor)."

        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                      **kwargs: Any) -> None:
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    # The base's own parameters (less the video processor): to_dict saves the attributes the signature names.
    sig = inspect.signature(base.__init__)
    ImageOnlyProcessor.__init__.__signature__ = sig.replace(  # type: ignore[attr-defined]
        parameters=[p for p in sig.parameters.values() if p.name != "video_processor"])
    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = f"ImageOnly{base.__name__}"
    return saved_as_real_class(ImageOnlyProcessor)  # saved as {base.__name__}: AutoProcessor loads the real one


@functools.cache
def image_only_smolvlm() -> type:
    """SmolVLMProcessor without its video processor. Unlike :func:`image_only_processor_class`, it cannot run
    SmolVLMProcessor's own ``__init__`` (that requires num2words, used only for video prompts), so it sets the
    attributes that ``__init__`` would, and its chat template needs no video processor's frame rate."""
    from transformers import SmolVLMProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlySmolVLMProcessor(SmolVLMProcessor):
        """SmolVLM's processor for images: everything of SmolVLMProcessor but the video processor."""

        def __init__(self, image_processor, tokenizer, image_seq_len: int = 169, chat_template=None, **kwargs):
            self.fake_image_token = getattr(tokenizer, "fake_image_token", "<fake_token_around_image>")
            self.image_token = getattr(tokenizer, "image_token", "<image>")
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.end_of_utterance_token = getattr(tokenizer, "end_of_utterance_token", "<end_of_utterance>")
            self.global_image_token = getattr(tokenizer, "global_image_token", "<global-img>")
            self.image_seq_len = image_seq_len
            self.video_token = getattr(tokenizer, "video_token", "<video>")
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

        def apply_chat_template(self, conversation, chat_template=None, **kwargs):
            return ProcessorMixin.apply_chat_template(self, conversation, chat_template, **kwargs)

    return saved_as_real_class(ImageOnlySmolVLMProcessor)  # saved as SmolVLMProcessor


def saved_processor_kwargs(path: str) -> dict[str, Any]:
    """processor_config.json's init arguments (e.g. image_seq_len), if the directory has one."""
    file = os.path.join(path, "processor_config.json")
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        return {k: v for k, v in json.load(f).items() if k not in ("processor_class", "auto_map")}


def saved_chat_template(path: str, tokenizer: Any) -> str:
    """The chat template a checkpoint directory holds: the processor's own file (chat_template.jinja /
    .json, what the model card uses), else the tokenizer's; a ConfigError naming the directory if it has none."""
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


def transformers_processor(name: str, path: str | None = None) -> type:
    """transformers' processor class ``name`` (``path``: the checkpoint, as :func:`load_processor` passes it)."""
    import transformers

    return getattr(transformers, name)


def image_only(name: str, path: str | None = None) -> type:
    """transformers' processor class ``name`` without a video processor (:func:`image_only_processor_class`)."""
    return image_only_processor_class(transformers_processor(name))


def load_processor(processor_class: type | Callable[[str], type], path: str, keys: tuple[str, ...] = (),
                   from_image_processor: Mapping[str, Any] | None = None) -> Any:
    """A family's processor for a Hub id or a checkpoint directory: PIL image processor (never torchvision),
    tokenizer, the checkpoint's chat template and the ``keys`` of its processor_config.json (else the image
    processor's attribute of ``from_image_processor``'s key, else its value there, else the class's default).
    AutoProcessor is not used: on a checkpoint without a video processor it returns a bare tokenizer, and with
    one it needs torchvision. ``processor_class``: the class, or a function of the checkpoint directory
    returning it (a family binds it with functools.partial)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    if not os.path.isdir(path):
        from huggingface_hub import snapshot_download

        path = snapshot_download(path, allow_patterns=["*.json", "*.jinja", "*.txt", "*.model"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
    kwargs = {k: getattr(image_processor, k, v) for k, v in (from_image_processor or {}).items()}
    kwargs.update({k: v for k, v in saved_processor_kwargs(path).items() if k in keys})
    cls = processor_class if isinstance(processor_class, type) else processor_class(path)
    processor = cls(image_processor=image_processor, tokenizer=tokenizer,
                    chat_template=saved_chat_template(path, tokenizer), **kwargs)
    if isinstance(processor, SavedAsRealClass):
        processor.source = path  # its video processor settings go along when saved (SavedAsRealClass)
    return processor
