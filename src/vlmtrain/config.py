"""Run configuration: one YAML file (sections model, data, train) plus dotted overrides -> RunConfig.

Parsing and type checks are jsonargparse's; this module adds what its errors lack: every unknown key
or section (in a file, on the command line, in overrides) is reported with its section and the nearest
valid keys, and type errors name the key and the expected type, before any model or data is built.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

import vlmtrain.tasks  # noqa: F401 - the tasks register their data sources, which SourceName lists
from vlmtrain.config_checks import (
    allows_none,
    check_argv,
    check_keys,
    field_names,
    normalize_overrides,
    translate_error,
    type_name,
)
from vlmtrain.config_objective import TrainConfig, check_objective
from vlmtrain.data.registry import SOURCES, all_sources
from vlmtrain.errors import ConfigError
from vlmtrain.models.kinds import KINDS, get_kind
from vlmtrain.trainer.args_fields import FsdpValue, WorkersValue

KindName = Literal[tuple(KINDS)]  # type: ignore[valid-type]
SourceName = Literal[tuple(SOURCES)]  # type: ignore[valid-type]


@dataclass
class ModelConfig:
    """What model to train."""

    kind: KindName = "causal_lm"
    """Model kind: causal_lm (any transformers AutoModelForCausalLM), vlm (vlmtrain's own: vision encoder +
    pixel-shuffle projector + causal LM decoder) or hub_vlm (a transformers VLM such as Qwen3-VL, SmolVLM,
    LLaVA-OneVision or Gemma 3, loaded from model.pretrained)."""
    pretrained: str | None = None
    """(causal_lm, hub_vlm) Hub name or local directory (what save_pretrained wrote) to load weights from;
    None (causal_lm only) builds a randomly initialized model from config. A path that names no directory is
    an error before anything loads; offline, `python scripts/build_tiny_hub.py qwen3_vl DIR` writes a tiny
    Hub VLM there."""
    torch_dtype: Literal["float32", "bfloat16"] = "float32"
    """(causal_lm, hub_vlm) dtype of the model's parameters (bfloat16 halves memory, also while FSDP builds and
    loads; a fully trained model's optimizer then updates bfloat16 weights, heads and LoRA adapters stay
    float32). train.bf16 is different: bfloat16 compute from float32 weights."""
    attn_implementation: str | None = None
    """(hub_vlm) transformers attention implementation: eager, sdpa, flash_attention_2, ...; None: its
    default. varlen_torch: vlmtrain's text attention per document with no dense mask (PyTorch's varlen_attn on
    CUDA, torch >= 2.10, bfloat16; one sdpa call per document elsewhere), for packed rows, and a Qwen-VL vision
    tower's attention over all images in one call (not one per image); see docs/hub-vlms.md."""
    heads: dict[str, dict[str, Any]] | None = None
    """(hub_vlm) Score heads on the last non-pad token: {name: {type: classification|regression|reward,
    num_outputs, loss: ce|bce|mse|huber, weight, center_rewards_coefficient (reward)}}; labels come from each
    sample's `labels: {name: value}` (a reward head's: its pair's margin)."""
    lora: dict[str, Any] | None = None
    """(hub_vlm, causal_lm) LoRA adapters through peft: {r, alpha, dropout, target_modules}; target_modules
    default: the language model's linear layers. Checkpoints then hold the adapter and heads only."""
    config: dict[str, Any] = field(default_factory=dict)
    """(causal_lm) transformers config kwargs incl. model_type (e.g. {model_type: llama, hidden_size: 64}); used
    when pretrained is None, otherwise its entries override the pretrained config."""
    tokenizer: str | None = None
    """Hub name or local directory of the tokenizer; None: the data source's own (addition), model.pretrained's
    (causal_lm on text data) or, for vlm, a BPE trained locally on the training texts."""
    vision: str | dict[str, Any] | None = None
    """(vlm) Vision tower: a Hub name or local dir, or a transformers vision config dict with model_type
    (e.g. {model_type: siglip_vision_model, image_size: 64, patch_size: 8, ...})."""
    text: str | dict[str, Any] | None = None
    """(vlm) Language decoder: a Hub name or local dir, or a causal-LM config dict with model_type."""
    pixel_shuffle_factor: int = 2
    """(vlm) Pixel-shuffle factor of the projector: image tokens = patches / factor^2."""
    projector_type: Literal["linear", "mlp"] = "linear"
    """(vlm) Projector after the pixel shuffle: linear or a 2-layer GELU MLP."""
    vision_position_scale: float = 1.0
    """(vlm, random init) Scale of the 2D sin-cos values written into the vision tower's position table: larger
    makes where a patch is weigh more against what it shows (3 in the shapes demo, where relative-position
    questions need it)."""
    image_index_embeddings: int = 0
    """(vlm) Learned vectors (zero at init) added to the tokens of a sample's 1st, 2nd, ... image (later ones share
    the last): tells a sample's images apart, where otherwise only their text positions do (2 in the shapes demo,
    whose multi-image questions compare two images). 0: none."""
    load_backbone: bool = False
    """(vlm) Load pretrained weights for vision/text given as Hub names or dirs; False: their configs only,
    random init."""


