"""Paths a newcomer types: a run trained with a relative `model.pretrained` (and relative data paths) is
predicted, exported and loaded from another working directory; a missing base model, data file or model
directory is one line naming the setting and the path (exit 2), not transformers' `Repo id must be ...`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import yaml
from optional_extras import requires
from PIL import Image

import vlmtrain
from vlmtrain import cli
from vlmtrain.errors import ConfigError
from vlmtrain.models.families import get_family

pytestmark = [requires("peft", "lora"), pytest.mark.usefixtures("one_thread")]

COLORS = [(220, 40, 40), (40, 160, 40), (40, 40, 220)]


def _write_data(folder, n: int = 6) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        Image.new("RGB", (32, 32), COLORS[i % 3]).save(folder / f"{i}.png")
        rows.append({"images": [f"{i}.png"], "texts": [{"user": f"Which colour? ({i})"}], "labels": {"color": i % 3}})
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def relative_run(tmp_path_factory):
    """A LoRA + head run trained from `root` with relative paths only (runs/tiny-qwen3vl, data/train.jsonl,
    runs/lora): returns root."""
    root = tmp_path_factory.mktemp("paths") / "project"
    get_family("qwen3_vl").build_tiny(str(root / "runs" / "tiny-qwen3vl"))
    _write_data(root / "data")
    cfg = {"model": {"kind": "hub_vlm", "pretrained": "runs/tiny-qwen3vl", "lora": {"r": 4},
                     "heads": {"color": {"type": "classification", "num_outputs": 3}}},
           "data": {"source": "jsonl", "train_file": "data/train.jsonl", "max_length": 64},
           "train": {"output_dir": "runs/lora", "max_steps": 1, "per_device_train_batch_size": 3, "save_steps": 1,
                     "disable_tqdm": True, "eval_strategy": "no", "report_to": "none"}}
    (root / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    here = os.getcwd()
    os.chdir(root)
    try:
        assert cli.main(["train", "--config", "cfg.yaml"]) == 0
    finally:
        os.chdir(here)
    return root


def test_adapter_records_the_base_model_absolute(relative_run):
    adapter = json.loads((relative_run / "runs" / "lora" / "checkpoint-1" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(relative_run / "runs" / "tiny-qwen3vl")


def _run_elsewhere(cwd, code: str) -> subprocess.CompletedProcess:
    os.makedirs(cwd, exist_ok=True)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})


def test_predict_export_and_load_from_another_directory(relative_run, tmp_path):
    """`vlmtrain predict`, `vlmtrain export --merge` and load_for_inference, run from a directory that is not
    the one the run was trained in, give the scores of the run's own directory."""
    run_dir = relative_run / "runs" / "lora"
    data = relative_run / "data" / "train.jsonl"
    samples = [{"images": [str(relative_run / "data" / f"{i}.png")], "texts": [{"user": "Which colour?"}]}
               for i in range(3)]
    here = os.getcwd()
    os.chdir(relative_run)
    try:
        expected = vlmtrain.load_for_inference("runs/lora").score(samples)
    finally:
        os.chdir(here)
    code = f"""
        import json, sys
        import vlmtrain
        from vlmtrain import cli
        assert cli.main(["predict", "--checkpoint", {str(run_dir)!r}, "--data", {str(data)!r},
                         "--output", "pred.jsonl"]) == 0
        assert cli.main(["export", "--checkpoint", {str(run_dir)!r}, "--merge", "--output-dir", "merged"]) == 0
        rows = {{"adapter": vlmtrain.load_for_inference({str(run_dir)!r}).score({samples!r}),
                 "merged": vlmtrain.load_for_inference("merged").score({samples!r}),
                 "predicted": len(open("pred.jsonl").read().splitlines())}}
        print("ROWS=" + json.dumps(rows))
    """
    res = _run_elsewhere(tmp_path / "elsewhere", code)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout.split("ROWS=")[1])
    assert rows["predicted"] == 6
    for name in ("adapter", "merged"):
        for got, want in zip(rows[name], expected, strict=True):
            assert got["color"] == want["color"]
            assert got["color_probs"] == pytest.approx(want["color_probs"], abs=1e-5)


def _with_base(relative_run, tmp_path, base: str):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(relative_run / "runs" / "lora" / "checkpoint-1", ckpt)
    path = ckpt / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "base_model_name_or_path": base}))
    return ckpt


def _predict_and_export_errors(relative_run, ckpt, capsys):
    """`vlmtrain predict` and `vlmtrain export --merge` of ``ckpt``: each exits 2 with one stderr line, yielded."""
    data = str(relative_run / "data" / "train.jsonl")
    for argv in (["predict", "--checkpoint", str(ckpt), "--data", data, "--output", "p.jsonl"],
                 ["export", "--checkpoint", str(ckpt), "--merge", "--output-dir", "merged"]):
        capsys.readouterr()
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        yield err


