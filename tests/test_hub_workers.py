"""Hub VLM processing in data-loader workers: train.dataloader_num_workers 'auto' (the default) uses workers on a
CUDA machine, gives the same batches as the main process, and bad samples skipped in a worker still reach the
logs. On this CPU-only suite the CUDA machine is injected: the real 'auto' rule, told it runs on a GPU."""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml
from PIL import Image

from vlmtrain import TrainingArguments, run
from vlmtrain.config import load_run_config
from vlmtrain.models.families import get_family
from vlmtrain.trainer import setup
from vlmtrain.trainer.setup import dataloader_workers

BAD = {"missing_image": 2, "malformed_text": 1}  # the bad samples among the 12 below


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return get_family("qwen3_vl").build_tiny(str(tmp_path_factory.mktemp("qwen3_vl")), seed=0)


def _data(tmp_path) -> None:
    rows = []
    for i in range(12):
        Image.new("RGB", (32 + 8 * (i % 3), 32), ((60 * i) % 256, 90, 200)).save(tmp_path / f"{i}.png")
        rows.append({"images": [f"{i}.png", f"{(i + 1) % 12}.png"],
                     "texts": [{"user": f"Which colour is image {i}?", "assistant": "red green blue".split()[i % 3]}]})
    rows[3]["images"][1] = rows[8]["images"][0] = "nowhere.png"  # missing_image x 2
    rows[10]["texts"] = [{"user": "", "assistant": "x"}]  # malformed_text
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _trainer(tmp_path, checkpoint, name, workers=None):
    train = {"output_dir": str(tmp_path / name), "max_steps": 3, "per_device_train_batch_size": 4,
             "logging_steps": 1, "save_strategy": "no", "disable_tqdm": True, "learning_rate": 1e-2}
    if workers is not None:
        train["dataloader_num_workers"] = workers
    cfg = {"model": {"kind": "hub_vlm", "pretrained": checkpoint},
           "data": {"source": "jsonl", "train_file": str(tmp_path / "data.jsonl"), "num_eval": 0},
           "train": train}
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    return run.build(load_run_config(str(tmp_path / f"{name}.yaml")))


@pytest.fixture
def on_a_gpu_machine(monkeypatch):
    """The trainer resolves 'auto' as on a CUDA machine with 4 cores for this one process (-> 2 workers)."""
    monkeypatch.setattr(setup, "dataloader_workers",
                        lambda value, cuda: dataloader_workers(value, cuda=True, cpus=4, local_world_size=1))


class RecordPid:
    """The trainer's collator, each batch tagged with the process that made it."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, samples):
        return {**self.collator(samples), "pid": os.getpid()}


def test_auto_workers_rule():
    assert dataloader_workers("auto", cuda=True, cpus=16, local_world_size=1) == 4
    assert dataloader_workers("auto", cuda=True, cpus=4, local_world_size=1) == 2
    assert dataloader_workers("auto", cuda=True, cpus=2, local_world_size=1) == 0  # two cores stay with training
    assert dataloader_workers("auto", cuda=True, cpus=32, local_world_size=8) == 2  # cores shared by the ranks
    assert dataloader_workers("auto", cuda=False, cpus=64, local_world_size=1) == 0
    assert dataloader_workers(3, cuda=False) == dataloader_workers(3, cuda=True) == 3


def test_auto_is_the_default_and_cpu_keeps_processing_in_the_main_process(tmp_path, checkpoint):
    _data(tmp_path)
    trainer = _trainer(tmp_path, checkpoint, "cpu")
    assert trainer.args.dataloader_num_workers == "auto"  # a config run's default
    assert trainer.get_train_dataloader().num_workers == 0
    assert TrainingArguments().dataloader_num_workers == 0  # in Python: transformers' default


def _batches(trainer):
    trainer.data_collator = RecordPid(trainer.data_collator)
    loader = trainer.get_train_dataloader()
    return loader.num_workers, list(loader)


def test_hub_processing_runs_in_workers_with_the_same_batches(tmp_path, checkpoint, on_a_gpu_machine, one_thread):
    """'auto' on a GPU machine: processing in 2 worker processes, batch for batch what 0 workers give (tensors
    and the per-batch skip counts)."""
    _data(tmp_path)
    workers, in_workers = _batches(_trainer(tmp_path, checkpoint, "auto"))
    none, in_main = _batches(_trainer(tmp_path, checkpoint, "main", workers=0))
    assert (workers, none) == (2, 0)
    assert {b.pop("pid") for b in in_main} == {os.getpid()}
    assert os.getpid() not in {b.pop("pid") for b in in_workers}
    assert len(in_workers) == len(in_main) == 3
    for got, want in zip(in_workers, in_main):
        assert got.keys() == want.keys()
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got[key], value), key
            else:
                assert got[key] == value, key
    skipped = [b["skipped"] for b in in_main]
    assert sum(sum(s.values()) for s in skipped) == sum(BAD.values())


def test_skips_counted_in_workers_reach_the_logs(tmp_path, checkpoint, on_a_gpu_machine, one_thread):
    """Trained with 2 workers ('auto' on a GPU machine) and with 0: the same losses, and the bad samples dropped
    in the workers are counted in metrics.jsonl per logging window and in the run's totals."""
    _data(tmp_path)
    results = {}
    for name, workers in (("auto", None), ("main", 0)):
        trainer = _trainer(tmp_path, checkpoint, name, workers)
        assert trainer.get_train_dataloader().num_workers == (2 if workers is None else 0)
        with pytest.warns(UserWarning, match="3 training samples were skipped"):
            out = trainer.train()
        logged = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        per_window = {r: sum(rec.get(f"skipped_{r}", 0) for rec in logged if "loss" in rec) for r in BAD}
        results[name] = ([rec["loss"] for rec in logged if "loss" in rec], per_window,
                         {r: out.metrics.get(f"train_skipped_{r}") for r in BAD})
    losses, per_window, totals = results["auto"]
    assert per_window == totals == BAD
    assert len(losses) == 3 and losses == results["main"][0]


@pytest.mark.gpu
def test_on_a_gpu_machine_auto_processes_in_workers_and_counts_skips(tmp_path, checkpoint):
    """Nothing injected: on this CUDA machine 'auto' gives the rule's workers, and the skips reach the logs."""
    _data(tmp_path)
    trainer = _trainer(tmp_path, checkpoint, "gpu")
    assert trainer.device.type == "cuda"
    workers = trainer.get_train_dataloader().num_workers
    assert workers == dataloader_workers("auto", cuda=True) and (workers > 0 or (os.cpu_count() or 1) < 3)
    with pytest.warns(UserWarning, match="3 training samples were skipped"):
        out = trainer.train()
    assert {r: out.metrics.get(f"train_skipped_{r}") for r in BAD} == BAD