@dataclass
class DataCore:
    """The `data.*` keys every source shares (sources add their own: see DataConfig)."""

    source: SourceName = "addition"
    """Data source: addition (synthetic 'a+b=' -> 'c' for a causal LM), shapes (synthetic shapes VQA, one or
    two images per question), shapes_scores (synthetic shapes scenes with score-head labels: object count and the
    named shape's colour, for `model.heads`), shapes_pairs (synthetic shapes questions as preference pairs, a wrong
    answer rejected; with train.objective sft the right answers alone, with grpo prompts with their `answer`), jsonl (one the_cauldron-schema JSONL file, image paths relative to
    the file) or stream (the `sources` below, read as a resumable stream split across ranks and workers)."""
    num_train: int = 20000
    """Number of training samples (addition, shapes, shapes_scores, shapes_pairs)."""
    num_eval: int = 500
    """Number of held-out evaluation samples (addition, shapes_scores, shapes_pairs with pairs; shapes and
    shapes_pairs with train.objective sft: per question type; shapes_pairs with grpo: the demo report's held-out
    questions)."""
    seed: int = 0
    """Seed for generating the data and its train/eval split."""
    train_file: str | None = None
    """(jsonl) Training JSONL file."""
    eval_file: str | None = None
    """(jsonl) Evaluation JSONL file (optional)."""
    sources: list[dict[str, Any]] | None = None
    """(stream) Training sources, each {kind, weight (default 1), ...}: jsonl and wds take `path` (a file,
    glob, {000..009} range or list); hf takes `path` (a load_from_disk dir) or `name` (+ config, split,
    streaming, data_files) for load_dataset; shapes takes num_samples. One source: epochs over its shards;
    several: an endless mixture by weight (set train.max_steps). A source that fails to load is reported
    and skipped."""
    min_ratings: dict[str, float] | None = None
    """(jsonl, stream) Quality filter on the_cauldron rating fields, e.g. {relevance: 3, image_correspondence:
    3, visual_dependency: 3, formatting: 3}: keeps the turns whose `<name>_ratings` entry (per turn) or the
    samples whose `<name>_rating` is at least that; a sample left without turns is dropped (filtered_*)."""
    filter: str | None = None
    """(jsonl, stream) A custom filter 'package.module:function': called with each raw sample, it returns
    True/False to keep/drop it, or a changed sample."""
    max_length: int = 512
    """Samples longer than this many tokens (image tokens included) are skipped and counted, never cut (every kind's
    chat samples; addition's are shorter). (train.objective dpo: TRL's max_length, a pair's prompt + answer cut as
    train.truncation_mode says.)"""
    max_images: int = 4
    """(vlm, hub_vlm) Samples with more images than this are skipped and counted."""
    max_pixels: int | None = None
    """(hub_vlm: Qwen3-VL, Qwen2.5-VL) Images are resized to at most this many pixels (aspect ratio kept; the
    image processor's size.longest_edge) before their tokens are counted. null: the family default, at most
    1,024 image tokens per image (Qwen3-VL 1,048,576 pixels, Qwen2.5-VL 802,816), or the checkpoint's own
    limit if lower. Other families fix their image size: an error there."""
    min_pixels: int | None = None
    """(hub_vlm: Qwen3-VL, Qwen2.5-VL) Smaller images are upscaled to at least this many pixels (the image
    processor's size.shortest_edge). null: the checkpoint's own."""
    max_image_tokens: int | None = None
    """(hub_vlm: Qwen3-VL, Qwen2.5-VL) max_pixels in image tokens: max_image_tokens x (patch x merge)^2 pixels
    (Qwen3-VL 1,024 pixels per token, Qwen2.5-VL 784). Set this or max_pixels, not both."""
    video_fps: float = 2.0
    """(hub_vlm: Qwen3-VL, Qwen2.5-VL) Frames sampled per second of a video (Qwen's published 2); see
    docs/data.md#videos. A video's frames are chosen before it is decoded, and only those are decoded."""
    video_min_frames: int = 4
    """(hub_vlm: Qwen-VL) Fewest frames taken from a video (Qwen's 4); a shorter clip is skipped (video_too_short)."""
    video_max_frames: int = 768
    """(hub_vlm: Qwen-VL) Most frames taken from a video (Qwen's 768, the checkpoints' own limit)."""
    video_max_pixels: int | None = None
    """(hub_vlm: Qwen-VL) Pixels per video frame after the resize, at most. null: 768 video tokens' worth (Qwen's
    published per-frame maximum: Qwen3-VL 786,432, Qwen2.5-VL 602,112), never above the checkpoint's image limit."""
    video_min_pixels: int | None = None
    """(hub_vlm: Qwen-VL) Pixels per video frame after the resize, at least (smaller frames are upscaled), unless
    max_video_tokens needs smaller ones. null: 128 video tokens' worth (Qwen's published minimum)."""
    max_video_tokens: int | None = None
    """(hub_vlm: Qwen-VL) Video tokens of one whole clip, at most: its frames are downscaled (to
    video_min_pixels), then fewer are taken (to video_min_frames), until it fits. null: data.max_length."""
    split_large_images: bool = False
    """(vlm) Split images larger than the encoder's size into tiles plus a global view."""
    images_after_text: bool = False
    """(vlm) A sample's image tokens follow its first question instead of preceding it, so that (causal
    attention) they see the question: each image token can check itself against the objects the question
    names. Saved with the model; generation and evaluation lay prompts out the same way."""
    image_mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    """(vlm) Per-channel mean subtracted from pixels in [0, 1] (SigLIP's 0.5; a synthetic set's background
    colour makes an untrained encoder see the shapes more clearly)."""
    image_std: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    """(vlm) Per-channel standard deviation pixels are divided by."""
    packing: bool | None = None
    """Pack each training batch's samples into rows of pack_length tokens, every sample attending only to
    itself (positions restart per sample). null: on where safe, i.e. when a check on the model finds packed
    logits equal to unpacked ones; true: required (an error if the model fails the check); false: pad.
    hub_vlm: null pads; true packs (Qwen's multimodal positions per sample; not Gemma 3, not with model.heads);
    pack_length, pack_window, max_images_per_pack and max_patches_per_pack need true. Evaluation never packs."""
    pack_length: int | Literal["auto"] | None = None
    """Tokens per packed row (default: max_length for a VLM or Hub VLM, 64 for addition). auto (packing true;
    causal_lm and Qwen-VL Hub VLMs): before the first step, the largest budget whose planned peak memory fits the
    device with a 10% margin (see docs/memory.md); a number that cannot fit data.device_memory is refused."""
    device_memory: str | None = None
    """Memory of one training device the token budget is planned against: a size (80GiB, 40GB) or a device
    (h100-80gb, h200, a100-40gb, ...; see docs/memory.md). null: the CUDA device's total memory; without CUDA,
    pack_length auto needs it."""
    pack_window: int | None = None
    """Pack rows from windows of this many consecutive samples instead of from each batch: rows come out
    nearly full (only a window's last row is partial) and per_device_train_batch_size counts rows of
    pack_length tokens (a step then holds as many samples as fit). Resume re-reads one window at most.
    null: pack each batch's own samples (a step keeps exactly its batch's samples)."""
    max_images_per_pack: int | None = None
    """(vlm, hub_vlm) At most this many images (own VLM: tiles count) in one packed row; null: no cap."""
    max_patches_per_pack: int | None = None
    """(hub_vlm: Qwen3-VL, Qwen2.5-VL; with packing) At most this many vision patches in one packed row, and the
    vision tower's input padded with blank images to a multiple of it (with pack_window and
    per_device_train_batch_size 1, a token-budget micro-batch: exactly this many, every step the same vision
    shape; evaluation batches' to a multiple; the padding never reaches the language model, the loss or the
    logged FLOPs). A multiple of spatial_merge_size^2 (4), at least max_images x the patches of the largest
    image; see docs/hub-vlms.md."""
    pad_to_multiple_of: int | None = None
    """(hub_vlm) Padded batches are as long as their longest sample rounded up to a multiple of this (the name
    of transformers' collators' option), e.g. 64: fewer distinct lengths for train.torch_compile to compile,
    lengths that GPU matrix kernels handle well. null: the longest sample. Packed rows keep pack_length."""
    tokenizer_vocab_size: int = 400
    """(vlm) Vocabulary size of the byte-level BPE trained on the training texts when model.tokenizer is null
    (>= ~400: below that its 263 base symbols leave no room for merges and answers are spelled out)."""


