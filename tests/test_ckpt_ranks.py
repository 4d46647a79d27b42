"""Under DDP no two ranks write one checkpoint file: the optimizer and scheduler (identical on every rank) are
written by rank 0 alone, each rank writes its own RNG and loop state; resume from such a checkpoint is bitwise.

The ranks (tests/preloaded.py: forked with their imports done, torchrun's rank environment) run recorded_train:
`vlmtrain train` with every file write recorded (torch.save, safetensors, and Python's open/os.open in a writing
mode) into WRITES_LOG/rank<RANK>.txt.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from tests import preloaded
from vlmtrain.checkpointing.reposition import reposition
from vlmtrain.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[1]


def _record_writes(log_path: str) -> None:
    """Append the absolute path of every file this process opens for writing to log_path."""
    import safetensors.torch
    import transformers.modeling_utils

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def note(path) -> None:
        if isinstance(path, (str, os.PathLike)):
            os.write(fd, (os.path.abspath(os.fspath(path)) + "\n").encode())

    def audit(event: str, args: tuple) -> None:  # builtins.open, io.open and os.open
        if event == "open" and args and (
                (isinstance(args[1], str) and any(c in args[1] for c in "wax+"))
                or (isinstance(args[2], int) and args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))):
            if os.fspath(args[0]) != log_path:
                note(args[0])

    def wrap(func):
        def recorded(obj, path, *args, **kwargs):
            note(path)
            return func(obj, path, *args, **kwargs)
        return recorded

    torch.save = wrap(torch.save)  # its C++ writer opens the file outside Python's open
    safetensors.torch.save_file = wrap(safetensors.torch.save_file)
    safetensors.torch.save_model = wrap(safetensors.torch.save_model)
    transformers.modeling_utils.safe_save_file = wrap(transformers.modeling_utils.safe_save_file)
    sys.addaudithook(audit)


def _train(tmp_path: Path, out: str, *extra: str) -> dict[int, list[str]]:
    """A 2-rank DDP run (6 steps, checkpoints at 3 and 6); returns each rank's written paths, relative to the
    run's directory, with the temporary checkpoint directory named as the checkpoint it becomes."""
    from tests.test_distributed import LM

    cfg = json.loads(json.dumps(LM))
    cfg["train"].update(predict_with_generate=False)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    logs = tmp_path / f"{out}-writes"
    logs.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "WRITES_LOG": str(logs)}
    codes, output = preloaded.launch("tests.test_ckpt_ranks:recorded_train", [
        "train", "--config", str(tmp_path / "cfg.yaml"), "--train.output_dir", str(tmp_path / out),
        "--train.per_device_train_batch_size", "2", *extra], env, 2, logs)
    assert codes == [0, 0], output
    run = str(tmp_path / out) + os.sep
    writes = {}
    for rank in (0, 1):
        paths = (logs / f"rank{rank}.txt").read_text().split()
        writes[rank] = [p[len(run):].replace(".tmp-checkpoint-", "checkpoint-") for p in paths if p.startswith(run)]
    return writes


def _train_loss(run: Path) -> float:
    return next(r["train_loss"] for r in map(json.loads, open(run / "metrics.jsonl")) if "train_loss" in r)


@pytest.mark.slow
def test_ranks_never_write_one_path_and_resume_is_bitwise(tmp_path):
    straight = _train(tmp_path, "straight")
    resumed = _train(tmp_path, "resumed", "--train.resume_from_checkpoint", str(tmp_path / "straight" / "checkpoint-3"))
    for writes, steps in ((straight, (3, 6)), (resumed, (6,))):
        shared = set(writes[0]) & set(writes[1])
        assert not shared, f"written by both ranks: {sorted(shared)}"
        for rank in (0, 1):
            files = [p for p in writes[rank] if p.startswith("checkpoint-")]
            assert len(files) == len(set(files)), f"rank {rank} wrote a checkpoint file twice: {files}"
        for step in steps:
            d = f"checkpoint-{step}/"
            assert {d + "optimizer.pt", d + "scheduler.pt", d + "trainer_state.json", d + "model.safetensors",
                    d + "rng_state_0.pth", d + "loop_state_0.pt"} <= set(writes[0]), writes[0]
            assert {n for n in writes[1] if n.startswith(d)} == {d + "rng_state_1.pth", d + "loop_state_1.pt"}
        assert "metrics.jsonl" in writes[0] and "metrics.jsonl" not in writes[1]

    final = [load_file(str(tmp_path / run / "checkpoint-6" / "model.safetensors")) for run in ("straight", "resumed")]
    assert set(final[0]) == set(final[1]) and all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    opt, sched = ([torch.load(tmp_path / run / "checkpoint-6" / name, weights_only=True) for run in ("straight", "resumed")]
                  for name in ("optimizer.pt", "scheduler.pt"))  # and so is what rank 0 alone wrote
    assert sched[0] == sched[1] and opt[0]["param_groups"] == opt[1]["param_groups"]
    assert all(torch.equal(opt[0]["state"][i][k], opt[1]["state"][i][k]) for i in opt[0]["state"]
               for k in opt[0]["state"][i])
    # TrainOutput.train_loss covers the whole run: the resumed run's includes steps 1-3 it did not train.
    assert _train_loss(tmp_path / "resumed") == _train_loss(tmp_path / "straight")


