"""train.async_checkpoint: training goes on while a checkpoint is written from a CPU copy; the checkpoints are the
ones a synchronous run writes, resume from them is exact, a failed write raises (on every rank) instead of leaving
a checkpoint silently missing, and no writer thread outlives train()."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import tiny_llama, token_samples

from vlmtrain import Trainer, TrainingArguments
from vlmtrain.checkpointing.async_writer import cpu_model_copy
from vlmtrain.trainer import TrainerCallback
from vlmtrain.trainer import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


def _args(out, **kw) -> TrainingArguments:
    kw = {"max_steps": 6, "per_device_train_batch_size": 4, "learning_rate": 1e-2, "logging_steps": 1,
          "save_steps": 2, "disable_tqdm": True, **kw}
    return TrainingArguments(output_dir=str(out), **kw)


HANG_S = 60  # a held checkpoint write gives up (and fails the save) after this long: a bound on a hang


def _held_writes(monkeypatch) -> dict[int, threading.Event]:
    """Holds each background write of checkpoint-N in its first torch.save until the test sets events[N]: the
    test, not the machine's speed, decides how long a write is in flight."""
    events: dict[int, threading.Event] = {}
    real_save = torch.save

    def save(*args, **kwargs):
        name = threading.current_thread().name
        if name.startswith("vlmtrain-checkpoint-"):
            event = events.setdefault(int(name.rsplit("-", 1)[1]), threading.Event())
            assert event.wait(HANG_S), f"{name}: never released"
        return real_save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    return events


def _writers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("vlmtrain-checkpoint")]


class WatchWrites(TrainerCallback):
    """Records, at each step begin, which checkpoint directories exist (complete and temporary); then releases
    the held write of the checkpoint saved at the step before (see _held_writes; the last one is not held)."""

    def __init__(self, release: dict[int, threading.Event] | None = None) -> None:
        self.seen: list[tuple[int, list[str]]] = []
        self.release = release

    def on_step_begin(self, args, state, control, **kwargs):
        names = sorted(n for n in os.listdir(args.output_dir) if "checkpoint-" in n)
        self.seen.append((state.global_step, names))
        if self.release is not None:
            self.release.setdefault(state.global_step, threading.Event()).set()

    def on_step_end(self, args, state, control, **kwargs):
        if self.release is not None and state.global_step == state.max_steps:
            self.release.setdefault(state.global_step, threading.Event()).set()


def _same_checkpoint(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / ckpt.MODEL_NAME)), load_file(str(b / ckpt.MODEL_NAME))
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    oa, ob = (torch.load(d / "optimizer.pt", weights_only=True) for d in (a, b))
    assert oa["param_groups"] == ob["param_groups"]
    assert all(torch.equal(oa["state"][i][k], ob["state"][i][k]) for i in oa["state"] for k in oa["state"][i]
               if isinstance(oa["state"][i][k], torch.Tensor))
    for name in ("scheduler.pt", "rng_state.pth", "loop_state_0.pt"):
        assert str(torch.load(a / name, weights_only=True)) == str(torch.load(b / name, weights_only=True)), name
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))


def test_async_saves_equal_sync_saves_while_steps_go_on(tmp_path, monkeypatch):
    data = token_samples(32)
    Trainer(tiny_llama(0), _args(tmp_path / "sync"), train_dataset=data).train()
    # Each write is held until the next step begins: the steps must not wait for it.
    watch = WatchWrites(release=_held_writes(monkeypatch))
    out = Trainer(tiny_llama(0), _args(tmp_path / "async", async_checkpoint=True), train_dataset=data,
                  callbacks=[watch]).train()
    assert out.global_step == 6 and not _writers()
    # Steps 3 and 5 began while checkpoint-2 and -4 were still being written: the save did not block them.
    assert (2, [f"{ckpt.TMP_PREFIX}2"]) in watch.seen, watch.seen
    assert (4, sorted([f"{ckpt.TMP_PREFIX}4", "checkpoint-2"])) in watch.seen, watch.seen
    for step in (2, 4, 6):  # written from copies: later steps did not leak into them
        _same_checkpoint(tmp_path / "sync" / f"checkpoint-{step}", tmp_path / "async" / f"checkpoint-{step}")
    assert not [n for n in os.listdir(tmp_path / "async") if n.startswith(".")]


