"""Streaming sources: JSONL / WebDataset / HF / map-style, rank x worker splitting, mixtures, filters, resume."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch
from optional_extras import requires
from torchdata.stateful_dataloader import StatefulDataLoader

from vlmtrain.data.cauldron import write_cauldron_jsonl
from vlmtrain.data.sources import (
    KEY,
    IndexedSource,
    JsonlSource,
    StreamingDataset,
    WebDatasetSource,
    expand_paths,
    is_counts_only,
)
from vlmtrain.data.tools import inspect_source, write_webdataset
from vlmtrain.tasks.shapes import ShapesVQA

N = 60


@pytest.fixture(scope="module")
def shapes():
    return ShapesVQA("train", N, seed=3, multi_image_fraction=0.5)


@pytest.fixture(scope="module")
def wds(shapes, tmp_path_factory):
    out = tmp_path_factory.mktemp("wds")
    return write_webdataset((shapes[i] for i in range(N)), str(out), shard_size=7)  # 9 shards, the last short


@pytest.fixture(scope="module")
def jsonl(shapes, tmp_path_factory):
    out = tmp_path_factory.mktemp("jsonl")
    return write_cauldron_jsonl(shapes, str(out))


def keys_of(samples):
    return [s[KEY] for s in samples]


def identity(batch):
    return batch


def read_all(make_dataset, world=2, workers=2, batch_size=3):
    """Keys every (rank, worker) reads in one epoch, through real DataLoader worker processes."""
    keys = []
    for rank in range(world):
        loader = StatefulDataLoader(make_dataset(rank, world), batch_size=batch_size, num_workers=workers,
                                    collate_fn=identity)
        keys += [k for batch in loader for k in keys_of(batch)]
    return keys


def test_expand_paths(tmp_path):
    for name in ("a-000.tar", "a-001.tar", "a-002.tar", "b.tar"):
        (tmp_path / name).write_bytes(b"")
    assert expand_paths(str(tmp_path / "a-{000..001}.tar")) == [str(tmp_path / "a-000.tar"), str(tmp_path / "a-001.tar")]
    assert len(expand_paths([str(tmp_path / "a-*.tar"), str(tmp_path / "b.tar")])) == 4
    assert expand_paths(str(tmp_path / "{a-002,b}.tar")) == [str(tmp_path / "a-002.tar"), str(tmp_path / "b.tar")]
    with pytest.raises(FileNotFoundError, match="no file matches"):
        expand_paths(str(tmp_path / "c-*.tar"))


def test_webdataset_round_trip(shapes, wds):
    source = WebDatasetSource(wds)
    assert len(source.shards) == 9
    got = [s for shard in range(9) for _, s in source.read(shard, {})]
    assert len(got) == N
    for i in (0, 17, N - 1):
        assert got[i]["texts"] == shapes[i]["texts"] and len(got[i]["images"]) == len(shapes[i]["images"])
        assert got[i]["images"][0][:4] == b"\x89PNG"
    # reopening at a saved position continues with the next sample and reads nothing before it
    positions = [pos for pos, _ in source.read(1, {})]
    rest = [s[KEY] for _, s in source.read(1, positions[2])]
    assert rest == [s[KEY] for s in got[10:14]]


@pytest.mark.parametrize("kind", ["wds", "jsonl", "indexed"])
@pytest.mark.parametrize("world,workers", [(2, 2), (1, 2)])
def test_every_sample_read_once_per_epoch_across_ranks_and_workers(kind, world, workers, shapes, wds, jsonl):
    """2 ranks x 2 workers: 9 tar shards are dealt out whole; 1 JSONL file is read strided by all 4 readers."""
    def source():
        return {"wds": lambda: WebDatasetSource(wds), "jsonl": lambda: JsonlSource(jsonl),
                "indexed": lambda: IndexedSource(shapes, block_size=8)}[kind]()

    keys = read_all(lambda rank, w: StreamingDataset([source()], seed=1, rank=rank, world_size=w), world, workers)
    assert len(keys) == N and len(set(keys)) == N  # none twice, none lost
    again = read_all(lambda rank, w: StreamingDataset([source()], seed=1, rank=rank, world_size=w), world, workers)
    assert again == keys  # deterministic


def test_epochs_reshuffle_shards(wds):
    ds = StreamingDataset([WebDatasetSource(wds)], seed=0)
    first = keys_of(ds)
    ds.set_epoch(1)
    second = keys_of(ds)
    assert sorted(first) == sorted(second) and first != second


def _resume_case(make, k, batch_size=4, workers=2):
    """Keys of an uninterrupted epoch vs k batches + a resumed loader (a fresh dataset, as after a restart)."""
    full = [key for b in StatefulDataLoader(make(), batch_size=batch_size, num_workers=workers, collate_fn=identity)
            for key in keys_of(b)]
    loader = StatefulDataLoader(make(), batch_size=batch_size, num_workers=workers, collate_fn=identity)
    it = iter(loader)
    head = [key for _ in range(k) for key in keys_of(next(it))]
    state = loader.state_dict()
    del it, loader
    resumed = StatefulDataLoader(make(), batch_size=batch_size, num_workers=workers, collate_fn=identity)
    resumed.load_state_dict(state)
    tail = [key for b in resumed for key in keys_of(b)]
    return full, head, tail


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_continues_with_the_next_unseen_sample(wds, jsonl, workers):
    for make in (lambda: StreamingDataset([WebDatasetSource(wds)], seed=2),
                 lambda: StreamingDataset([JsonlSource(jsonl)], seed=2)):
        full, head, tail = _resume_case(make, k=5, workers=workers)
        assert head + tail == full


def test_resume_does_not_reread_consumed_samples(wds):
    reads = Counter()

    class Counting(WebDatasetSource):
        def read(self, shard, position):
            for pos, sample in super().read(shard, position):
                reads[sample[KEY]] += 1
                yield pos, sample

    full, head, tail = _resume_case(lambda: StreamingDataset([Counting(wds)], seed=0), k=8, workers=0)
    assert head + tail == full
    assert max(reads.values()) == 2  # once in the uninterrupted epoch, once more at most
    # the resumed loader read (about) only what it yielded: no replay of the 32 consumed samples
    assert sum(reads.values()) - 2 * N <= 4


def test_mixture_follows_weights_and_resumes_exactly(shapes, wds):
    def make():
        return StreamingDataset([WebDatasetSource(wds), IndexedSource(shapes, name="mem", block_size=16)],
                                weights=[3, 1], seed=5)

    ds = make()
    first = [s[KEY] for _, s in zip(range(400), ds)]  # endless: the sources cycle through their epochs
    from_mem = sum(k.startswith("mem:") for k in first)
    assert 0.18 < from_mem / 400 < 0.32
    assert Counter(first).most_common(1)[0][1] >= 2  # cycled
    loader = StatefulDataLoader(make(), batch_size=5, num_workers=0, collate_fn=identity)
    it = iter(loader)
    head = [k for _ in range(7) for k in keys_of(next(it))]
    state = loader.state_dict()
    resumed = StatefulDataLoader(make(), batch_size=5, num_workers=0, collate_fn=identity)
    resumed.load_state_dict(state)
    it2 = iter(resumed)
    tail = [k for _ in range(10) for k in keys_of(next(it2))]
    assert head + tail == first[:85]


def test_filters_and_malformed_lines_are_dropped_and_counted(jsonl, tmp_path):
    original, jsonl = jsonl, str(tmp_path / "copy.jsonl")  # a copy: the fixture is shared (images not opened)
    with open(jsonl, "w") as f:
        f.write(open(original).read())
        f.write("{not json\n")
        f.write(json.dumps({"texts": [{"user": "q", "assistant": "a"}], "images": [], "rating": 1}) + "\n")

    def min_rating(sample):
        return sample.get("rating", 5) >= 3

    samples = list(StreamingDataset([JsonlSource(jsonl)], shuffle=False, filters=[min_rating]))
    assert len(samples) == N + 1
    dropped = Counter()
    for s in samples:
        dropped.update(s.get("__dropped__", {}))
    # the two bad lines come last: a counts-only sample at the end of the stream carries their counts
    assert dropped == {"malformed_json": 1, "filtered_min_rating": 1}
    assert is_counts_only(samples[-1]) and not any(is_counts_only(s) for s in samples[:-1])
    ds = StreamingDataset([JsonlSource(jsonl), JsonlSource(jsonl)], weights=[1, 1], seed=0, filters=[min_rating])
    dropped = Counter()
    for _, s in zip(range(200), ds):
        dropped.update(s.get("__dropped__", {}))
    assert dropped["malformed_json"] > 0 and dropped["filtered_min_rating"] > 0


def test_resume_with_other_reader_count_is_an_error(wds):
    loader = StatefulDataLoader(StreamingDataset([WebDatasetSource(wds)]), batch_size=2, num_workers=0,
                                collate_fn=identity)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    other = StatefulDataLoader(StreamingDataset([WebDatasetSource(wds)], rank=0, world_size=2), batch_size=2,
                               num_workers=0, collate_fn=identity)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="saved by 1 readers .* resumed by 2"):
        next(iter(other))


@requires("datasets", "hf")
def test_hf_sources(shapes, tmp_path, jsonl):
    import datasets

    from vlmtrain.data.hf import hf_source

    rows = [{"texts": shapes[i]["texts"], "images": shapes[i]["images"]} for i in range(10)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "disk"))
    source = hf_source({"path": str(tmp_path / "disk")})
    got = list(StreamingDataset([source], shuffle=False))
    assert [s["texts"] for s in got] == [r["texts"] for r in rows]
    assert got[0]["images"][0].size == shapes[0]["images"][0].size  # PIL images survive the round trip

    stream = hf_source({"name": "json", "data_files": jsonl, "streaming": True})
    keys = [s["texts"] for s in StreamingDataset([stream], shuffle=False)]
    assert len(keys) == N
    full, head, tail = _resume_case(lambda: StreamingDataset([hf_source(
        {"name": "json", "data_files": jsonl, "streaming": True})], shuffle=False), k=3, workers=0)
    assert head + tail == full


def test_inspect_reports_counts_histograms_and_bad_samples(wds, tmp_path):
    report = inspect_source(os.path.dirname(wds[0]) + "/shard-*.tar")
    assert report["samples"] == N and report["shards"] == 9 and report["bad"] == {}
    assert set(report["images_per_sample"]) <= {1, 2} and sum(report["images_per_sample"].values()) == N
    assert sum(report["lengths"].values()) == N


def test_cli_to_wds_and_inspect(tmp_path, capsys):
    from vlmtrain.cli import main

    assert main(["data", "to-wds", "shapes:30", str(tmp_path / "out"), "--shard-size", "8"]) == 0
    assert sorted(os.listdir(tmp_path / "out")) == [f"shard-{i:06d}.tar" for i in range(4)]
    lines = [json.dumps({"images": ["missing.png"], "texts": [{"user": "q", "assistant": "a"}]}), "{oops",
             json.dumps({"images": [], "texts": [{"user": "q", "assistant": "a"}]})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["data", "inspect", str(tmp_path / "d.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "3 samples in 1 shard(s)" in out and "'missing_image': 1" in out and "'malformed_json': 1" in out
    assert main(["data", "inspect", str(tmp_path / "out" / "shard-{000000..000003}.tar")]) == 0
    assert "30 samples in 4 shard(s)" in capsys.readouterr().out
    assert main(["data", "inspect", str(tmp_path / "nothing-*.tar")]) == 2


def test_a_task_registers_its_stream_kind_and_command_line_prefix():
    """data/ names no task: the shapes task registers the `data.sources` kind `shapes` and the `vlmtrain data`
    source `shapes[:N]`, and each reads the task's training questions with its options."""
    from vlmtrain.data.streams import make_source
    from vlmtrain.data.tools import open_source

    entry = make_source({"kind": "shapes", "num_samples": 5, "seed": 3, "questions_per_sample": 2, "name": "s"})
    expected = ShapesVQA("train", 5, seed=3, questions_per_sample=2)
    got = [sample for _, sample in entry.read(0, {})]
    assert [s["texts"] for s in got] == [expected[i]["texts"] for i in range(5)]
    assert [s[KEY] for s in got] == [f"s:{i}" for i in range(5)]
    command_line = [sample for _, sample in open_source("shapes:30").read(0, {})]
    expected = ShapesVQA("train", 30, multi_image_fraction=0.4)
    assert [s["texts"] for s in command_line] == [expected[i]["texts"] for i in range(30)]


