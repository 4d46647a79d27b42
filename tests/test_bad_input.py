"""Bad input through the commands a user runs: malformed JSONL lines are skipped and counted, samples without an id
are named file:line, empty data files are one-line errors naming the setting and the path, and `vlmtrain data
inspect` names each problem by file:line with the checks training makes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml
from PIL import Image

from tests.test_vlm_run import _config
from vlmtrain import cli, run
from vlmtrain.data.cauldron import write_cauldron_jsonl
from vlmtrain.models.families import get_family
from vlmtrain.tasks.shapes import ShapesVQA


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    return get_family("qwen3_vl").build_tiny(str(tmp_path_factory.mktemp("qwen3_vl")))


def _shapes_jsonl(tmp_path: Path, n: int = 16, malformed_at: int | None = None) -> Path:
    path = Path(write_cauldron_jsonl(ShapesVQA("train", n, seed=1), str(tmp_path / "data"), name="train"))
    if malformed_at is not None:
        lines = path.read_text().splitlines()
        lines.insert(malformed_at - 1, '{"texts": [oops')
        path.write_text("\n".join(lines) + "\n")
    return path


def _yaml(tmp_path: Path, data: dict) -> str:
    """The tiny own-VLM config (tests/test_vlm_run.py) with ``data`` as a YAML file, for the CLI."""
    cfg = _config(tmp_path)
    text = yaml.safe_load((tmp_path / "cfg.yaml").read_text())
    text["data"] = data
    text["train"].update(max_steps=2, eval_strategy="no", save_strategy="no", predict_with_generate=False,
                         output_dir=cfg.train.output_dir)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(text))
    return str(path)


def test_a_malformed_json_line_is_skipped_and_counted_by_the_own_vlm(tmp_path):
    path = _shapes_jsonl(tmp_path, malformed_at=4)
    cfg = _config(tmp_path, data={"source": "jsonl", "train_file": str(path), "eval_file": str(path)},
                  train={"max_steps": 3, "eval_steps": 3, "save_strategy": "no"})
    out = run.build(cfg).train()  # 17 lines, batch 8: the third step starts the next epoch
    assert out.global_step == 3
    assert out.metrics["train_skipped_malformed_json"] == 1
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(row.get("skipped_malformed_json", 0) for row in logged) == 1
    assert next(row for row in logged if "eval_loss" in row)["eval_skipped_malformed_json"] == 1


def test_malformed_lines_count_toward_the_bad_sample_limit(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text("".join("{not json\n" for _ in range(8)))
    cfg = _config(tmp_path, data={"source": "jsonl", "train_file": str(path)},
                  train={"max_steps": 1, "eval_strategy": "no", "save_strategy": "no",
                         "predict_with_generate": False, "per_device_train_batch_size": 4})
    with pytest.raises(RuntimeError, match=r"malformed_json.*Examples: \S*broken\.jsonl:\d+ \(malformed_json\)"):
        run.build(cfg).train()


def test_samples_without_id_are_named_file_and_line(tmp_path, caplog):
    path = _shapes_jsonl(tmp_path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        row.pop("id", None)
        row["images"] = ["nowhere.png"]
    noid = tmp_path / "data" / "noid.jsonl"
    noid.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _config(tmp_path, data={"source": "jsonl", "train_file": str(noid)},
                  train={"max_steps": 1, "eval_strategy": "no", "save_strategy": "no",
                         "predict_with_generate": False})
    with caplog.at_level(logging.WARNING, logger="vlmtrain.data.processing"), \
            pytest.raises(RuntimeError, match=r"Examples: \S*noid\.jsonl:\d+ \(missing_image\)") as err:
        run.build(cfg).train()
    assert "?" not in str(err.value).split("Examples:")[1]
    assert any("noid.jsonl:" in r.getMessage() and "missing_image" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("key", ["train_file", "eval_file"])
def test_an_empty_data_file_is_a_one_line_error_naming_the_setting(tmp_path, capsys, key):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")  # blank lines hold no sample either
    data = {"source": "jsonl", "train_file": str(_shapes_jsonl(tmp_path)), key: str(empty)}
    command = "eval" if key == "eval_file" else "train"
    assert cli.main([command, "--config", _yaml(tmp_path, data)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    assert f"data.{key}" in err and str(empty) in err and "no samples" in err


def _hub_jsonl(tmp_path: Path) -> Path:
    rows = []
    for i in range(8):
        Image.new("RGB", (32, 32), (40 * i, 100, 200)).save(tmp_path / f"{i}.png")
        rows.append(json.dumps({"images": [f"{i}.png"], "texts": [{"user": "Which colour?", "assistant": "red"}],
                                "labels": {"color": i % 3}}))
    rows.insert(2, "{oops")
    path = tmp_path / "hub.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_hub_vlm_skips_malformed_lines_and_predict_refuses_an_empty_file(tiny_qwen, tmp_path, capsys, one_thread):
    data = _hub_jsonl(tmp_path)
    cfg = {"model": {"kind": "hub_vlm", "pretrained": tiny_qwen,
                     "heads": {"color": {"type": "classification", "num_outputs": 3}}},
           "data": {"source": "jsonl", "train_file": str(data), "max_length": 64},
           "train": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "per_device_train_batch_size": 4,
                     "logging_steps": 1, "save_steps": 2, "disable_tqdm": True}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["train", "--config", str(tmp_path / "cfg.yaml")]) == 0
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(row.get("skipped_malformed_json", 0) for row in logged) == 1
    capsys.readouterr()
    new = tmp_path / "new_data.jsonl"  # the malformed line and a sample past data.max_length (64 tokens)
    long = {"images": ["0.png"], "texts": [{"user": "Which colour? " * 40, "assistant": "red"}]}
    new.write_text(data.read_text() + json.dumps(long) + "\n")
    with pytest.warns(UserWarning) as caught:
        assert cli.main(["predict", "--checkpoint", str(tmp_path / "run" / "checkpoint-2"), "--data", str(new),
                         "--output", str(tmp_path / "scored.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "scored.jsonl").read_text().splitlines()]
    assert [r.get("skipped") for r in rows] == [None] * 2 + ["malformed_json"] + [None] * 6 + ["too_long"]
    [said] = [w for w in caught if "skipped" in str(w.message)]
    assert str(said.message) == \
        "2 of 10 samples were skipped (rows with 'skipped'): {'malformed_json': 1, 'too_long': 1}"
    assert said.filename == __file__  # the warning points at the call, not at vlmtrain's code
    capsys.readouterr()
    empty = tmp_path / "new.jsonl"
    empty.write_text("")
    out = tmp_path / "predictions.jsonl"
    code = cli.main(["predict", "--checkpoint", str(tmp_path / "run" / "checkpoint-2"), "--data", str(empty),
                     "--output", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err
    assert str(empty) in err and "no samples" in err
    assert not out.exists()


def _inspect_file(tmp_path: Path) -> Path:
    Image.new("RGB", (16, 16), "red").save(tmp_path / "a.png")
    turn = {"user": "q", "assistant": "a"}
    lines = [json.dumps({"id": "fine", "images": ["a.png"], "texts": [turn]}),
             "{oops",
             json.dumps({"images": ["a.png"], "texts": [{"user": "<image> vs <image>?", "assistant": "a"}]}),
             json.dumps({"images": ["a.png"], "texts": [turn], "labels": [1, 2]}),
             "",
             json.dumps({"images": ["gone.png"], "texts": [turn]}),
             json.dumps({"images": ["a.png"], "texts": [turn], "labels": {"color": 7}})]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_data_inspect_names_problems_by_file_and_line_with_trainings_checks(tmp_path, capsys):
    path = _inspect_file(tmp_path)
    assert cli.main(["data", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "6 samples in 1 shard(s)" in out
    for line, reason in ((2, "malformed_json"), (3, "placeholder_mismatch"), (4, "bad_head_label"),
                         (6, "missing_image")):
        assert f"d.jsonl:{line} ({reason}" in out, (line, reason, out)
    assert "d.jsonl:1 " not in out and "d.jsonl:7 " not in out  # without the heads' definitions a label is fine


def test_data_inspect_with_a_config_checks_its_heads_labels(tiny_qwen, tmp_path, capsys):
    path = _inspect_file(tmp_path)
    cfg = {"model": {"kind": "hub_vlm", "pretrained": tiny_qwen,
                     "heads": {"color": {"type": "classification", "num_outputs": 3}}},
           "data": {"source": "jsonl", "train_file": str(path)}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["data", "inspect", str(path), "--config", str(tmp_path / "cfg.yaml")]) == 0
    out = capsys.readouterr().out
    assert "d.jsonl:7 (bad_head_label" in out and "labels.color=7" in out


def test_data_inspect_with_an_own_vlm_config_checks_as_its_processor_does(tmp_path, capsys):
    """The own VLM trains an answer in every turn: a score-only sample (fine for a Hub VLM with heads) is
    malformed for it, and inspect --config says so where the default (Hub) checks do not."""
    path = _shapes_jsonl(tmp_path, n=3)
    rows = path.read_text().splitlines()
    score_only = json.loads(rows[1])
    score_only["texts"] = [{"user": "How many shapes?"}]
    rows[1] = json.dumps(score_only)
    path.write_text("\n".join(rows) + "\n")
    assert cli.main(["data", "inspect", str(path)]) == 0
    assert "bad samples: none" in capsys.readouterr().out
    config = _yaml(tmp_path, {"source": "jsonl", "train_file": str(path)})
    assert cli.main(["data", "inspect", str(path), "--config", config]) == 0
    assert "train.jsonl:2 (malformed_text" in capsys.readouterr().out


def test_an_empty_jsonl_file_in_a_stream_is_a_source_without_data(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    config = _yaml(tmp_path, {"source": "stream", "sources": [{"kind": "jsonl", "path": str(empty)}]})
    assert cli.main(["train", "--config", config]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"data.sources[0] (jsonl {empty}): ValueError: it has no data" in err


def test_data_inspect_model_overrides_the_configs_pretrained(tiny_qwen, tmp_path, capsys):
    """--model replaces the config's model.pretrained (here one that is not on this machine) for the checks too;
    without --model that pretrained is a one-line error naming it, not a traceback."""
    path = _inspect_file(tmp_path)
    missing = str(tmp_path / "not-here")
    cfg = {"model": {"kind": "hub_vlm", "pretrained": missing,
                     "heads": {"color": {"type": "classification", "num_outputs": 3}}},
           "data": {"source": "jsonl", "train_file": str(path)}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    config = str(tmp_path / "cfg.yaml")
    assert cli.main(["data", "inspect", str(path), "--config", config, "--model", tiny_qwen]) == 0
    assert "d.jsonl:7 (bad_head_label" in capsys.readouterr().out  # the config's heads, --model's family
    assert cli.main(["data", "inspect", str(path), "--config", config]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"model.pretrained: {missing!r} is no local directory" in err
    assert len(err.strip().splitlines()) == 1, err


def test_data_inspect_with_a_hub_config_applies_trainings_length_check(tiny_qwen, tmp_path, capsys):
    """A sample training skips as too_long (its tokens, counted by the model's processor) is a bad sample in
    `data inspect --config` too, named by its line; one that fits is not."""
    path = tmp_path / "d.jsonl"
    rows = [{"texts": [{"user": "Hi", "assistant": "Hello."}]},
            {"texts": [{"user": "Read this: " + "lorem ipsum " * 20, "assistant": "Done."}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"model": {"kind": "hub_vlm", "pretrained": tiny_qwen},
           "data": {"source": "jsonl", "train_file": str(path), "max_length": 128}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["data", "inspect", str(path), "--config", str(tmp_path / "cfg.yaml")]) == 0
    out = capsys.readouterr().out
    assert "bad samples: {'too_long': 1}" in out and "d.jsonl:2 (too_long: " in out and "d.jsonl:1 " not in out


def test_skips_count_every_read_and_the_distinct_bad_samples_once(tmp_path, caplog):
    """3 malformed lines read in each of 2 epochs: 6 skips, 3 bad samples; the warning says both, points at the
    line that called train(), and the parser's position of a malformed line is in its reason."""
    path = _shapes_jsonl(tmp_path)
    lines = path.read_text().splitlines()
    for at in (3, 9, 15):
        lines.insert(at, '{"texts": [oops')
    path.write_text("\n".join(lines) + "\n")
    cfg = _config(tmp_path, data={"source": "jsonl", "train_file": str(path)},
                  train={"max_steps": -1, "num_train_epochs": 2, "eval_strategy": "no", "save_strategy": "epoch",
                         "predict_with_generate": False, "max_bad_sample_fraction": 1.0})
    trainer = run.build(cfg)
    with caplog.at_level(logging.WARNING, logger="vlmtrain.data.processing"), \
            pytest.warns(UserWarning, match="skipped") as caught:
        out = trainer.train()
    assert out.metrics["train_skipped_malformed_json"] == 6 and out.metrics["train_bad_samples"] == 3
    [said] = [w for w in caught if "skipped" in str(w.message)]
    assert str(said.message) == ("6 training samples were skipped: {'malformed_json': 6} (3 distinct bad samples: "
                                 "one is skipped at every read, e.g. each epoch)")
    assert said.filename == __file__
    [logged] = [r.getMessage() for r in caplog.records if "skipping bad sample" in r.getMessage()]
    assert "(malformed_json: Expecting value: line 1 column 12 (char 11))" in logged, logged
    with pytest.warns(UserWarning, match=r"\(3 distinct bad samples"):  # a resumed run keeps both counts
        again = run.build(cfg).train(resume_from_checkpoint=str(tmp_path / "run" / f"checkpoint-{out.global_step}"))
    assert again.metrics["train_skipped_malformed_json"] == 6 and again.metrics["train_bad_samples"] == 3