def test_resume_from_an_async_checkpoint_is_exact(tmp_path):
    data = token_samples(32)
    straight = Trainer(tiny_llama(0), _args(tmp_path / "a", async_checkpoint=True), train_dataset=data).train()
    resumed_trainer = Trainer(tiny_llama(1), _args(tmp_path / "b", async_checkpoint=True), train_dataset=data)
    resumed = resumed_trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    wa, wb = (load_file(str(tmp_path / r / "checkpoint-6" / ckpt.MODEL_NAME)) for r in ("a", "b"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert resumed.training_loss == straight.training_loss


def test_rotation_keeps_the_limit_and_never_touches_the_save_in_flight(tmp_path, monkeypatch):
    watch = WatchWrites(release=_held_writes(monkeypatch))  # each write in flight until the next step begins
    Trainer(tiny_llama(0), _args(tmp_path, max_steps=10, save_total_limit=2, async_checkpoint=True),
            train_dataset=token_samples(48), callbacks=[watch]).train()
    assert sorted(n for n in os.listdir(tmp_path) if "checkpoint" in n) == ["checkpoint-10", "checkpoint-8"]
    assert all(len([n for n in names if n.startswith("checkpoint-")]) <= 2 for _, names in watch.seen)
    in_flight = [step for step, names in watch.seen if f"{ckpt.TMP_PREFIX}{step}" in names]
    assert in_flight == [2, 4, 6, 8], watch.seen  # each save was in flight over the next step


def test_a_failed_background_write_raises_and_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    real_save = torch.save

    def full_disk(obj, path, *args, **kwargs):
        if f"{ckpt.TMP_PREFIX}4" in str(path):
            raise OSError(28, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    class WriterDoneAtStep5(TrainerCallback):
        """Joins checkpoint-4's writer in step 5's on_step_end (before that step end's poll), so the failure
        is on disk by then: no timing decides at which step it is seen. Records the steps that began."""

        def __init__(self) -> None:
            self.began: list[int] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.began.append(state.global_step + 1)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 5:
                for writer in _writers():
                    writer.join()

    monkeypatch.setattr(torch, "save", full_disk)
    steps = WriterDoneAtStep5()
    trainer = Trainer(tiny_llama(0), _args(tmp_path, async_checkpoint=True), train_dataset=token_samples(32),
                      callbacks=[steps])
    with pytest.raises(OSError, match=r"could not write checkpoint-4 .*No space left on device.*checkpoint-2"):
        trainer.train()
    assert not _writers()
    assert sorted(n for n in os.listdir(tmp_path) if "checkpoint" in n) == ["checkpoint-2"]
    # Raised at step 5's end, the first step end after the failed write finished: step 6 never ran (not
    # raised by step 6's save or at the end of training).
    assert trainer.state.global_step == 5 and steps.began == [1, 2, 3, 4, 5]


def test_an_error_in_training_waits_for_the_writer(tmp_path, monkeypatch):
    class Boom(Exception):
        pass

    class FailAfterSave(TrainerCallback):  # checkpoint-2's write is held until then: it is still going on
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                release[2].set()
                raise Boom()

    release = _held_writes(monkeypatch)
    release[2] = threading.Event()
    with pytest.raises(Boom):
        Trainer(tiny_llama(0), _args(tmp_path, async_checkpoint=True), train_dataset=token_samples(32),
                callbacks=[FailAfterSave()]).train()
    assert not _writers()  # joined before the error left train()
    # checkpoint-2 was written but never published (that happens at a step end): a leftover the next start removes
    assert sorted(n for n in os.listdir(tmp_path) if "checkpoint" in n) == [f"{ckpt.TMP_PREFIX}2"]
    monkeypatch.undo()
    resumed = Trainer(tiny_llama(0), _args(tmp_path, async_checkpoint=True), train_dataset=token_samples(32))
    with pytest.warns(UserWarning, match="no complete checkpoint"):
        assert resumed.train(resume_from_checkpoint=True).global_step == 6
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_cpu_model_copy_keeps_ties_and_shares_frozen_weights():
    model = tiny_llama(0, tie_word_embeddings=True)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    copy = cpu_model_copy(model)
    assert copy.lm_head.weight is copy.model.embed_tokens.weight
    assert copy.model.embed_tokens.weight is not model.model.embed_tokens.weight
    assert copy.model.layers[0].mlp.up_proj.weight is model.model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    assert not torch.equal(copy.model.norm.weight, model.model.norm.weight)


@pytest.mark.slow
def test_a_failed_async_write_on_one_rank_fails_every_rank(tmp_path):
    """Rank 1 cannot write checkpoint-4 in the background: both ranks raise within seconds naming rank 1, no
    partial directory is left, checkpoint-2 stays, and resume from it ends like an uninterrupted run."""
    from tests.test_distributed import LM, _run, _weights, run_with_full_disk_on_rank1

    cfg = json.loads(json.dumps(LM))
    cfg["train"].update(save_steps=2, ddp_timeout=600, async_checkpoint=True, predict_with_generate=False)
    done = run_with_full_disk_on_rank1(tmp_path, cfg)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert out.count("could not write checkpoint-4") >= 2 and "failed on rank(s) [1]" in out, out[-3000:]
    assert not any(n.startswith(".tmp") for n in os.listdir(tmp_path / "run")), os.listdir(tmp_path / "run")
    assert (tmp_path / "run" / "checkpoint-2").is_dir() and not (tmp_path / "run" / "checkpoint-4").exists()
    resumed = _run(tmp_path, cfg, "run", 2, 2, "--train.resume_from_checkpoint", "true")
    straight = _run(tmp_path, cfg, "straight", 2, 2, "--train.async_checkpoint", "false")
    steps = cfg["train"]["max_steps"]
    wr, ws = _weights(resumed, steps), _weights(straight, steps)
    assert all(torch.equal(wr[k], ws[k]) for k in ws)
