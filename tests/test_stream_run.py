"""Streams through the config: WebDataset + JSONL mixture, filters, failing sources, exact resume, bad data stop."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.test_vlm_run import _config
from vlmtrain import run
from vlmtrain.config import ConfigError
from vlmtrain.data.cauldron import write_cauldron_jsonl
from vlmtrain.data.streams import min_ratings_filter
from vlmtrain.data.tools import write_webdataset
from vlmtrain.tasks.shapes import ShapesVQA


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    shapes = ShapesVQA("train", 96, seed=11, multi_image_fraction=0.4)
    write_webdataset((shapes[i] for i in range(96)), str(root / "wds"), shard_size=12)
    write_cauldron_jsonl(ShapesVQA("train", 40, seed=12), str(root / "jsonl"))
    return root


def _stream_config(tmp_path, data_dir, out="run", **data):
    sources = [{"kind": "wds", "path": str(data_dir / "wds" / "shard-{000000..000007}.tar"), "weight": 3},
               {"kind": "jsonl", "path": str(data_dir / "jsonl" / "data.jsonl"), "weight": 1}]
    cfg = _config(tmp_path, data={"source": "stream", "sources": sources, **data},
                  train={"max_steps": 4, "save_steps": 2, "eval_strategy": "no", "dataloader_num_workers": 2})
    cfg.train.output_dir = str(tmp_path / out)
    return cfg


def _losses(path):
    rows = [json.loads(line) for line in open(path / "metrics.jsonl")]
    return {r["step"]: (r["loss"], r["epoch"]) for r in rows if "loss" in r and "train_runtime" not in r}


@pytest.mark.parametrize("one_source", [False, True], ids=["mixture", "one-source-epoch-end"])
def test_stream_mixture_trains_and_resumes_exactly(tmp_path, data_dir, one_source):
    """A 2-source mixture resumed mid-run, and one source (40 samples over 2 workers in batches of 8: 6 steps an
    epoch) resumed from the checkpoint at its epoch's end, which goes on with the next epoch: the same losses and
    epochs as the uninterrupted run, identical weights (AdamW, weight decay)."""
    save, steps = (6, 8) if one_source else (2, 4)
    runs = {}
    for name in ("straight", "resumed"):
        cfg = _stream_config(tmp_path, data_dir, name)
        cfg.train.max_steps, cfg.train.save_steps, cfg.train.weight_decay = steps, save, 0.1
        if one_source:
            cfg.data.sources = cfg.data.sources[1:]
        if name == "resumed":
            cfg.train.resume_from_checkpoint = str(tmp_path / "straight" / f"checkpoint-{save}")
        run.train(cfg)
        runs[name] = _losses(tmp_path / name)
    a, b = runs["straight"], runs["resumed"]
    assert set(a) == set(range(1, steps + 1)) and set(b) == set(range(save + 1, steps + 1))
    assert b == {s: a[s] for s in b}  # (loss, epoch): the resumed run read exactly the samples the straight one did
    wa = load_file(str(tmp_path / "straight" / f"checkpoint-{steps}" / "model.safetensors"))
    wb = load_file(str(tmp_path / "resumed" / f"checkpoint-{steps}" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_failing_source_is_skipped_and_none_is_an_error(tmp_path, data_dir, caplog):
    cfg = _stream_config(tmp_path, data_dir)
    cfg.data.sources = [{"kind": "wds", "path": str(tmp_path / "missing-*.tar")}, *cfg.data.sources]
    trainer = run.build(cfg)
    assert len(trainer.train_dataset.sources) == 2
    assert "data.sources[0] (wds" in caplog.text and "no file matches" in caplog.text
    cfg.data.sources = cfg.data.sources[:1]
    with pytest.raises(ConfigError, match="no data source could be loaded"):
        run.build(cfg)
    with pytest.raises(ConfigError, match=r"data.sources\[0\] needs kind"):
        _config(tmp_path, data={"source": "stream", "sources": [{"path": "x.tar"}]})


def test_rating_filter_trims_turns_and_drops_empty_samples():
    keep = min_ratings_filter({"relevance": 3, "formatting": 2})
    texts = [{"user": f"q{i}", "assistant": "a"} for i in range(3)]
    out = keep({"texts": texts, "relevance_ratings": [5, 1, 3], "formatting_ratings": [2, 4, 1]})
    assert out["texts"] == [texts[0]] and "relevance_ratings" not in out
    assert keep({"texts": texts, "relevance_ratings": [1, 1, 1]}) is False
    assert keep({"texts": texts, "relevance_rating": 2}) is False
    assert keep({"texts": texts}) is True  # no ratings: kept


def test_config_filters_apply_to_streams(tmp_path, data_dir, monkeypatch):
    import sys
    import types

    hook = types.ModuleType("my_filters")
    hook.no_two_image_samples = lambda sample: len(sample.get("images") or []) < 2
    monkeypatch.setitem(sys.modules, "my_filters", hook)
    cfg = _stream_config(tmp_path, data_dir, filter="my_filters:no_two_image_samples")
    stream = run.build(cfg).train_dataset
    samples = [s for _, s in zip(range(60), stream)]
    assert all(len(s["images"]) < 2 for s in samples)
    assert sum(sum(s.get("__dropped__", {}).values()) for s in samples) > 0
    with pytest.raises(ConfigError, match="cannot load it"):
        run.build(_stream_config(tmp_path, data_dir, filter="my_filters:nope"))


def test_too_many_bad_samples_stop_training_with_example_keys(tmp_path):
    good = {"texts": [{"user": "What color?", "assistant": "red"}], "images": []}
    lines = [json.dumps(good)] * 4 + [json.dumps({"texts": [], "images": []})] * 12
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    cfg = _config(tmp_path, data={"source": "stream", "sources": [{"kind": "jsonl", "path": str(path)}]},
                  train={"max_steps": 4, "eval_strategy": "no", "save_strategy": "no"})
    with pytest.raises(RuntimeError, match=r"8 of the last 8 training samples were bad .*empty_conversation.*"
                                           r"Examples: .*bad.jsonl:\d+ \(empty_conversation\)"):
        run.train(cfg)
