"""Config system and CLI: unknown keys and wrong types fail early with helpful messages; overrides win."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vlmtrain import cli
from vlmtrain.config import (
    ConfigError,
    RunConfig,
    load_run_config,
    parse_run_config,
    run_config_to_dict,
    save_run_config,
)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))
TINY = {
    "model": {"kind": "causal_lm", "config": {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1}},
    "data": {"source": "addition", "num_train": 64, "num_eval": 8},
    "train": {"max_steps": 5, "learning_rate": 1e-3, "output_dir": "runs/tiny", "report_to": "none"},
}


def write(tmp_path: Path, doc: object, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return str(path)


def edited(section: str, **values: object) -> dict:
    doc = {k: dict(v) for k, v in TINY.items()}
    doc[section].update(values)
    return doc


@pytest.mark.parametrize("section,key,suggestion", [
    ("train", "learning_rat", "train.learning_rate"),
    ("train", "per_device_batch_size", "train.per_device_train_batch_size"),
    ("model", "pretrain", "model.pretrained"),
    ("data", "num_digit", "data.num_digits"),
])
def test_unknown_key_in_yaml_names_key_and_nearest(tmp_path, section, key, suggestion):
    path = write(tmp_path, edited(section, **{key: 1}))
    with pytest.raises(ConfigError) as e:
        load_run_config(path)
    assert f"'{section}.{key}'" in str(e.value) and f"'{suggestion}'" in str(e.value)
    assert "run.yaml" in str(e.value)


def test_unknown_section_in_yaml(tmp_path):
    path = write(tmp_path, {**TINY, "trian": {"max_steps": 3}})
    with pytest.raises(ConfigError, match=r"unknown section 'trian'.*Did you mean 'train'"):
        load_run_config(path)


def test_unknown_key_without_near_match_lists_valid_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"'data.xyzzy'.*Valid keys in 'data': source, num_train"):
        load_run_config(write(tmp_path, edited("data", xyzzy=1)))


@pytest.mark.parametrize("argv,match", [
    (["--train.learning_rat", "3e-4"], r"unknown key 'train.learning_rat'.*'train.learning_rate'"),
    (["--data.num_trian=5"], r"unknown key 'data.num_trian'.*'data.num_train'"),
    (["--trian.max_steps", "3"], r"unknown section 'trian'.*'train'"),
    (["--confg", "x.yaml"], r"unknown option '--confg'.*--config"),
])
def test_unknown_key_on_command_line(tmp_path, argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_run_config(["--config", write(tmp_path, TINY), *argv])


@pytest.mark.parametrize("section,key,value,expected", [
    ("train", "max_steps", "abc", "int"),
    ("train", "eval_steps", "abc", "float | None"),  # (transformers' type: a float below 1 is a ratio)
    ("train", "max_steps", None, "int"),
    ("train", "bf16", "maybe", "bool"),
    ("data", "num_train", 2.5, "int"),
    ("model", "kind", "vit", "one of 'causal_lm', 'vlm', 'hub_vlm'"),
    ("model", "config", 5, "dict[str, Any]"),
])
def test_wrong_type_in_yaml_names_key_and_type(tmp_path, section, key, value, expected):
    with pytest.raises(ConfigError) as e:
        load_run_config(write(tmp_path, edited(section, **{key: value})))
    assert str(e.value).startswith(f"{section}.{key}: expected {expected}, got ")
    assert "quote it" not in str(e.value)  # that hint is only for string-typed keys


def test_wrong_type_on_command_line_and_in_overrides(tmp_path):
    path = write(tmp_path, TINY)
    with pytest.raises(ConfigError, match=r"^train.max_steps: expected int, got abc"):
        parse_run_config(["--config", path, "--train.max_steps", "abc"])
    with pytest.raises(ConfigError, match=r"^train.learning_rate: expected float"):
        load_run_config(path, {"train.learning_rate": "fast"})


def test_bool_for_string_key_hints_at_quoting(tmp_path):
    with pytest.raises(ConfigError, match=r"resume_from_checkpoint: expected str \| None, got true.*quote"):
        load_run_config(write(tmp_path, edited("train", resume_from_checkpoint=True)))


def test_section_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="section 'model'.*must be a mapping"):
        load_run_config(write(tmp_path, {**TINY, "model": 5}))
    with pytest.raises(ConfigError, match="not found"):
        load_run_config(tmp_path / "missing.yaml")


def test_overrides_beat_yaml(tmp_path):
    path = write(tmp_path, TINY)
    cfg = parse_run_config(["--train.max_steps", "7", "--config", path, "--data.num_train", "100",
                            "--train.learning_rate", "3e-4", "--model.config.num_hidden_layers", "3"])
    assert (cfg.train.max_steps, cfg.data.num_train, cfg.train.learning_rate) == (7, 100, 3e-4)
    assert cfg.model.config == {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 3}
    assert cfg.train.output_dir == "runs/tiny"  # untouched keys keep the file's value
    cfg = load_run_config(path, {"train.max_steps": 9, "data": {"num_eval": 4}})
    assert (cfg.train.max_steps, cfg.data.num_eval, cfg.data.num_train) == (9, 4, 64)
    with pytest.raises(ConfigError, match=r"'train.max_step'.*'train.max_steps'"):
        load_run_config(path, {"train.max_step": 9})


def test_resolved_config_round_trips(tmp_path):
    cfg = parse_run_config(["--config", write(tmp_path, TINY), "--train.warmup_ratio", "0.1",
                            "--train.module_learning_rates", "{embed: 0.0, lm_head: 0.01}"])
    path = save_run_config(cfg, tmp_path / "out")
    assert path == str(tmp_path / "out" / "config.yaml")
    again = load_run_config(path)
    assert again == cfg and isinstance(again, RunConfig)
    assert run_config_to_dict(again)["train"]["module_learning_rates"] == {"embed": 0.0, "lm_head": 0.01}


def test_training_arguments_error_comes_through_unchanged(tmp_path):
    doc = edited("train", load_best_model_at_end=True)
    with pytest.raises(ConfigError) as e:
        load_run_config(write(tmp_path, doc))
    assert str(e.value) == "load_best_model_at_end=True needs eval_strategy 'steps' or 'epoch'."


def test_step_keyed_warmup_takes_workers_but_not_packing_windows(tmp_path):
    raw = yaml.safe_load((ROOT / "configs" / "shapes-tiny.yaml").read_text())
    assert raw["data"]["side_warmup_steps"] > 0
    raw["train"]["dataloader_num_workers"] = 2  # the sampler gives each sample its step: workers are fine
    assert load_run_config(write(tmp_path, raw)).train.dataloader_num_workers == 2
    raw["data"]["pack_window"] = 4
    with pytest.raises(ConfigError, match="side_warmup_steps needs data.pack_window: null"):
        load_run_config(write(tmp_path, raw))
    raw["data"]["side_warmup_steps"], raw["data"]["lookup_warmup_steps"] = 0, 10
    with pytest.raises(ConfigError, match="lookup_warmup_steps needs data.pack_window: null"):
        load_run_config(write(tmp_path, raw))
    raw["data"]["pack_window"], raw["data"]["side_fraction"] = None, 1.5
    with pytest.raises(ConfigError, match="side_fraction must be in"):
        load_run_config(write(tmp_path, raw))
    raw["data"]["side_fraction"], raw["data"]["lookup_warmup_steps"] = 0.25, -1
    with pytest.raises(ConfigError, match="lookup_warmup_steps must be >= 0"):
        load_run_config(write(tmp_path, raw))
    raw["data"]["lookup_warmup_steps"], raw["data"]["qtype_weights"] = 0, {"multi_count": 3}
    assert load_run_config(write(tmp_path, raw)).data.qtype_weights == {"multi_count": 3}
    raw["data"]["qtype_weights"] = {"multi_counts": 3}
    with pytest.raises(ConfigError, match="qtype_weights must map question types"):
        load_run_config(write(tmp_path, raw))


@pytest.mark.parametrize("path", SHIPPED or [None], ids=lambda p: p.name if p else "tiny-in-tmp")
def test_config_loads_and_round_trips(tmp_path, path):
    path = path or write(tmp_path, TINY)  # no shipped configs yet: still check a minimal one end to end
    cfg = load_run_config(path)
    assert load_run_config(save_run_config(cfg, tmp_path)) == cfg


def test_cli_bad_config_exits_2_before_any_work(tmp_path, monkeypatch, capsys):
    from vlmtrain import run

    def boom(*args, **kwargs):
        raise AssertionError("model/data must not be built for a bad config")

    monkeypatch.setattr(run, "build", boom)
    monkeypatch.setattr(run, "train", boom)
    rc = cli.main(["train", "--config", write(tmp_path, edited("train", learning_rat=1))])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: unknown key 'train.learning_rat'") and "Traceback" not in err
    assert cli.main(["train", "--config", write(tmp_path, TINY), "--train.max_steps", "x"]) == 2
    assert cli.main(["predict", "--config", write(tmp_path, TINY)]) == 2  # no --checkpoint
    assert cli.main(["trian"]) == 2
    assert "Did you mean 'train'" in capsys.readouterr().err


def test_cli_help_lists_keys_with_docstrings(capsys):
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--train.learning_rate" in out and "--data.num_digits" in out
    assert "Digits per operand" in out  # field docstrings become help text


def test_python_m_vlmtrain_bad_config(tmp_path):
    path = write(tmp_path, {**TINY, "train": {**TINY["train"], "max_steps": "abc"}}, "bad.yaml")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "vlmtrain", "train", "--config", path],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "error: train.max_steps: expected int, got abc."
    assert not (tmp_path / "runs").exists()  # nothing was written: it failed before any work


def test_unknown_model_type_fails_before_data_is_built(tmp_path, monkeypatch):
    from vlmtrain import run
    from vlmtrain.tasks import addition

    def never(*a, **k):
        raise AssertionError("data was built before the model config was checked")

    monkeypatch.setattr(addition, "build_addition", never)
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  config: {model_type: lama}\ntrain:\n  max_steps: 3\n")
    cfg = load_run_config(path)
    with pytest.raises(ConfigError, match="model_type='lama'.*'llama'"):
        run.build(cfg)