def _world_run(tmp_path: Path, nproc: int, phase: str, stop_at: int, bad: tuple[int, ...]) -> list[dict]:
    """tests/world_size_worker.py in ``nproc`` processes (ranks as torchrun starts them, for several; forked with
    their imports done, tests/preloaded.py) on tmp_path/run; each rank's record: the ids its steps trained, its
    final global_step and max_steps."""
    worker = [str(tmp_path / "run"), phase, str(stop_at), "resume" if phase == "resumed" else "new",
              ",".join(map(str, bad))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    logs = tmp_path / f"{phase}-logs"
    logs.mkdir()
    codes, output = preloaded.launch("tests.world_size_worker:run", worker, env, nproc, logs)
    assert codes == [0] * nproc, output
    return [json.loads((tmp_path / "run" / f"{phase}-rank{r}.json").read_text()) for r in range(nproc)]


# (processes before, after; the step the first run stops after; bad ids, each set an all-bad batch on one rank;
# the ids no step trains: the bad ones and, under DDP, the other rank's batch of that micro-step)
WORLD_CHANGES = [(2, 1, 2, (), ()), (2, 1, 2, (4, 6), (4, 5, 6, 7)), (1, 2, 4, (), ()), (1, 2, 4, (4, 5), (4, 5))]


@pytest.mark.slow
@pytest.mark.parametrize(("before", "after", "stop_at", "bad", "untrained"), WORLD_CHANGES,
                         ids=["2to1", "2to1-all-bad-batch", "1to2", "1to2-all-bad-batch"])
def test_resume_with_another_number_of_processes_trains_each_sample_once(tmp_path, before, after, stop_at, bad,
                                                                         untrained):
    """A mid-epoch checkpoint of map-style data resumed by another number of processes goes on at the epoch's
    global sample position: over both runs every sample of the epoch is trained once (none twice, none left
    out), and an epoch-based run ends at its epoch's end."""
    first = _world_run(tmp_path, before, "first", stop_at, bad)
    resumed = _world_run(tmp_path, after, "resumed", 0, bad)
    assert all(run["global_step"] == stop_at for run in first)
    trained = [i for run in (*first, *resumed) for ids in run["steps"].values() for i in ids]
    assert sorted(trained) == [i for i in range(40) if i not in untrained]
    steps_after = 40 // 2 // 2 // after - stop_at * before // after  # the epoch's steps left at the new size
    assert resumed[0]["max_steps"] == stop_at + steps_after
    assert sorted(int(s) for s in resumed[0]["steps"])[0] == stop_at + 1



def _position(samples: int, num_replicas: int = 1) -> StatefulDataLoader:
    """A loader of ten ids, batch 1, in order (rank 0 of ``num_replicas``), after ``samples`` batches."""
    data = list(range(10))
    loader = StatefulDataLoader(data, batch_size=1, sampler=StatefulDistributedSampler(
        data, num_replicas=num_replicas, rank=0, shuffle=False))
    batches = iter(loader)
    for _ in range(samples):
        next(batches)
    return loader


def test_a_position_the_new_processes_cannot_split_evenly_is_refused():
    """One process had taken 3 samples: 2 processes cannot go on from there in step (each would skip 1.5); 4
    samples: each goes on after 2 of its share."""
    two = _position(0, num_replicas=2)
    with pytest.raises(CheckpointError, match=r"ckpt was written by 1 process\(es\) and is resumed by 2: its epoch "
                                              r"position \(3 samples, 3 micro-batches per process\) does not split"):
        reposition(two, {"loader": _position(3).state_dict(), "micro_step": 3}, 1, 2, 1, "ckpt")
    assert reposition(two, {"loader": _position(4).state_dict(), "micro_step": 4}, 1, 2, 1, "ckpt") == 2
    assert [int(batch) for batch in two] == [4, 6, 8]


def recorded_train(argv: list[str]) -> int:
    """The ranks of _train: `vlmtrain <argv>`, every file write recorded."""
    _record_writes(os.path.join(os.environ["WRITES_LOG"], f"rank{os.environ.get('RANK', '0')}.txt"))
    from vlmtrain import cli

    return cli.main(argv)
