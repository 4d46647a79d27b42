"""The README's Hub quickstart, offline: its build command makes the tiny model its config line names, and its
train / predict / export commands and its load_for_inference call run on it as printed (only the step count,
and so the checkpoint's name, is cut for time)."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from optional_extras import requires
from PIL import Image

import vlmtrain
from vlmtrain import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

pytestmark = [requires("peft", "lora"), pytest.mark.usefixtures("one_thread")]


def _block(language: str, containing: str) -> str:
    blocks = [b for b in re.findall(rf"```{language}\n(.*?)```", README, re.S) if containing in b]
    assert len(blocks) == 1, f"README: expected one {language} block with {containing!r}, found {len(blocks)}"
    return blocks[0]


def _commands(block: str) -> list[list[str]]:
    return [shlex.split(line.split("  #")[0]) for line in block.splitlines() if line.strip()]


def test_readme_offline_quickstart_runs_on_the_tiny_model(tmp_path, monkeypatch, capsys):
    config_text = _block("yaml", "# my.yaml")
    offline = re.search(r"pretrained: \S+ +# offline: (\S+)", config_text)
    assert offline, "the README's config names no offline model.pretrained beside the Hub id"
    commands = _commands(_block("bash", "vlmtrain train --config my.yaml"))
    build = commands[0]
    assert build[:3] == ["python", "scripts/build_tiny_hub.py", "qwen3_vl"] and build[3] == offline.group(1)
    assert [c[:2] for c in commands[1:]] == [["vlmtrain", "train"], ["vlmtrain", "predict"], ["vlmtrain", "export"]]

    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("build_tiny_hub", ROOT / build[1])
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(build[2:]) == 0

    cfg = yaml.safe_load(config_text)
    cfg["model"]["pretrained"] = offline.group(1)  # the offline value of the config line
    (tmp_path / "my.yaml").write_text(yaml.safe_dump(cfg))
    sample = json.loads(_block("json", '"labels"'))
    train, predict, export = (c[1:] for c in commands[1:])
    for path in (tmp_path / cfg["data"]["train_file"], tmp_path / cfg["data"]["eval_file"],
                 tmp_path / predict[predict.index("--data") + 1]):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({**sample, "id": f"s{i}", "labels": {"score": float(i), "type": i % 4}})
                                + "\n" for i in range(4)))
    images = sample["images"] + ["a.jpg", "b.jpg"]
    for i, name in enumerate(images):
        for folder in (tmp_path, tmp_path / "data"):  # (JSONL image paths are relative to their file)
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (48, 40), (60 * i, 90, 200 - 40 * i)).save(folder / name)

    steps = cfg["train"]["max_steps"]
    assert cli.main([*train, "--train.max_steps", "1", "--train.save_steps", "1", "--train.eval_strategy", "no",
                     "--train.per_device_train_batch_size", "2"]) == 0
    for argv in (predict, export):
        argv = [a.replace(f"checkpoint-{steps}", "checkpoint-1") for a in argv]
        assert cli.main(argv) == 0
    rows = [json.loads(line) for line in Path(predict[predict.index("--output") + 1]).read_text().splitlines()]
    assert [r["id"] for r in rows] == ["s0", "s1", "s2", "s3"] and all("score" in r and "type" in r for r in rows)

    from transformers import AutoModelForImageTextToText

    out = export[export.index("--output-dir") + 1]
    scorer = vlmtrain.attach_heads(AutoModelForImageTextToText.from_pretrained(out), out)
    assert set(scorer.head_configs) == {"score", "type"}
    python = _block("python", "vlmtrain.load_for_inference")
    calls = re.findall(r"^m = (vlmtrain\.load_for_inference\(.*?\))", python, re.M)
    score = re.search(r"^(m\.score\(.*\))$", python, re.M)
    m = eval(calls[0], {"vlmtrain": vlmtrain})  # noqa: S307 - the README's own line
    scored = eval(score.group(1), {"m": m})  # noqa: S307
    assert len(scored) == 1 and set(scored[0]) >= {"score", "type", "type_probs"}