_OPTIONS = tuple(src.options for src in reversed(all_sources()) if src.options is not None)


@dataclass
class DataConfig(*_OPTIONS, DataCore):  # type: ignore[misc]
    """What data to train and evaluate on: the shared keys, then each source's own options.

    (addition: num_digits; shapes: multi_image_fraction, questions_per_sample, side_fraction, side_warmup_steps,
    lookup_warmup_steps.) The first line is the group's heading in --help."""

    def __post_init__(self) -> None:
        for source in all_sources():
            if source.check_options is not None:
                source.check_options(self)
        for name, low in (("num_train", 1), ("num_eval", 0), ("max_length", 1),
                          ("max_images", 0), ("tokenizer_vocab_size", 32)):
            if getattr(self, name) < low:
                raise ConfigError(f"data.{name} must be >= {low}, got {getattr(self, name)}.")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ConfigError("data.image_mean and data.image_std need 3 values (RGB), the std ones > 0.")
        if self.pack_length == "auto" and self.packing is not True:
            raise ConfigError("data.pack_length: auto plans a packed row's token budget: set data.packing: true "
                              "(or give data.pack_length a number).")
        if self.device_memory is not None:
            from vlmtrain.parallel.memory_plan import device_memory

            device_memory(self.device_memory)  # a bad size or device name fails here
        for name in ("pack_length", "max_images_per_pack", "max_patches_per_pack", "pack_window",
                     "pad_to_multiple_of"):
            if isinstance(getattr(self, name), int) and getattr(self, name) < 1:
                raise ConfigError(f"data.{name} must be >= 1 or null, got {getattr(self, name)}.")
        if isinstance(self.pack_length, int) and self.source != "addition" and self.pack_length < self.max_length:
            raise ConfigError(f"data.pack_length={self.pack_length} is below data.max_length={self.max_length}: "
                              f"every sample that fits max_length must fit a pack.")
        for name in ("max_pixels", "min_pixels", "max_image_tokens"):
            if getattr(self, name) is not None and (not isinstance(getattr(self, name), int)
                                                    or getattr(self, name) < 1):
                raise ConfigError(f"data.{name} must be a positive integer or null, got {getattr(self, name)!r}.")
        if self.max_pixels is not None and self.max_image_tokens is not None:
            raise ConfigError("data.max_pixels and data.max_image_tokens both set: set one (max_image_tokens is "
                              "max_pixels counted in image tokens).")
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ConfigError(f"data.min_pixels={self.min_pixels} is above data.max_pixels={self.max_pixels}.")
        from vlmtrain.data.video import VideoSettings

        VideoSettings.from_data(self)  # a bad data.video_* value is an error naming its key, before any work
        if self.filter is not None and ":" not in self.filter:
            raise ConfigError(f"data.filter={self.filter!r} must be 'package.module:function'.")


