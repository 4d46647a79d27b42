"""Checkpoints: layout and loadability, atomic writes under a crash, rotation that keeps the best, resume
errors that name what is wrong, weights_only loading, and early errors for bad output dirs and inputs."""

from __future__ import annotations

import os
import shutil

import pytest
import safetensors.torch
import torch
from tiny import tiny_llama, token_samples
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from vlmtrain import Trainer, TrainingArguments
from vlmtrain.data.tokenizers import build_char_tokenizer
from vlmtrain.trainer import CheckpointError, TrainerCallback, TrainerState
from vlmtrain.trainer import checkpoint as ckpt

# transformers' files of a single-process checkpoint (test_hf_checkpoints.py compares them), plus loop_state_0.pt.
CKPT_FILES = {"model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", "rng_state.pth",
              "loop_state_0.pt", "trainer_state.json", "training_args.bin"}


pytestmark = pytest.mark.usefixtures("one_thread")


def make_args(out, **overrides) -> TrainingArguments:
    kwargs = dict(output_dir=str(out), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
                  logging_steps=1, save_steps=2, disable_tqdm=True)
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def checkpoints(out) -> list[str]:
    return sorted((n for n in os.listdir(out) if n.startswith("checkpoint-")), key=lambda n: int(n.split("-")[1]))


class Recorder(TrainerCallback):
    """Remembers the step training (re)starts at and what the output dir held at that moment."""

    def __init__(self) -> None:
        self.start_step = None
        self.listing_at_start = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start_step = state.global_step
        self.listing_at_start = sorted(os.listdir(args.output_dir))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One finished 4-step run with checkpoints at steps 2 and 4 (and a tokenizer), shared read-only."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("trained") / "out"
    tok = build_char_tokenizer("abcdefgh")
    trainer = Trainer(tiny_llama(0), make_args(out), train_dataset=token_samples(16), processing_class=tok)
    trainer.train()
    torch.set_num_threads(before)
    return trainer, out


@pytest.fixture
def run_copy(trained, tmp_path):
    """A private copy of the trained output dir, free to damage."""
    _, out = trained
    dst = tmp_path / "out"
    shutil.copytree(out, dst)
    return dst


# -- layout ------------------------------------------------------------------------------------------------
def test_layout_and_loadable_with_from_pretrained(trained):
    trainer, out = trained
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4"]
    assert os.path.isfile(out / "metrics.jsonl")
    assert not [n for n in os.listdir(out) if n.startswith(".")]  # no temp dirs or probes left behind
    for name in checkpoints(out):
        files = set(os.listdir(out / name))
        assert CKPT_FILES <= files, CKPT_FILES - files
        assert {"tokenizer.json", "tokenizer_config.json"} <= files  # processing_class has save_pretrained

    last = out / "checkpoint-4"
    loaded = LlamaForCausalLM.from_pretrained(last).eval()
    trainer.model.eval()
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trainer.model(input_ids=ids).logits)
    tok = PreTrainedTokenizerFast.from_pretrained(last)
    assert tok.decode(tok("badcafe")["input_ids"]) == "badcafe"

    state = TrainerState.load_from_json(str(last / "trainer_state.json"))
    assert state.global_step == 4 and state.max_steps == 4
    assert [e["step"] for e in state.log_history if "loss" in e] == [1, 2, 3, 4]


def test_checkpoint_files_load_with_weights_only(trained):
    _, out = trained
    d = out / "checkpoint-2"
    opt = torch.load(d / "optimizer.pt", weights_only=True)
    assert set(opt) == {"state", "param_groups"} and opt["state"]
    sched = torch.load(d / "scheduler.pt", weights_only=True)
    assert sched["last_epoch"] == 2
    rng = torch.load(d / "rng_state.pth", weights_only=True)
    assert {"python", "numpy", "cpu"} <= set(rng) and isinstance(rng["cpu"], torch.Tensor)
    loop = torch.load(d / "loop_state_0.pt", weights_only=True)
    assert {"loader", "epoch_index", "micro_step", "train_losses", "last_logged_step"} <= set(loop)
    assert loop["epoch_index"] == 0 and loop["micro_step"] == 2  # 4 batches per epoch: step 2 is mid-epoch


