"""Training data as resumable streams: JSONL files, WebDataset tar shards, HF datasets, map-style sets.

A *source* is a list of shards that can be read from a saved position: ``read(shard, position)`` yields
``(next_position, sample)``, and reopening at ``next_position`` continues with the following sample
without reading what came before (a byte offset for JSONL and tar files, an index for map-style data).
:class:`StreamingDataset` splits the shards of its sources across ranks and DataLoader workers, mixes
several sources by weight, filters samples, and keeps its place in ``state_dict()``, so resuming costs the same at step
10 as at step 10^6 and continues with the next unseen sample.

Samples are the_cauldron dicts (DESIGN.md) plus ``__key__`` (``<source>:<shard>:<n>``), the name bad-
sample messages and tests use. Samples a source cannot parse (a malformed JSON line, a tar group without
JSON) and samples a filter rejects are not yielded; their counts ride on the next yielded sample's
``__dropped__`` entry (``{reason: n}``), which the collator adds to the batch's ``skipped`` counts. When
nothing follows them (the end of a stream), a counts-only sample (:func:`is_counts_only`: no data, just
``__dropped__``) carries them; collators count it and produce nothing from it.
"""

from __future__ import annotations

import glob
import json
import os
import re
import tarfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from vlmtrain.data.video_layout import VIDEO_EXTENSIONS, resolve_videos, video_members

KEY, DROPPED, COUNTS_ONLY = "__key__", "__dropped__", "__counts_only__"
BAD_DETAIL = "__bad_detail__"  # what was wrong with a record its source could not parse (``__bad__``)
IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "webp", "bmp")
Position = dict[str, Any]