@dataclass
class RunConfig:
    """A whole run: the model, the data, and TrainingArguments plus the objective (the `train` section)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        # Cross-section checks (the source's, then the kind's), so a mismatch fails before anything is built.
        from vlmtrain.data.registry import get_source

        source = get_source(self.data.source)
        if self.model.kind not in source.kinds:
            wants = " or ".join(repr(k) for k in source.kinds)
            raise ConfigError(f"data.source={self.data.source!r} needs model.kind={wants} "
                              f"(got {self.model.kind!r}).")
        if source.check is not None:
            source.check(self)
        if self.data.max_patches_per_pack is not None and self.model.kind != "hub_vlm":
            raise ConfigError(f"data.max_patches_per_pack pads a Hub VLM's (Qwen-VL) vision tower; model.kind is "
                              f"{self.model.kind!r}. Remove data.max_patches_per_pack (data.max_images_per_pack "
                              f"caps a packed row's images).")
        check_objective(self)
        kind = get_kind(self.model.kind)
        if kind.check is not None:
            kind.check(self)


DEFAULT_RUN_DIR = "runs/default"
SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}


# -- parsing -------------------------------------------------------------------------------------------
def help_formatter() -> type:
    """The --help formatter of every vlmtrain command: jsonargparse's, except that a description keeps its
    lines and wraps without breaking at hyphens (a docs path such as docs/own-vlm.md stays whole)."""
    import textwrap

    import jsonargparse

    class HelpFormatter(jsonargparse.DefaultHelpFormatter):
        def _fill_text(self, text: str, width: int, indent: str) -> str:
            return "\n".join(textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent,
                                            break_on_hyphens=False, break_long_words=False)
                              for line in text.splitlines())

    return HelpFormatter


def build_parser(prog: str = "vlmtrain train", description: str | None = None) -> Any:
    """A jsonargparse parser with --config FILE and one option per key (--train.learning_rate ...)."""
    import jsonargparse

    # Field docstrings (the string under each field) become the --help text of each key.
    jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=True)
    _register_fsdp_value(jsonargparse)
    parser = jsonargparse.ArgumentParser(prog=prog, description=description, exit_on_error=False,
                                         allow_abbrev=False, formatter_class=help_formatter())
    parser.add_argument("--config", action=jsonargparse.ActionConfigFile,
                        help="YAML file with sections model, data, train. Later options override it.")
    for section, cls in SECTIONS.items():
        parser.add_class_arguments(cls, section)
    # A run from the CLI or a YAML file goes under runs/ unless it names its output_dir (TrainingArguments in
    # Python defaults to transformers' trainer_output), and processes its own data (Hub processors, images) in
    # data-loader workers on a GPU machine unless set (in Python: transformers' 0).
    parser.set_defaults({"train.output_dir": DEFAULT_RUN_DIR, "train.dataloader_num_workers": "auto"})
    return parser


def _register_fsdp_value(jsonargparse: Any) -> None:
    """train.fsdp's type (a str subclass, for transformers' HfArgumentParser) takes YAML's true/false and lists
    too; TrainingArguments reads every form."""
    from jsonargparse.typing import get_registered_type, register_type

    if get_registered_type(FsdpValue) is None:
        register_type(FsdpValue, serializer=lambda v: v, deserializer=lambda v: v)
    if get_registered_type(WorkersValue) is None:  # train.dataloader_num_workers: a number or 'auto'
        register_type(WorkersValue, serializer=lambda v: v, deserializer=lambda v: v)


def parse_with(parser: Any, argv: list[str], overrides: dict[str, Any] | None = None) -> tuple[RunConfig, Any]:
    """Parse argv (and Python overrides) with a parser from build_parser; return the RunConfig and the
    parsed namespace (for options a command added, e.g. --checkpoint)."""
    # --config first, so dotted options beat the file wherever they are written.
    front: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "--config":
            front += argv[i:i + 2]
            i += 2
            continue
        (front if argv[i].startswith("--config=") else rest).append(argv[i])
        i += 1
    argv = front + rest
    check_argv(SECTIONS, parser, argv)
    nested = normalize_overrides(SECTIONS, overrides or {})
    check_keys(SECTIONS, nested, "overrides")
    try:
        ns = parser.parse_args(argv)
        if nested:
            ns = parser.parse_object(nested, ns)
    except Exception as e:  # jsonargparse.ArgumentError and friends; ConfigError never comes from here
        raise translate_error(SECTIONS, e) from None
    for section in SECTIONS:
        for key in field_names(SECTIONS, section):
            if ns[f"{section}.{key}"] is None and not allows_none(SECTIONS, section, key):
                raise ConfigError(f"{section}.{key}: expected {type_name(SECTIONS, section, key)}, got null.")
    init = parser.instantiate(ns)  # TrainingArguments' own ConfigError comes through unchanged
    return RunConfig(model=init.model, data=init.data, train=init.train), ns


def parse_run_config(argv: list[str]) -> RunConfig:
    """Parse `--config FILE.yaml` plus dotted overrides (`--train.learning_rate 3e-4`) into a RunConfig."""
    return parse_with(build_parser(), argv)[0]


def load_run_config(path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Load a YAML run config; overrides ({'train.max_steps': 10} or {'train': {...}}) win over the file.
    A dict-valued override replaces the whole value (e.g. all of model.config)."""
    return parse_with(build_parser(), ["--config", str(path)], overrides)[0]


def run_config_to_dict(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Plain nested dict of a RunConfig (sections in model, data, train order)."""
    return {section: dataclasses.asdict(getattr(cfg, section)) for section in SECTIONS}


def save_run_config(cfg: RunConfig, output_dir: str | os.PathLike) -> str:
    """Write the resolved config to output_dir/config.yaml (atomically); load_run_config reads it back equal."""
    os.makedirs(output_dir, exist_ok=True)
    path = Path(output_dir) / "config.yaml"
    tmp = path.with_name(f".config.yaml.tmp-{os.getpid()}")
    tmp.write_text(yaml.safe_dump(run_config_to_dict(cfg), sort_keys=False))
    os.replace(tmp, path)
    return str(path)