def test_trainer_runs_epochs_over_a_single_source_stream(shapes, tmp_path):
    """The Trainer calls set_epoch on a stream: each epoch reads every sample once, in a new shard order."""
    import torch

    from tests.tiny import TwoLossModel
    from vlmtrain import Trainer, TrainingArguments

    seen = []

    def collate(samples):
        seen.append(keys_of(samples))
        x = torch.randn(len(samples), 3, 4)
        return {"x": x, "y": torch.zeros(len(samples), 3, 2), "mask": torch.ones(len(samples), 3)}

    stream = StreamingDataset([IndexedSource(shapes, name="s", block_size=6)], seed=4)  # 10 shards
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=30, per_device_train_batch_size=6,
                             save_strategy="no", disable_tqdm=True, report_to="none", logging_steps=10)
    Trainer(TwoLossModel(), args, train_dataset=stream, data_collator=collate).train()
    epochs = [sum(seen[i:i + 10], []) for i in (0, 10, 20)]
    assert all(sorted(e) == sorted(f"s:{i}" for i in range(N)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled shards


class _KeyedModel(torch.nn.Module):
    """TwoLossModel that records the sample indices of each batch it trains on (in the main process)."""

    def __init__(self) -> None:
        super().__init__()
        from tests.tiny import TwoLossModel

        self.inner, self.seen = TwoLossModel(), []

    def forward(self, idx, **batch):
        self.seen.append(idx.tolist())
        return self.inner(**batch)


def _keyed_collate(samples):
    """Runs in the loader's workers: the batch carries its samples' indices as a tensor."""
    n = len(samples)
    return {"idx": torch.tensor([int(s[KEY].split(":")[1]) for s in samples]), "x": torch.randn(n, 3, 4),
            "y": torch.zeros(n, 3, 2), "mask": torch.ones(n, 3)}


def _train_stream(shapes, out, max_steps, **args):
    from vlmtrain import Trainer, TrainingArguments

    stream = StreamingDataset([IndexedSource(shapes, name="s", block_size=6)], seed=4)  # 10 shards
    model = _KeyedModel()
    args = TrainingArguments(output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=6,
                             disable_tqdm=True, report_to="none", logging_steps=10, **args)
    trainer = Trainer(model, args, train_dataset=stream, data_collator=_keyed_collate)
    return trainer, model


def test_persistent_workers_reshuffle_a_stream_every_epoch(shapes, tmp_path):
    """With one persistent worker (its copy of the stream outlives the epoch) each epoch reads its own shard order,
    the one a run without persistent workers reads."""
    runs = {}
    for persistent in (False, True):
        trainer, model = _train_stream(shapes, tmp_path / str(persistent), 20, save_strategy="no",
                                       dataloader_num_workers=1, dataloader_persistent_workers=persistent)
        trainer.train()
        runs[persistent] = [sum(model.seen[i:i + 10], []) for i in (0, 10)]
    first, second = runs[True]
    assert sorted(first) == sorted(second) == list(range(N)) and first != second
    assert runs[True] == runs[False]


def test_a_stream_resumed_with_another_number_of_workers_names_the_setting(shapes, tmp_path):
    trainer, _ = _train_stream(shapes, tmp_path, 2, save_strategy="steps", save_steps=2, dataloader_num_workers=0)
    trainer.train()
    resumed, _ = _train_stream(shapes, tmp_path, 4, save_strategy="no", dataloader_num_workers=1)
    with pytest.raises(ValueError, match=r"checkpoint-2.*dataloader_num_workers=0.*dataloader_num_workers=1.*"
                                         r"resume with train.dataloader_num_workers=0"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