def expand_paths(spec: str | Sequence[str]) -> list[str]:
    """Files named by a path, a glob, a brace range (``shard-{000..009}.tar``) or a list of those, sorted
    within each pattern; a pattern that matches nothing is an error naming it."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for s in specs:
        for pattern in _brace_expand(s):
            found = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
            found = [f for f in found if os.path.isfile(f)]
            if not found:
                raise FileNotFoundError(f"no file matches {pattern!r}")
            out += found
    return out


def _brace_expand(spec: str) -> list[str]:
    m = re.search(r"\{(\d+)\.\.(\d+)\}", spec)
    if m:
        lo, hi, width = int(m.group(1)), int(m.group(2)), len(m.group(1))
        return [x for i in range(lo, hi + 1) for x in _brace_expand(spec[:m.start()] + str(i).zfill(width)
                                                                      + spec[m.end():])]
    m = re.search(r"\{([^{}]*,[^{}]*)\}", spec)
    if m:
        return [x for part in m.group(1).split(",") for x in _brace_expand(spec[:m.start()] + part + spec[m.end():])]
    return [spec]


class JsonlSource:
    """the_cauldron JSONL files, one shard per file; image paths are made absolute (relative to the file)."""

    def __init__(self, paths: str | Sequence[str], name: str = "jsonl") -> None:
        self.name, self.shards = name, expand_paths(paths)

    def read(self, shard: int, position: Position) -> Iterator[tuple[Position, dict[str, Any]]]:
        path = self.shards[shard]
        base = os.path.dirname(os.path.abspath(path))
        with open(path, "rb") as f:
            f.seek(position.get("offset", 0))
            line_no = position.get("line", 0)
            for line in iter(f.readline, b""):
                line_no += 1
                here = {"offset": f.tell(), "line": line_no}
                if not line.strip():
                    continue
                key = f"{path}:{line_no}"
                try:
                    record = json.loads(line)
                    if not isinstance(record, dict):
                        raise ValueError(f"a JSON {type(record).__name__}, not an object")
                except ValueError as err:  # (the parser's message: where in the line)
                    yield here, {KEY: key, "__bad__": "malformed_json", BAD_DETAIL: str(err)}
                    continue
                images = record.get("images")
                if isinstance(images, str):
                    images = [images]
                if isinstance(images, list):
                    record["images"] = [os.path.join(base, im) if isinstance(im, str) else im for im in images]
                if record.get("videos") is not None:
                    record["videos"] = resolve_videos(record["videos"], base)
                yield here, {**record, KEY: key}


class WebDatasetSource:
    """WebDataset tar shards: ``KEY.json`` (the record without images) and its images, ``KEY.0.png``,
    ``KEY.1.jpg``, ... in index order, or for one image ``KEY.jpg`` / ``KEY.png`` / ``KEY.webp`` (image 0),
    as webdataset's ShardWriter writes them (the key is the member name up to the first dot of its file name).

    Members of one key are consecutive; the position is the tar offset of the next key's first header,
    so a resumed reader opens the shard there and reads nothing before it. Image bytes are decoded later
    (by the processor), so a corrupt image is skipped and counted there, not here. Videos are members of their
    own: ``KEY.video.0.mp4``, ``KEY.video.1.webm``, ... (a video file, index order), or ``KEY.video.0.0.jpg``,
    ``KEY.video.0.1.jpg``, ... (video 0 as frame images, in frame order); they become the sample's ``videos``
    (bytes, or lists of frame bytes). A video member outside that layout (``KEY.0.mp4``, ``KEY.mp4``, of
    ``.mp4``, ``.webm``, ``.mov``, ``.avi``, ``.mkv``) is a bad record (``video_unsupported``): dropping it
    silently would train on the text without it. A
    shard cut short (a writer killed mid-shard) ends with a bad record (``corrupt_image`` or
    ``malformed_json``: the member cut), counted like any other.
    """

    def __init__(self, paths: str | Sequence[str], name: str = "wds") -> None:
        self.name, self.shards = name, expand_paths(paths)

    def read(self, shard: int, position: Position) -> Iterator[tuple[Position, dict[str, Any]]]:
        path = self.shards[shard]
        with open(path, "rb") as f:
            f.seek(position.get("offset", 0))
            tar = tarfile.open(fileobj=f, mode="r:")
            group: list[tuple[str, bytes]] = []
            key = None
            for member in tar:
                if not member.isfile():
                    continue
                base = os.path.basename(member.name)
                stem, _, ext = base.partition(".")
                member_key = os.path.join(os.path.dirname(member.name), stem)
                if key is not None and member_key != key:
                    yield {"offset": member.offset}, self._sample(path, key, group)
                    group = []
                key = member_key
                try:
                    group.append((ext, tar.extractfile(member).read()))
                except tarfile.ReadError:  # the shard ends inside this member
                    reason = "corrupt_image" if _image_index(ext) is not None else "malformed_json"
                    yield {"offset": os.path.getsize(path)}, {KEY: f"{path}:{key}", "__bad__": reason}
                    return
            if key is not None:
                yield {"offset": os.path.getsize(path)}, self._sample(path, key, group)

    @staticmethod
    def _sample(path: str, key: str, group: list[tuple[str, bytes]]) -> dict[str, Any]:
        name = f"{path}:{key}"
        record = next((data for ext, data in group if ext == "json"), None)
        try:
            sample = json.loads(record) if record is not None else None
        except ValueError as err:
            return {KEY: name, "__bad__": "malformed_json", BAD_DETAIL: f"{os.path.basename(key)}.json: {err}"}
        if not isinstance(sample, dict):
            detail = "no .json member" if sample is None else f"a JSON {type(sample).__name__}, not an object"
            return {KEY: name, "__bad__": "malformed_json", BAD_DETAIL: detail}
        videos = video_members(group, IMAGE_EXTENSIONS)
        if videos is None:
            return {KEY: name, "__bad__": "duplicate_image"}
        group = [(ext, data) for ext, data in group if not ext.lower().startswith("video.")]
        if any(ext.lower().rpartition(".")[2] in VIDEO_EXTENSIONS for ext, _ in group):
            return {KEY: name, "__bad__": "video_unsupported"}
        if videos:
            sample["videos"] = videos
        images = sorted((_image_index(ext), data) for ext, data in group if _image_index(ext) is not None)
        if len({i for i, _ in images}) < len(images):  # e.g. KEY.jpg and KEY.0.png: two images 0
            return {KEY: name, "__bad__": "duplicate_image"}
        sample["images"] = [data for _, data in images]
        sample[KEY] = name
        return sample


def _image_index(ext: str) -> int | None:
    """The image index of a member's extension: ``3.png`` -> 3, ``jpg`` -> 0 (a single image), else None."""
    index, _, kind = ext.lower().rpartition(".")
    if kind not in IMAGE_EXTENSIONS:
        return None
    if not index:
        return 0
    return int(index) if index.isdigit() else None