# -- atomicity ---------------------------------------------------------------------------------------------
def crash_in_torch_save(monkeypatch, step: int) -> None:
    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if os.path.basename(os.path.dirname(path)) == f"{ckpt.TMP_PREFIX}{step}" and path.endswith("scheduler.pt"):
            with open(path, "wb") as f:
                f.write(b"PK\x03\x04 half a file")
            raise OSError(28, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def crash_in_model_writer(monkeypatch, step: int) -> None:
    files = Trainer.parts.model_files  # (the format vlmtrain.Trainer writes the model in)
    real_write = files.save_model_files

    def write(model, directory, processing_class=None):
        if os.path.basename(directory) == f"{ckpt.TMP_PREFIX}{step}":
            with open(os.path.join(directory, ckpt.MODEL_NAME), "wb") as f:
                f.write(b"\x00" * 100)
            raise OSError(28, "No space left on device")
        return real_write(model, directory, processing_class)

    monkeypatch.setattr(files, "save_model_files", write)


@pytest.mark.parametrize("crash", [crash_in_torch_save, crash_in_model_writer])
def test_crash_during_save_leaves_no_checkpoint(tmp_path, monkeypatch, crash):
    out, data = tmp_path / "out", token_samples(16)
    with monkeypatch.context() as m:
        crash(m, step=4)
        with pytest.raises(OSError, match="No space left"):
            Trainer(tiny_llama(0), make_args(out, max_steps=6), train_dataset=data).train()
    assert checkpoints(out) == ["checkpoint-2"]
    assert not os.path.exists(out / f"{ckpt.TMP_PREFIX}4")  # the failed save's partial directory is removed
    assert ckpt.latest_checkpoint(str(out)) == str(out / "checkpoint-2")

    recorder = Recorder()
    resumed = Trainer(tiny_llama(1), make_args(out, max_steps=6), train_dataset=data, callbacks=[recorder])
    resumed.train(resume_from_checkpoint=True)
    assert recorder.start_step == 2
    assert f"{ckpt.TMP_PREFIX}4" not in recorder.listing_at_start
    assert resumed.state.global_step == 6
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert not [n for n in os.listdir(out) if n.startswith(".")]
    for name in checkpoints(out):
        ckpt.check_complete(str(out / name), files=Trainer.parts.model_files)


def test_train_without_resume_cleans_leftover_temp_dir(tmp_path, monkeypatch):
    out, data = tmp_path / "out", token_samples(16)
    # What a process killed mid-save (kill -9: no exception handler runs) leaves behind.
    os.makedirs(out / f"{ckpt.TMP_PREFIX}2")
    (out / f"{ckpt.TMP_PREFIX}2" / ckpt.MODEL_NAME).write_bytes(b"\x00" * 100)
    assert checkpoints(out) == [] and os.path.isdir(out / f"{ckpt.TMP_PREFIX}2")
    recorder = Recorder()
    Trainer(tiny_llama(0), make_args(out), train_dataset=data, callbacks=[recorder]).train()
    assert recorder.start_step == 0 and f"{ckpt.TMP_PREFIX}2" not in recorder.listing_at_start
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4"]


# -- rotation ----------------------------------------------------------------------------------------------
class RotationWatcher(TrainerCallback):
    """After every save: the best and the newest checkpoints exist, and at most limit (+ the best) remain."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.saves = []

    def on_save(self, args, state, control, **kwargs):
        present = checkpoints(args.output_dir)
        self.saves.append(present)
        assert f"checkpoint-{state.global_step}" in present
        best = os.path.basename(state.best_model_checkpoint)
        assert best in present
        assert len(present) <= self.limit + (best != f"checkpoint-{state.global_step}")


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_rotation_never_deletes_best_or_newest(tmp_path, limit):
    scores = iter([9.0, 1.0, 2.0, 3.0, 4.0])  # eval at steps 2, 4, 6, 8, 10: the first one is the best

    out = tmp_path / "out"
    watcher = RotationWatcher(limit)
    args = make_args(out, max_steps=10, save_total_limit=limit, eval_strategy="steps", eval_steps=2,
                     load_best_model_at_end=True, metric_for_best_model="score", logging_steps=5)
    assert args.greater_is_better is True
    trainer = Trainer(tiny_llama(0), args, train_dataset=token_samples(16), eval_dataset=token_samples(4),
                      compute_metrics=lambda pred: {"score": next(scores)}, callbacks=[watcher])
    trainer.train()

    assert len(watcher.saves) == 5
    assert trainer.state.best_global_step == 2
    assert trainer.state.best_model_checkpoint == str(out / "checkpoint-2")
    # (the watcher: the best and the newest after every save). When training ends save_total_limit=1 leaves the
    # best one only, as transformers' Trainer does; a larger limit keeps the newest ones beside it.
    newest = [f"checkpoint-{s}" for s in (4, 6, 8, 10)][-(limit - 1):] if limit > 1 else []
    assert checkpoints(out) == ["checkpoint-2", *newest]
    # load_best_model_at_end put the best checkpoint's weights back.
    best = safetensors.torch.load_file(str(out / "checkpoint-2" / "model.safetensors"))
    params = trainer.model.state_dict()
    assert all(torch.equal(params[k], v) for k, v in best.items())


def test_rotation_without_best_keeps_the_newest(tmp_path):
    out = tmp_path / "out"
    Trainer(tiny_llama(0), make_args(out, max_steps=8, save_total_limit=2), train_dataset=token_samples(16)).train()
    assert checkpoints(out) == ["checkpoint-6", "checkpoint-8"]


# -- resume errors -----------------------------------------------------------------------------------------
def test_resume_true_without_checkpoint_starts_from_scratch(tmp_path):
    recorder = Recorder()
    trainer = Trainer(tiny_llama(0), make_args(tmp_path / "out"), train_dataset=token_samples(16),
                      callbacks=[recorder])
    with pytest.warns(UserWarning, match="no complete checkpoint"):
        trainer.train(resume_from_checkpoint=True)
    assert recorder.start_step == 0 and trainer.state.global_step == 4


def test_resume_from_missing_path_names_it(tmp_path):
    missing = tmp_path / "nowhere" / "checkpoint-7"
    recorder = Recorder()
    trainer = Trainer(tiny_llama(0), make_args(tmp_path / "out"), train_dataset=token_samples(16),
                      callbacks=[recorder])
    with pytest.raises(CheckpointError, match="does not exist") as err:
        trainer.train(resume_from_checkpoint=str(missing))
    assert str(missing) in str(err.value)
    assert recorder.start_step is None  # failed before any training


@pytest.mark.parametrize("removed", ["optimizer.pt", "scheduler.pt", "model.safetensors", "trainer_state.json",
                                     "rng_state.pth"])
def test_resume_from_incomplete_checkpoint_names_missing_file(run_copy, removed):
    target = run_copy / "checkpoint-2"
    os.remove(target / removed)
    trainer = Trainer(tiny_llama(1), make_args(run_copy), train_dataset=token_samples(16))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(CheckpointError, match="incomplete") as err:
        trainer.train(resume_from_checkpoint=str(target))
    assert removed in str(err.value) and str(target) in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())  # nothing half-loaded


def test_resume_true_with_damaged_latest_names_missing_file(run_copy):
    os.remove(run_copy / "checkpoint-4" / "optimizer.pt")
    trainer = Trainer(tiny_llama(1), make_args(run_copy, max_steps=6), train_dataset=token_samples(16))
    with pytest.raises(CheckpointError, match="optimizer.pt"):
        trainer.train(resume_from_checkpoint=True)


# -- early errors ------------------------------------------------------------------------------------------
def test_unwritable_output_dir_fails_before_training(tmp_path):
    (tmp_path / "afile").write_text("not a directory")
    out = tmp_path / "afile" / "out"
    recorder = Recorder()
    model = tiny_llama(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(model, make_args(out), train_dataset=token_samples(16), callbacks=[recorder])
    with pytest.raises(PermissionError, match="not writable") as err:
        trainer.train()
    assert str(out) in str(err.value)
    assert recorder.start_step is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_train_without_dataset_says_pass_train_dataset(tmp_path):
    with pytest.raises(ValueError, match=r"train_dataset"):
        Trainer(tiny_llama(0), make_args(tmp_path / "out")).train()


def test_model_without_loss_names_output_keys(tmp_path):
    no_labels = [{"input_ids": s["input_ids"], "attention_mask": s["attention_mask"]} for s in token_samples(8)]
    trainer = Trainer(tiny_llama(0), make_args(tmp_path / "out"), train_dataset=no_labels)
    with pytest.raises(ValueError, match="no 'loss'") as err:
        trainer.train()
    assert "logits" in str(err.value) and "labels" in str(err.value)


def test_export_of_an_unsharded_checkpoint_copies_its_model_files_without_the_training_state(tmp_path, capsys):
    from vlmtrain import cli

    ckpt = tmp_path / "checkpoint-1"
    ckpt.mkdir()
    for name in ("model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", "trainer_state.json",
                 "rng_state_0.pth", "rng_state.pth", "loop_state_0.pt", "training_args.bin"):
        (ckpt / name).write_bytes(b"")
    assert cli.main(["export", "--checkpoint", str(ckpt)]) == 0
    assert f"wrote {ckpt}-export" in capsys.readouterr().out
    assert sorted(os.listdir(f"{ckpt}-export")) == ["config.json", "model.safetensors"]