def test_missing_base_model_is_one_line_naming_the_setting(relative_run, tmp_path, monkeypatch, capsys):
    """A base directory that is gone (here: the relative path a checkpoint of an older vlmtrain recorded, read
    from another directory) is exit 2 and one line naming adapter_config.json, the setting and the path."""
    ckpt = _with_base(relative_run, tmp_path, "../vlmtrain/runs/tiny-qwen3vl")
    monkeypatch.chdir(tmp_path)
    for err in _predict_and_export_errors(relative_run, ckpt, capsys):
        assert err.startswith(f"error: {ckpt / 'adapter_config.json'}: base_model_name_or_path "
                              f"'../vlmtrain/runs/tiny-qwen3vl' names no directory"), err
        assert str(tmp_path.parent / "vlmtrain" / "runs" / "tiny-qwen3vl") in err
    with pytest.raises(ConfigError, match="set base_model_name_or_path in .*adapter_config.json"):
        vlmtrain.load_for_inference(str(ckpt))


def test_bare_relative_base_that_is_no_hub_model_names_the_setting(relative_run, tmp_path, monkeypatch, capsys):
    """A bare relative name (`tiny-qwen3vl`, what an older checkpoint recorded for `pretrained: tiny-qwen3vl`)
    could be a Hub id: when the Hub has nothing either, the same one line, naming the setting."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    ckpt = _with_base(relative_run, tmp_path, "tiny-qwen3vl")
    monkeypatch.chdir(tmp_path)
    for err in _predict_and_export_errors(relative_run, ckpt, capsys):
        assert err.startswith(f"error: {ckpt / 'adapter_config.json'}: base_model_name_or_path 'tiny-qwen3vl' is "
                              f"no directory here or beside the checkpoint, and transformers could not load it"), err
        assert err.endswith("Set base_model_name_or_path in "
                            f"{ckpt / 'adapter_config.json'} to the base model's directory or Hub id."), err


def test_relative_base_is_also_found_beside_the_checkpoint(relative_run, tmp_path, monkeypatch):
    """A relative base_model_name_or_path that is no directory from the working directory is read relative to
    the checkpoint (a run directory moved together with its base model)."""
    base = os.path.relpath(relative_run / "runs" / "tiny-qwen3vl", tmp_path / "ckpt")
    ckpt = _with_base(relative_run, tmp_path, base)
    monkeypatch.chdir(tmp_path)
    assert not os.path.isdir(base)
    model = vlmtrain.load_for_inference(str(ckpt))
    assert model.score([{"images": [str(relative_run / "data" / "0.png")], "texts": [{"user": "Which?"}]}])


@pytest.mark.parametrize("key, value, message", [
    ("data.train_file", "data/nope.jsonl", "error: data.train_file: 'data/nope.jsonl' does not exist ({root}/data/nope.jsonl)."),
    ("data.eval_file", "data/typo.jsonl", "error: data.eval_file: 'data/typo.jsonl' does not exist ({root}/data/typo.jsonl)."),
    ("model.pretrained", "runs/tiny-qwen3-vl", "error: model.pretrained: 'runs/tiny-qwen3-vl' does not exist ({root}/runs/tiny-qwen3-vl). Expected a directory"),
    ("model.pretrained", "../models/tiny", "error: model.pretrained: '../models/tiny' does not exist ({parent}/models/tiny)."),
])
def test_missing_paths_are_one_line_naming_the_key(relative_run, monkeypatch, capsys, key, value, message):
    """A data file or a local model directory that does not exist stops `vlmtrain train` before any weights load:
    exit 2, one line naming the config key and the path (a Hub id such as Qwen/Qwen3-VL-8B-Instruct is not a
    path: it goes to the Hub)."""
    monkeypatch.chdir(relative_run)
    assert cli.main(["train", "--config", "cfg.yaml", f"--{key}", value, "--train.output_dir", "runs/never"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(message.format(root=relative_run, parent=relative_run.parent)), err
    assert not (relative_run / "runs" / "never").exists()


def test_hub_id_that_cannot_be_loaded_names_the_key(relative_run, monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(relative_run)
    assert cli.main(["train", "--config", "cfg.yaml", "--model.pretrained", "nobody/tiny-vlm"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model.pretrained: 'nobody/tiny-vlm' is no local directory and transformers "
                          "could not load it as a Hub id"), err


@pytest.mark.parametrize("value, is_path", [
    ("Qwen/Qwen3-VL-8B-Instruct", False), ("gpt2", False), ("nobody/tiny-vlm", False),
    ("runs/tiny-qwen3-vl", True),  # runs/ exists here: a typo of a local directory, not a Hub id
    ("./tiny", True), ("../models/tiny", True), ("/abs/model", True), ("~/model", True), ("a/b/c", True),
    ("bad..name", True), ("cfg.yaml", True),  # a name the Hub refuses; a file
])
def test_what_looks_like_a_path(relative_run, monkeypatch, value, is_path):
    from vlmtrain.models.hub.local_paths import looks_like_path

    monkeypatch.chdir(relative_run)
    assert looks_like_path(value) is is_path