class IndexedSource:
    """A map-style dataset (anything with ``len`` and ``[i]``: shapes-VQA, an HF ``Dataset``, a list) in
    blocks of ``block_size`` consecutive indices, one shard per block."""

    def __init__(self, dataset: Any, name: str = "indexed", block_size: int = 256) -> None:
        self.dataset, self.name, self.block_size = dataset, name, block_size
        self.shards = list(range(0, len(dataset), block_size))

    def read(self, shard: int, position: Position) -> Iterator[tuple[Position, dict[str, Any]]]:
        start, end = self.shards[shard], min(self.shards[shard] + self.block_size, len(self.dataset))
        for i in range(start + position.get("index", 0), end):
            sample = dict(self.dataset[i])
            sample.setdefault(KEY, f"{self.name}:{i}")
            yield {"index": i - start + 1}, sample


class _Reader:
    """One source as read by one reader (a rank's DataLoader worker): its share of the shards, epoch by
    epoch, and its place in them (epoch, which of its shards, position in that shard, samples seen)."""

    def __init__(self, source: Any, reader: int, readers: int, seed: int, shuffle: bool) -> None:
        self.source, self.reader, self.readers, self.seed, self.shuffle = source, reader, readers, seed, shuffle
        self.state = {"epoch": 0, "unit": 0, "position": {}, "count": 0}

    def units(self, epoch: int) -> list[tuple[int, int, int]]:
        """(shard, stride, offset): whole shards round-robin when there are enough for every reader,
        else every reader reads every shard and keeps every ``readers``-th sample (its offset)."""
        order = list(range(len(self.source.shards)))
        if self.shuffle:
            import random

            random.Random(f"{self.seed}-{epoch}").shuffle(order)
        if len(order) >= self.readers:
            return [(s, 1, 0) for i, s in enumerate(order) if i % self.readers == self.reader]
        return [(s, self.readers, self.reader) for s in order]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """This epoch's samples from the saved place on; the state is updated before each yield."""
        st = self.state
        units = self.units(st["epoch"])
        while st["unit"] < len(units):
            shard, stride, offset = units[st["unit"]]
            for position, sample in self.source.read(shard, st["position"]):
                n = st["count"]
                st["position"], st["count"] = position, n + 1
                if n % stride == offset:
                    yield sample
            st.update(unit=st["unit"] + 1, position={}, count=0)

    def next_epoch(self) -> None:
        self.state = {"epoch": self.state["epoch"] + 1, "unit": 0, "position": {}, "count": 0}


