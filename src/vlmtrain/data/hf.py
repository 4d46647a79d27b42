"""HF `datasets` as sources: ``load_from_disk`` directories and ``load_dataset`` names, streaming or not.

Needs the optional ``datasets`` package (``pip install vlmtrain[hf]``). A map-style ``Dataset`` becomes an
:class:`~vlmtrain.data.sources.IndexedSource` (resume = an index). A streaming ``IterableDataset`` is read
shard by shard (its ``num_shards``); its own ``state_dict()`` is the position, so a resume restarts at
the right shard and lets ``datasets`` skip to the example (within that one shard, never the whole set).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from vlmtrain.data.sources import KEY, IndexedSource, Position


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError("HF dataset sources need the `datasets` package: pip install 'vlmtrain[hf]'") from err
    return datasets


def hf_source(spec: dict[str, Any]) -> Any:
    """A source from ``{"path": DIR}`` (``load_from_disk``) or ``{"name": ..., "config": ..., "split": ...,
    "streaming": bool, "data_files": ...}`` (``load_dataset``). ``split`` defaults to "train"."""
    datasets = _datasets()
    split = spec.get("split") or "train"
    if spec.get("path"):
        ds = datasets.load_from_disk(spec["path"])
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"{spec['path']} has splits {list(ds)}, not {split!r}")
            ds = ds[split]
        return IndexedSource(ds, name=spec.get("source_name") or spec["path"])
    if not spec.get("name"):
        raise ValueError("an hf source needs `path` (a load_from_disk directory) or `name` (for load_dataset)")
    kwargs = {k: spec[k] for k in ("data_files", "data_dir") if spec.get(k)}
    ds = datasets.load_dataset(spec["name"], spec.get("config"), split=split,
                               streaming=bool(spec.get("streaming")), **kwargs)
    name = spec.get("source_name") or spec["name"]
    if isinstance(ds, datasets.IterableDataset):
        return HFStreamSource(ds, name=name)
    return IndexedSource(ds, name=name)


class HFStreamSource:
    """A streaming HF ``IterableDataset``, one shard per underlying file."""

    def __init__(self, dataset: Any, name: str = "hf") -> None:
        self.dataset, self.name = dataset, name
        self.shards = list(range(max(1, dataset.num_shards)))

    def read(self, shard: int, position: Position) -> Iterator[tuple[Position, dict[str, Any]]]:
        ds = self.dataset.shard(num_shards=len(self.shards), index=shard) if len(self.shards) > 1 else self.dataset
        if position.get("state") is not None:
            ds.load_state_dict(position["state"])
        n = position.get("n", 0)
        for example in ds:
            n += 1
            yield {"state": ds.state_dict(), "n": n}, {**example, KEY: f"{self.name}:{shard}:{n}"}
