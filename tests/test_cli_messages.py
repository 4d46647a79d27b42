"""What a user sees from the command line: short --help pages (--help-all for every key), one line per error they
can act on (also from the ranks of `--nproc N`), a word when --nproc runs on the CPU, no deprecation warnings of
ours in a multi-process run, and a stopped demo that names the command which continues it."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from vlmtrain import cli, run
from vlmtrain.config import SECTIONS
from vlmtrain.config_checks import field_names
from vlmtrain.errors import CheckpointError, ConfigError, DataError

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
LM = {
    "model": {"kind": "causal_lm", "config": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                                              "num_hidden_layers": 1, "num_attention_heads": 4,
                                              "num_key_value_heads": 2, "max_position_embeddings": 32}},
    "data": {"source": "addition", "num_train": 64, "num_eval": 8, "packing": False},
    "train": {"max_steps": 4, "learning_rate": 3e-3, "logging_steps": 1, "eval_strategy": "steps", "eval_steps": 2,
              "save_strategy": "steps", "save_steps": 2, "disable_tqdm": True, "seed": 3,
              "per_device_train_batch_size": 4, "per_device_eval_batch_size": 8, "ddp_timeout": 60,
              "predict_with_generate": True, "generation_max_new_tokens": 4},
}


def _help(capsys, *argv: str) -> str:
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


def _write(tmp_path: Path, cfg: dict, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def _vlmtrain(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlmtrain", *argv], env=ENV, cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("command", ["train", "eval"])
def test_config_command_help_shows_the_common_keys_and_points_to_help_all(capsys, command):
    out = _help(capsys, command, "--help")
    assert len(out.splitlines()) < 300, len(out.splitlines())  # it was 1,176 (train) and 1,189 (eval)
    assert "--train.learning_rate" in out and "Peak learning rate" in out and "--model.pretrained" in out
    assert "--train.hub_model_id" not in out and "--data.qtype_weights" not in out
    assert f"vlmtrain {command} --help-all" in out and "docs/configuration.md" in out
    assert ("--nproc N" in out) == (command == "train")


def test_help_all_lists_every_key_with_its_documentation(capsys):
    for command in ("train", "eval"):
        out = _help(capsys, command, "--help-all")
        for section in ("model", "data", "train"):
            missing = [k for k in field_names(SECTIONS, section) if not re.search(rf"^  --{section}\.{k}\b", out, re.M)]
            assert not missing, (command, section, missing)
        assert "Common keys only" not in out and "--train.hub_model_id" in out


def test_predict_help_lists_its_options_and_both_forms(capsys):
    out = _help(capsys, "predict", "--help")
    assert len(out.splitlines()) < 80
    options = {line.split()[0]: line for line in out.splitlines() if line.startswith("  --")}
    assert {"--checkpoint", "--data", "--output", "--batch-size", "--num-workers", "--nproc"} <= set(options)
    assert "Samples in the training format" in options["--data"]
    assert "Path to a configuration file" not in out
    assert "--config FILE.yaml --checkpoint DIR" in out and "--help-all" in out
    full = _help(capsys, "predict", "--help-all")
    assert "--output" in full and "--train.hub_model_id" in full and "--train.learning_rate" in full
    assert not any(line.startswith("  --data ") and "configuration file" in line for line in full.splitlines())


def test_demo_help_gives_the_readmes_measured_time_and_resume(capsys):
    out = " ".join(_help(capsys, "demo", "--help").split())
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "333-342 s" in out and "333-342 s" in readme and "6-10 minutes" not in out
    assert "--resume" in out


@pytest.mark.parametrize("error, code", [(ConfigError("train.x: bad"), 2), (CheckpointError("no checkpoint-5"), 1),
                                         (DataError("9 of the last 10 training samples were bad"), 1)])
def test_an_error_the_user_can_act_on_is_one_line(tmp_path, monkeypatch, capsys, error, code):
    def fail(cfg):
        raise error

    monkeypatch.setattr(run, "train", fail)
    assert cli.main(["train", "--config", str(_write(tmp_path, LM))]) == code
    assert capsys.readouterr().err == f"error: {error}\n"


def test_an_unexpected_error_keeps_its_traceback(tmp_path, monkeypatch):
    def fail(cfg):
        raise RuntimeError("a bug")

    monkeypatch.setattr(run, "train", fail)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["train", "--config", str(_write(tmp_path, LM))])


def test_too_many_bad_samples_is_one_line_from_the_command(tmp_path):
    from tests.test_vlm_run import TINY

    good = {"texts": [{"user": "What color?", "assistant": "red"}], "images": []}
    lines = [json.dumps(good)] * 4 + [json.dumps({"texts": [], "images": []})] * 12
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    cfg = {**TINY, "data": {**TINY["data"], "source": "stream", "sources": [{"kind": "jsonl", "path": "bad.jsonl"}]},
           "train": {**TINY["train"], "max_steps": 4, "eval_strategy": "no", "save_strategy": "no"}}
    done = _vlmtrain("train", "--config", str(_write(tmp_path, cfg)), cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 8 of the last 8 training samples were bad") and "max_bad_sample_fraction" in last


@pytest.mark.slow
def test_an_error_in_the_ranks_of_nproc_is_one_line_and_the_cpu_is_named_once(tmp_path):
    """A ConfigError raised in both ranks (model.config is only checked when the model is built): one line, the
    ranks' exit code, no torchrun traceback or failure table; and the note that the 2 processes run on the CPU."""
    bad = {**LM, "model": {**LM["model"], "config": {**LM["model"]["config"], "model_type": "lama"}}}
    done = _vlmtrain("train", "--config", str(_write(tmp_path, bad)), "--nproc", "2", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert lines == ["note: no GPU found: --nproc 2 starts 2 processes on the CPU (torch.distributed's gloo "
                     f"backend), sharing its {os.cpu_count()} cores.",
                     "error: model.config.model_type='lama' is not a known transformers model type. Did you mean "
                     "'llama' or 'mllama' or 'llama4'?"], done.stderr[-3000:]


@pytest.mark.slow
def test_a_two_process_run_prints_no_future_warnings(tmp_path):
    done = _vlmtrain("train", "--config", str(_write(tmp_path, LM)), "--nproc", "2", "--train.output_dir",
                     str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("note: no GPU found: --nproc 2") == 1
    assert "Warning" not in done.stderr and "deprecated" not in done.stderr, done.stderr[-3000:]


def test_shutdown_reads_no_deprecated_torch_attribute():
    """shutdown() walks every live object for DeviceMeshes: isinstance() read torch.distributed.reduce_op's
    __class__, a FutureWarning per rank at each shutdown."""
    from vlmtrain.trainer import distributed

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distributed.shutdown(wait=False)
    assert not [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


def test_lora_on_a_transformers_model_prints_no_deprecation():
    from tests.tiny import tiny_llama
    from vlmtrain.models.hub.lora import apply_lora

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_lora(tiny_llama(), {"r": 2, "target_modules": ["q_proj"]}, "model")
    assert not [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


def _sigterm_at(console, step: int):
    """The demo's console callback, sending SIGTERM at ``step`` as a scheduler would."""
    own = console.on_step_end

    def on_step_end(args, state, control, **kwargs):
        if state.global_step == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return own(args, state, control, **kwargs)

    console.on_step_end = on_step_end
    return console


def test_a_stopped_demo_names_the_demo_command_that_continues_it(tmp_path, monkeypatch, caplog, capsys):
    config, out = _write(tmp_path, LM, "demo.yaml"), tmp_path / "demo run"
    console = run.demo_console
    monkeypatch.setattr(run, "demo_console", lambda cfg: _sigterm_at(console(cfg), 2))
    with caplog.at_level(logging.WARNING, logger="vlmtrain.run"):
        metrics = run.demo(config=str(config), output_dir=str(out))
    assert metrics["preempted"] and metrics["global_step"] == 2
    (said,) = [r.getMessage() for r in caplog.records if "preempted" in r.getMessage()]
    command = said.split("`")[1]
    assert command == f"vlmtrain demo --config {config} --output-dir '{out}' --resume"
    monkeypatch.setattr(run, "demo_console", console)
    assert cli.main(shlex.split(command)[1:]) == 0  # the command it names works, and continues the run
    assert "4 steps" in capsys.readouterr().out
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]


@pytest.mark.parametrize("command, setting", [("train", "--train.output_dir"), ("eval", "--train.output_dir"),
                                              ("export", "--output-dir"), ("export --merge", "--output-dir"),
                                              ("predict", "--output")])
def test_an_unwritable_output_dir_is_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys, command, setting):
    """A directory under a file cannot be made (also as root, where permissions do not stop a write)."""
    from vlmtrain import inference
    from vlmtrain.models.files import export
    from vlmtrain.models.hub import lora

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the output directory was checked")

    for module, name in ((run, "build"), (export, "export_checkpoint"), (lora, "export_merged"),
                         (inference, "load_for_inference")):
        monkeypatch.setattr(module, name, loaded)
    (tmp_path / "a_file").write_text("")
    bad = str(tmp_path / "a_file" / "out")
    if command.startswith("export"):
        ckpt = tmp_path / "checkpoint-2"
        ckpt.mkdir()
        (ckpt / "model.safetensors").write_text("")
        argv = [*command.split(), "--checkpoint", str(ckpt), "--output-dir", bad]
    elif command == "predict":  # (predict --data: the rows are written after every sample is scored)
        (tmp_path / "new.jsonl").write_text(json.dumps({"texts": [{"user": "hi"}]}) + "\n")
        argv = [command, "--checkpoint", str(tmp_path), "--data", str(tmp_path / "new.jsonl"),
                "--output", os.path.join(bad, "rows.jsonl")]
    else:
        argv = [command, "--config", str(_write(tmp_path, LM)), "--train.output_dir", bad]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {setting} {bad!r} is not writable"), err


_IMPORTED = ("import sys; from vlmtrain.cli import main; code = main(sys.argv[1:]); "
             "print([m for m in ('torch', 'transformers', 'peft') if m in sys.modules], code)")


@pytest.mark.parametrize("argv, code", [
    (["--help"], 0), (["trian"], 2), (["train", "my.yaml"], 2), (["train", "--help"], 0), (["eval", "--help-all"], 0),
    (["train", "--config", "cfg.yaml", "--train.max_stepz", "3"], 2), (["train", "--config", "cfg.yaml", "--trian.x", "1"], 2),
])
def test_help_and_a_mistyped_command_or_key_answer_before_torch_and_transformers_load(tmp_path, argv, code):
    """What a newcomer types first answers without importing torch, transformers or peft (which took 7-15 s
    before anything was printed): --help (the config keys' too) and a mistyped command or key."""
    _write(tmp_path, LM)
    out = subprocess.run([sys.executable, "-c", _IMPORTED, *argv], env=ENV, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.splitlines()[-1] == f"[] {code}", (out.stdout, out.stderr)
    assert code == 0 or out.stderr.count("error:") == 1, out.stderr


def test_a_positional_config_file_suggests_config(capsys):
    assert cli.main(["train", "my.yaml", "--train.max_steps", "3"]) == 2
    assert capsys.readouterr().err.strip() == ("error: vlmtrain train takes no positional argument 'my.yaml': pass "
                                               "the config file as --config my.yaml.")


def test_help_group_headings_are_whole_sentences_and_name_the_installed_transformers(capsys):
    """Each config section's heading in --help is its class docstring's whole first line (a sentence, not cut
    where the docstring wraps); a transformers version named in --help-all or TrainingArguments' docstring is
    the installed one."""
    import transformers

    import vlmtrain

    out = _help(capsys, "train", "--help-all")
    headings = [line[:-1] for line in out.splitlines() if line.endswith(":") and not line.startswith(" ")]
    for section, cls in SECTIONS.items():
        first = cls.__doc__.strip().splitlines()[0]
        assert first.endswith("."), (section, first)
        assert first[:-1] in headings, (section, first, headings)
    installed = ".".join(transformers.__version__.split(".")[:2])
    for text in (out, vlmtrain.TrainingArguments.__doc__):
        assert set(re.findall(r"transformers (\d+\.\d+)", text)) <= {installed}


def test_a_non_positive_max_steps_trains_epochs_and_the_final_evaluation_is_announced(tmp_path, caplog, capsys):
    """`--train.max_steps -5` trains num_train_epochs epochs as transformers does (any max_steps <= 0), named once;
    with eval_strategy no, the evaluation vlmtrain train makes after training is announced in the log."""
    train = {**LM["train"], "eval_strategy": "no", "save_strategy": "no", "num_train_epochs": 0.25,
             "predict_with_generate": False}
    path = _write(tmp_path, {**LM, "train": {**train, "output_dir": str(tmp_path / "run")}})
    with caplog.at_level(logging.WARNING, logger="vlmtrain.run"):
        assert cli.main(["train", "--config", str(path), "--train.max_steps", "-5"]) == 0
    out = "\n" + capsys.readouterr().out
    result = json.loads(out[out.rfind("\n{\n"):])  # the printed result, after the log lines
    assert result["global_step"] == 4 and "eval_loss" in result  # 64 samples / 4 per step x 0.25 epochs
    lines = [r.getMessage() for r in caplog.records if r.name == "vlmtrain.run"]
    assert lines == ["train.max_steps=-5 is not positive: training for train.num_train_epochs=0.25 epochs, as "
                     "transformers does for any max_steps <= 0 (its default is -1).",
                     "train.eval_strategy is 'no': evaluating the trained model once on the eval set, as vlmtrain "
                     "train does after training (data.num_eval: 0, or no eval data, skips it)."], lines


def test_the_package_names_are_the_ones_it_imports_lazily():
    """vlmtrain/__init__ lists each public name three times (imported on first use, for type checkers and the API
    reference, and in __all__): the lists agree, and each name resolves."""
    import vlmtrain

    assert set(vlmtrain._EXPORTS) | {"__version__"} == set(vlmtrain.__all__)
    assert all(getattr(vlmtrain, name) is not None for name in vlmtrain.__all__)