class StreamingDataset(IterableDataset):
    """Sources as one resumable stream, split across ranks and DataLoader workers.

    One source: its shards once per epoch (shuffled by ``seed`` and epoch if ``shuffle``), in order
    within a shard; the Trainer moves epochs with :meth:`set_epoch`. Several sources: an endless
    mixture that draws each sample's source with probability proportional to ``weights`` (each source
    cycling through its epochs), so training needs ``max_steps``. ``filters`` are callables on a raw
    sample returning True (keep), False/None (drop, counted as ``filtered_<function name>``) or a
    changed sample. Reader ``rank * num_workers + worker`` of
    ``world_size * num_workers`` gets a disjoint share: within an epoch no sample is read twice or lost.

    ``state_dict()`` (taken inside the worker by torchdata's StatefulDataLoader) is each source's epoch,
    shard, in-shard position and the mixture's draw count; resuming seeks straight there.
    """

    splits_by_rank = True  # each rank reads its own share (evaluation gathers the ranks' results)

    def __init__(self, sources: Sequence[Any], weights: Sequence[float] | None = None, seed: int = 0,
                 shuffle: bool = True, filters: Sequence[Callable[[dict], bool]] = (), rank: int | None = None,
                 world_size: int | None = None) -> None:
        if not sources:
            raise ValueError("StreamingDataset needs at least one source")
        weights = list(weights) if weights is not None else [1.0] * len(sources)
        if len(weights) != len(sources) or min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"weights {weights} must be one non-negative number per source, not all 0")
        self.sources, self.weights, self.seed, self.shuffle = list(sources), weights, seed, shuffle
        self.filters = list(filters)
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        # set_epoch's value in shared memory: a persistent DataLoader worker's copy, which set_epoch never reaches,
        # reads it as each epoch's iteration begins (as HF datasets' IterableDataset shares its epoch)
        self._shared_epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self._followed_epoch = 0  # the shared value this copy last took
        self._state: dict[str, Any] | None = None
        self._readers: list[_Reader] | None = None
        self._draws = 0

    # -- where this copy reads ----------------------------------------------------------------------
    def _reader_id(self) -> tuple[int, int]:
        rank, world = self.rank, self.world_size
        if rank is None or world is None:
            import torch.distributed as dist

            initialized = dist.is_available() and dist.is_initialized()
            rank, world = (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return rank * workers + worker, world * workers

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (one source), here and in persistent workers' copies. A resumed state for this same
        epoch is kept."""
        self._shared_epoch.fill_(epoch)
        self._start_epoch(epoch)

    def _follow_epoch(self) -> None:
        """Take the epoch set_epoch last shared, if it changed since this copy took one."""
        epoch = int(self._shared_epoch)
        if epoch != self._followed_epoch:
            self._start_epoch(epoch)

    def _start_epoch(self, epoch: int) -> None:
        self._followed_epoch = epoch
        if epoch != self.epoch:
            self.epoch, self._state = epoch, None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._follow_epoch()  # (in a persistent worker: the epoch the main process's set_epoch started)
        reader, readers = self._reader_id()
        self._readers = [_Reader(s, reader, readers, self.seed + k, self.shuffle) for k, s in enumerate(self.sources)]
        self._draws = 0
        state = self._state
        if state is not None:
            if state["readers"] != readers:
                raise ValueError(f"the data state was saved by {state['readers']} readers (ranks x workers) and is "
                                 f"resumed by {readers}: exact resume needs the same world size and num_workers (set "
                                 f"train.dataloader_num_workers to the saved run's number: 'auto' depends on the "
                                 f"machine's GPU and cores)")
            for r, s in zip(self._readers, state["sources"]):
                r.state = dict(s)
            self._draws = state["draws"]
        else:
            for r in self._readers:
                r.state["epoch"] = self.epoch
        self._state = None  # consumed: a later __iter__ (next epoch) starts fresh
        dropped: Counter[str] = Counter()
        for sample in (self._single() if len(self._readers) == 1 else self._mixture()):
            reason = sample.get("__bad__")
            if not reason:
                sample, reason = apply_filters(self.filters, sample)
            if reason:
                dropped[reason] += 1
                continue
            if dropped:
                sample = {**sample, DROPPED: dict(dropped)}
                dropped.clear()
            yield sample
        if dropped:  # bad or filtered samples at the very end: nothing follows to carry their counts
            yield {KEY: "end-of-stream", COUNTS_ONLY: True, DROPPED: dict(dropped)}

    def _single(self) -> Iterator[dict[str, Any]]:
        yield from self._readers[0]

    def _mixture(self) -> Iterator[dict[str, Any]]:
        import random

        streams = [iter(r) for r in self._readers]
        live = [w > 0 for w in self.weights]
        reader_id, _ = self._reader_id()
        while any(live):
            # The draw depends on (seed, reader, draw count) only: O(1) to restore after resume.
            rng = random.Random(f"mix-{self.seed}-{reader_id}-{self._draws}")
            k = rng.choices(range(len(streams)), weights=[w if ok else 0 for w, ok in zip(self.weights, live)])[0]
            self._draws += 1
            sample = next(streams[k], None)
            if sample is None:  # this source's epoch is over: start its next one
                self._readers[k].next_epoch()
                streams[k] = iter(self._readers[k])
                sample = next(streams[k], None)
                if sample is None:  # an empty share: nothing to cycle through
                    live[k] = False
                    continue
            yield sample

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self._readers is None:  # not iterated yet (or a resumed state not yet used)
            return dict(self._state) if self._state is not None else {"epoch": self.epoch, "fresh": True}
        _, readers = self._reader_id()
        return {"epoch": self.epoch, "readers": readers, "draws": self._draws,
                "sources": [dict(r.state) for r in self._readers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = state.get("epoch", 0)
        self._state = None if state.get("fresh") else dict(state)
        self._readers = None


def apply_filters(filters: Sequence[Callable[[dict], Any]], sample: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """Run ``filters`` on a raw sample: (the sample, possibly changed; None) or (it, ``filtered_<name>``) when one
    returns False/None. A filter returning a dict replaces the sample."""
    for f in filters:
        kept = f(sample)
        if kept is None or kept is False:
            return sample, f"filtered_{getattr(f, '__name__', 'filter')}"
        if isinstance(kept, dict):
            sample = kept
    return sample, None


def is_counts_only(sample: Any) -> bool:
    """Whether ``sample`` only carries the ``__dropped__`` counts of the end of a stream (no data to process)."""
    return isinstance(sample, dict) and bool(sample.get(COUNTS_ONLY))


def drop_counts(sample: Any) -> dict[str, int]:
    """The ``__dropped__`` counts a stream attached to this sample (what it skipped just before it)."""
    return sample.get(DROPPED, {}) if isinstance(sample, dict) else {}
