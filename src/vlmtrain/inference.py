"""Inference from a trained checkpoint: `load_for_inference` -> an InferenceModel that scores and generates.

    import vlmtrain
    m = vlmtrain.load_for_inference("runs/x/checkpoint-500")      # cuda + bfloat16 if there is a GPU
    m.score([{"images": ["a.png", "b.png"], "texts": [{"user": "Rate this pair."}]}])
    # -> [{"quality": 3, "quality_probs": [...], "aesthetic": 0.71}]
    m.generate("What is in the image?", images=["a.png"])          # -> "A red square."

Samples are in the training format (the_cauldron schema) and are processed exactly as training processed
them (the same processor, template and limits), so a score equals the one evaluation computed for that sample.
`vlmtrain predict --checkpoint DIR --data FILE_OR_SHARDS` runs `score` over a data set (see vlmtrain.prediction.predict_data).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from vlmtrain.errors import ConfigError

ORDER, ID = "__order__", "__id__"  # where a sample sits in its data set, and the id its output row carries


def default_device() -> torch.device:
    """cuda (this process's current device) if there is a GPU, else cpu."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA, float32 elsewhere."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, str):
        value = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(value, torch.dtype):
            raise ConfigError(f"dtype={dtype!r} is not a torch dtype; expected e.g. 'bfloat16' or 'float32'.")
        return value
    return dtype


class InferenceModel:
    """A trained model with its heads and processor, ready to score and generate (built by load_for_inference).

    Attributes: ``model`` (eval mode; a :class:`~vlmtrain.models.objectives.heads.WithHeads` when the checkpoint
    has score heads: ``model.base`` is the transformers model), ``processor`` (the model's processor), ``head_configs``
    ({name: HeadConfig}, empty without heads), ``device``, ``dtype``, ``checkpoint``.

    Which token the heads read: the last non-pad token (the last position whose attention mask is 1) of the
    sample rendered with the model's chat template, exactly as in training. With no assistant turn (a
    score-only sample) that is the token after the last user turn's end-of-turn token; for Qwen3-VL /
    Qwen2.5-VL the template ends a turn with ``<|im_end|>`` + ``"\\n"``, so the heads read that newline
    (``"Ċ"``, id 198 in Qwen's tokenizer), whose hidden state has attended to the whole conversation, images
    included. With an assistant turn, the newline after the assistant's ``<|im_end|>``.
    """

    def __init__(self, model: Any, processor: Any, process: Any, collate: Any, generate: Any = None,
                 device: torch.device | None = None, dtype: torch.dtype | None = None,
                 checkpoint: str | None = None) -> None:
        self.model, self.processor = model, processor
        self._process, self._collate, self._generate = process, collate, generate
        params = next(model.parameters(), None)
        self.device = device or (params.device if params is not None else torch.device("cpu"))
        self.dtype = dtype or (params.dtype if params is not None else torch.float32)
        self.checkpoint = checkpoint

    @property
    def head_configs(self) -> dict[str, Any]:
        return dict(getattr(self.model, "head_configs", None) or {})

    # -- scoring ----------------------------------------------------------------------------------
    def prepare(self) -> Preparer:
        """The CPU half of scoring (processing + collation, no model): what data-loader workers run."""
        return Preparer(self._process, self._collate)

    def score(self, samples: Iterable[Mapping[str, Any]], batch_size: int = 8) -> list[dict[str, Any]]:
        """Each head's output per sample, in input order: classification -> ``<head>`` (class index; for a
        ``bce`` head a 0/1 list) and ``<head>_probs`` (softmax, or sigmoid for bce, 6 decimals); regression ->
        ``<head>`` (a float, or a list when num_outputs > 1). A sample the training processing would skip gets
        ``{"skipped": reason, "detail": message}`` instead; a sample's ``id`` (when it has one) is copied into
        its row. Samples: the training format, ``{"images": [paths, bytes or PIL images], "texts": [{"user":
        ..., "assistant": optional}, ...], "labels": optional (ignored, but checked as training checks them),
        "id": optional}``; image paths are used as given (relative to the working directory)."""
        rows: list[dict[str, Any]] = []
        prepare, batch = self.prepare(), []
        for i, sample in enumerate(samples):
            tagged = dict(sample)
            tagged.setdefault(ORDER, i)
            if tagged.get("id") is not None:
                tagged.setdefault(ID, tagged["id"])
            batch.append(tagged)
            if len(batch) == batch_size:
                rows += self.score_prepared(prepare(batch))
                batch = []
        if batch:
            rows += self.score_prepared(prepare(batch))
        rows.sort(key=lambda r: r.pop(ORDER))
        return rows

    def score_prepared(self, prepared: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Rows of one :class:`Preparer` batch (each with ``__order__``; ``id`` where known)."""
        if not self.head_configs:
            raise ConfigError(f"{self.checkpoint or 'this model'} has no score heads (no heads.json): nothing to "
                              "score; use generate() or generate_rows().")
        rows = [_skipped_row(s) for s in prepared["skipped"]]
        batch = prepared["batch"]
        if batch is not None:
            inputs = {k: v.to(self.device, dtype=self.dtype if v.is_floating_point() else None)
                      for k, v in batch.items() if isinstance(v, torch.Tensor) and not k.startswith(("prompt_", "labels"))}
            with torch.no_grad():
                out = self.model(**inputs)
            logits = {k: v.float().cpu().numpy() for k, v in out.items() if k.startswith("logits_")}
            for (order, sample_id), row in zip(prepared["kept"], head_rows(self.head_configs, logits)):
                rows.append({ORDER: order, **({"id": sample_id} if sample_id is not None else {}), **row})
        return rows

    # -- generation -------------------------------------------------------------------------------
    def generate(self, prompt_or_samples: str | Mapping[str, Any] | Sequence[Mapping[str, Any]],
                 images: Sequence[Any] | None = None, max_new_tokens: int = 32, *,
                 videos: Sequence[Any] | None = None) -> str | list[str]:
        """Greedy answers, stopping at the model's end-of-turn token. A prompt string (with ``images``: paths
        or PIL images; ``videos``: video file paths or lists of frames) -> its answer; a sample (training
        format; the answer is to its last user turn, a last assistant text is ignored) -> its answer; a list of
        samples -> a list of answers (one batch)."""
        self._check_generates()
        if isinstance(prompt_or_samples, str):
            sample: dict[str, Any] = {"images": list(images or []), "texts": [{"user": prompt_or_samples}]}
            if videos:
                sample["videos"] = list(videos)
            return self._generate([sample], max_new_tokens)[0]
        if images is not None or videos is not None:
            raise ConfigError("generate(images=..., videos=...) go with a prompt string; samples carry their own.")
        if isinstance(prompt_or_samples, Mapping):
            return self._generate([dict(prompt_or_samples)], max_new_tokens)[0]
        return self._generate([dict(s) for s in prompt_or_samples], max_new_tokens)


    def generate_rows(self, samples: Sequence[Mapping[str, Any]], max_new_tokens: int = 32) -> list[dict[str, Any]]:
        """One row per sample (each tagged with ``__order__`` and optionally ``__id__``, as NumberedSamples
        tags them), answered in one batch: ``{"__order__", "id", "generated": answer}``, or the skipped row
        (``skipped``, ``detail``) of a sample the processing skips."""
        self._check_generates()
        raw = [{k: v for k, v in s.items() if k not in (ORDER, ID)} for s in samples]
        rows = []
        for sample, answer in zip(samples, self._generate(raw, max_new_tokens, skip=True)):
            where = (sample.get(ORDER), sample.get(ID))
            if isinstance(answer, Exception):  # (a SkipSample)
                rows.append(_skipped_row((*where, answer.reason, answer.detail)))
            else:
                rows.append({ORDER: where[0], **({"id": where[1]} if where[1] is not None else {}),
                             "generated": answer})
        return rows

    def _check_generates(self) -> None:
        if self._generate is None:
            raise ConfigError(f"{self.checkpoint or 'this model'}: its model kind has no batch generation here; "
                              "use vlmtrain generate.")


class Preparer:
    """Processes and collates a list of samples (each with ``__order__`` and optionally ``__id__``) on the CPU:
    returns ``{"batch": the model batch or None, "kept": [(order, id)], "skipped": [(order, id, reason, detail)]}``."""

    def __init__(self, process: Any, collate: Any) -> None:
        self.process, self.collate = process, collate

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        from vlmtrain.data.processing import SkipSample

        items, kept, skipped = [], [], []
        for sample in samples:
            where = (sample.get(ORDER), sample.get(ID))
            raw = {k: v for k, v in sample.items() if k not in (ORDER, ID)}
            try:
                items.append(self.process(raw))
                kept.append(where)
            except SkipSample as err:
                skipped.append((*where, err.reason, err.detail))
        return {"batch": self.collate(items) if items else None, "kept": kept, "skipped": skipped}


def _skipped_row(entry: tuple[Any, Any, str, str]) -> dict[str, Any]:
    order, sample_id, reason, detail = entry
    return {ORDER: order, **({"id": sample_id} if sample_id is not None else {}), "skipped": reason,
            **({"detail": detail} if detail else {})}


def head_rows(head_configs: Mapping[str, Any], outputs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per sample, each head's output (from ``logits_<name>`` or ``<name>`` arrays [N, num_outputs]):
    classification -> class index and probabilities (sigmoid for bce: a 0/1 list), regression -> the value (a
    list when num_outputs > 1)."""
    import numpy as np

    rows: list[dict[str, Any]] = []
    for name, logits in outputs.items():
        head = name[len("logits_"):] if name.startswith("logits_") else name
        config, values = head_configs.get(head), np.asarray(logits, dtype=np.float64)
        for i, v in enumerate(values):
            if len(rows) <= i:
                rows.append({})
            if config is not None and config.type == "classification":
                if config.loss == "bce":
                    probs = 1 / (1 + np.exp(-v))
                    rows[i][head] = [int(x) for x in probs > 0.5]
                else:
                    probs = np.exp(v - v.max())
                    probs /= probs.sum()
                    rows[i][head] = int(np.argmax(v))
                rows[i][f"{head}_probs"] = [round(float(x), 6) for x in probs]
            else:
                rows[i][head] = float(v[0]) if v.size == 1 else [float(x) for x in v]
    return rows


def load_for_inference(checkpoint: str, device: str | torch.device | None = None,
                       dtype: str | torch.dtype | None = None, *, max_length: int | None = None,
                       max_images: int | None = None) -> InferenceModel:
    """A checkpoint's model (with its score heads) and processor, for :meth:`InferenceModel.score` and
    :meth:`InferenceModel.generate`.

    ``checkpoint``: a ``checkpoint-N/`` directory, a run directory (its newest complete checkpoint), or a
    folder written by ``vlmtrain export`` / ``export --merge``; full weights, a LoRA adapter (its base model is
    read from adapter_config.json), an FSDP ``dcp/`` checkpoint, with or without heads. ``device``: default
    cuda if available, else cpu. ``dtype``: default bfloat16 on CUDA, float32 on CPU; the weights are read in
    that dtype straight onto the device (heads stay float32). ``max_length`` / ``max_images``: processing
    limits, default the run's config.yaml (data.max_length / data.max_images, found next to the checkpoint or
    in its run directory), else none: longer samples are skipped (``too_long``), never truncated.

    The loader comes from the checkpoint's model kind (``ModelKind.load_for_inference``); a kind without one
    (own ``vlm``, ``causal_lm``) is a ConfigError: use ``vlmtrain generate`` for those.
    """
    from vlmtrain.checkpoint_paths import resolve_checkpoint
    from vlmtrain.models.kinds import kind_of_checkpoint

    ckpt = resolve_checkpoint(checkpoint, checkpoint)
    device = torch.device(device) if device is not None else default_device()
    dtype = _dtype(dtype, device)
    kind = kind_of_checkpoint(ckpt)
    if kind.load_for_inference is None:
        raise ConfigError(f"{ckpt}: model kind {kind.name!r} has no inference loader (load_for_inference); use "
                          f"`vlmtrain generate --checkpoint {ckpt}` for its answers.")
    parts = kind.load_for_inference(ckpt, device, dtype, max_length=max_length, max_images=max_images)
    return InferenceModel(parts["model"], parts["processor"], parts["process"], parts["collate"],
                          parts.get("generate"), device=device, dtype=dtype, checkpoint=ckpt)


# -- data sets to score ---------------------------------------------------------------------------------
def open_data(spec: str | Sequence[str]) -> Any:
    """A JSONL file (image paths relative to it) or WebDataset shards (a ``.tar`` path, glob or brace range
    ``x-{000..009}.tar``), or a list of those; a name that matches no file is a ConfigError naming it."""
    from vlmtrain.data.sources import JsonlSource, WebDatasetSource

    specs = [spec] if isinstance(spec, str) else list(spec)
    try:
        if all(".tar" in s for s in specs):
            return WebDatasetSource(specs)
        if all(".jsonl" in s or ".json" in s for s in specs):
            return JsonlSource(specs)
    except FileNotFoundError as err:
        raise ConfigError(f"--data: {err}") from None
    raise ConfigError(f"--data {spec!r}: expected a .jsonl file or WebDataset .tar shards (path, glob or "
                      "{000..009} range).")


class NumberedSamples(IterableDataset):
    """A source's samples, each tagged with its place (``__order__``: (shard, n)) and id (``__id__``): the
    record's ``id`` when it has one, else the WebDataset key, else the JSONL line number (``file:line`` when
    several files are read). Split across ``world_size`` ranks and each rank's data-loader workers: whole
    shards round-robin when there are enough, else every reader takes every k-th sample of each shard."""

    def __init__(self, source: Any, rank: int = 0, world_size: int = 1) -> None:
        self.source, self.rank, self.world_size = source, rank, world_size

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from vlmtrain.data.sources import KEY, JsonlSource

        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        reader, readers = self.rank * workers + worker, self.world_size * workers
        shards = self.source.shards
        whole = len(shards) >= readers
        several = len(shards) > 1
        for s, path in enumerate(shards):
            if whole and s % readers != reader:
                continue
            for n, (position, sample) in enumerate(self.source.read(s, {})):
                if not whole and n % readers != reader:
                    continue
                if isinstance(self.source, JsonlSource):
                    line = position.get("line")
                    key = f"{os.path.basename(path)}:{line}" if several else line
                else:
                    key = str(sample.get(KEY, ""))[len(path) + 1:]
                own = sample.get("id")
                yield {**sample, ORDER: (s, n), ID: own if own is not None and not sample.get("__bad__") else key}


def score_rows(inference: InferenceModel, dataset: Any, batch_size: int = 8, num_workers: int = 0) -> list[dict]:
    """Rows (with ``__order__``) for every sample of ``dataset`` (yielding samples tagged as by
    NumberedSamples), processed in ``num_workers`` data-loader workers, scored in batches of ``batch_size``."""
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_size=batch_size, collate_fn=inference.prepare(), num_workers=num_workers,
                        pin_memory=inference.device.type == "cuda")
    rows: list[dict[str, Any]] = []
    for prepared in loader:
        rows += inference.score_prepared(prepared)
    return rows


def generate_rows(inference: InferenceModel, dataset: Any, batch_size: int = 8, num_workers: int = 0,
                  max_new_tokens: int = 32) -> list[dict]:
    """Rows (with ``__order__``) of generated answers for every sample of ``dataset`` (tagged as by
    NumberedSamples), read in ``num_workers`` data-loader workers, answered in batches of ``batch_size``."""
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_size=batch_size, collate_fn=list, num_workers=num_workers)
    return [row for samples in loader for row in inference.generate_rows(samples, max_new_tokens)]
