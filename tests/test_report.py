"""`vlmtrain report`: per-sample eval files written by a real (tiny) evaluation, and the self-contained report."""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from PIL import Image

from tests.test_vlm_run import TINY
from vlmtrain import cli, run
from vlmtrain.config import ConfigError, load_run_config
from vlmtrain.logging import eval_samples, plot
from vlmtrain.logging.report import eval_records, metric_groups, train_series, write_report
from vlmtrain.logging.report_gallery import pick_cards
from vlmtrain.tasks.shapes import QTYPES, ShapesVQA

DATA_URI = re.compile(r"data:(image/(?:png|jpeg));base64,([A-Za-z0-9+/=]+)")


SCRIPTED = ["1", "first", "cross left"]
"""What the scripted generator answers to the i-th sample of each eval batch (a set's 3 samples are one batch):
right for some samples (count 0, multi_count 1, side 2, ...), wrong for the rest."""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """The tiny VLM on shapes, evaluated (with generation) at steps 1 and 2: 7 eval sets of 3 samples. Two
    steps teach it no right answer, so the model's generate() is scripted (SCRIPTED, then end of sequence):
    everything after it (slicing, decoding, scoring, the eval_samples rows, the metrics) is the real code."""
    from vlmtrain.data import processing
    from vlmtrain.models.own_vlm.vlm import VisionLanguageModel

    tmp = tmp_path_factory.mktemp("report")
    data = {k: dict(v) for k, v in TINY.items()}
    data["data"] = {**data["data"], "num_eval": 3}
    data["train"] = {**data["train"], "eval_steps": 1, "save_steps": 2, "output_dir": str(tmp / "run")}
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(data))
    tokenizers = []
    build_tokenizer = processing.build_chat_tokenizer

    def keep_tokenizer(*args, **kwargs):
        tokenizers.append(build_tokenizer(*args, **kwargs))
        return tokenizers[-1]

    def scripted_generate(self, input_ids, attention_mask=None, pad_token_id=None, **kwargs):
        tok = tokenizers[-1]
        answers = [tok.encode(SCRIPTED[i], add_special_tokens=False) + [tok.eos_token_id]
                   for i in range(len(input_ids))]
        width = max(map(len, answers))
        new = torch.tensor([a + [pad_token_id] * (width - len(a)) for a in answers], dtype=input_ids.dtype)
        return torch.cat([input_ids, new], dim=1)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(processing, "build_chat_tokenizer", keep_tokenizer)
        mp.setattr(VisionLanguageModel, "generate", scripted_generate)
        run.train(load_run_config(tmp / "cfg.yaml"))
    return tmp / "run"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_evaluation_writes_one_row_per_eval_sample(tiny_run):
    for step in (1, 2):
        rows = _rows(tiny_run / f"eval_samples_step_{step}.jsonl")
        assert [(r["set"], r["index"]) for r in rows] == [(q, i) for q in QTYPES for i in range(3)]
        for row in rows:
            sample = ShapesVQA("val", 3, seed=0, qtypes=[row["set"]])[row["index"]]
            assert row["step"] == step and row["id"] == sample["id"]
            assert row["question"] == sample["texts"][-1]["user"]
            assert row["truth"] == sample["texts"][-1]["assistant"]
            assert row["generated"] == SCRIPTED[row["index"]]
            assert row["correct"] == (SCRIPTED[row["index"]] == sample["texts"][-1]["assistant"])
            assert len(row["images"]) == row["num_images"] == len(sample["images"])
            for ref in row["images"]:
                with Image.open(tiny_run / ref) as image:
                    assert max(image.size) <= eval_samples.THUMBNAIL_SIZE
    logged = _rows(tiny_run / "metrics.jsonl")
    exact = next(r["eval_exact_match"] for r in logged if r["step"] == 2 and "eval_exact_match" in r)
    right = sum(r["correct"] for r in rows)
    assert 0 < right < len(rows) and exact == pytest.approx(right / len(rows))  # scored as compute_metrics does
    for q in QTYPES:  # and per eval set
        per_set = [r["correct"] for r in rows if r["set"] == q]
        assert next(r[f"eval_{q}_exact_match"] for r in logged if r["step"] == 2 and f"eval_{q}_exact_match" in r) \
            == pytest.approx(sum(per_set) / len(per_set)), q


def test_report_is_self_contained_with_one_card_per_sample(tiny_run):
    path = write_report(str(tiny_run), max_cards=100)
    page = Path(path).read_text()
    uris = DATA_URI.findall(page)
    assert len(uris) > 5
    for mime, payload in uris:
        image = Image.open(io.BytesIO(base64.b64decode(payload)))
        image.load()
        assert image.format == {"image/png": "PNG", "image/jpeg": "JPEG"}[mime]
    without_data = DATA_URI.sub("", page)
    assert not re.search(r"(?:src|href)\s*=\s*[\"']?\s*(?:https?:)?//", without_data)
    assert not re.search(r"url\(\s*[\"']?(?:https?:)?//|@import|<script|<link", without_data, re.I)
    sections = re.findall(r'<details class="step".*?</details>', page, re.S)
    assert len(sections) == 2  # steps 2 and 1, newest first
    for section, step in zip(sections, (2, 1)):
        rows = _rows(tiny_run / f"eval_samples_step_{step}.jsonl")
        assert section.count('<div class="card ') == len(rows)
        assert section.count('<div class="card wrong"') == sum(not r["correct"] for r in rows)
        for ref in {ref for r in rows for ref in r["images"]}:  # every thumbnail embedded, once
            assert page.count(base64.b64encode((tiny_run / ref).read_bytes()).decode()) == 1
    assert 'id="wrong-only"' in page and "#wrong-only:checked ~ .galleries .card.right" in page
    charts = re.findall(r'<img alt="([^"]+)"', page)
    assert {"loss", "learning rate", "grad norm", "samples / s", "tokens / s", "eval loss",
            "eval exact_match"} <= set(charts)
    series = {title: [s.name for s in lines] for title, lines in train_series(_rows(tiny_run / "metrics.jsonl")).items()}
    assert series["learning rate"][0] == "learning_rate" and "learning_rate_projector" in series["learning rate"]
    table = re.search(r'<table class="metrics">.*?</table>', page, re.S).group(0)
    assert "eval_color_exact_match" in table and table.count('<span class="tag inline">') == 2
    with Image.open(tiny_run / "curves.png") as curves:
        curves.load()
        assert curves.size[0] >= plot.WIDTH


def test_eval_of_a_checkpoint_joins_the_report_without_a_timing_chart(tiny_run, tmp_path, capsys):
    """`vlmtrain eval --checkpoint` logs its row (at the checkpoint's step) to the run's metrics.jsonl, with
    transformers' `eval_model_preparation_time` (an evaluation without training, as transformers reports it):
    the report lists it in the table with the other timings and draws no chart of it."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run, run_dir)
    assert cli.main(["eval", "--config", str(run_dir / "config.yaml"), "--checkpoint", str(run_dir / "checkpoint-2"),
                     "--train.output_dir", str(run_dir)]) == 0
    rows = [r for r in _rows(run_dir / "metrics.jsonl") if any(k.startswith("eval_") for k in r)]
    logged = [k for r in rows[-8:] for k in r if k.endswith("model_preparation_time")]  # 7 eval sets + all sets
    assert len(logged) == 7 and all(r["step"] == 2 for r in rows[-8:]), rows[-8:]
    assert cli.main(["report", str(run_dir)]) == 0
    page = (run_dir / "report.html").read_text()
    charts = re.findall(r'<img alt="([^"]+)"', page)
    assert "eval loss" in charts and not [c for c in charts if "model_preparation_time" in c], charts
    table = re.search(r'<table class="metrics">.*?</table>', page, re.S).group(0)
    assert "<td>eval_runtime</td>" not in table or "<td>eval_model_preparation_time</td>" in table


def test_async_rows_are_marked_and_ordered(tmp_path):
    rows = [{"step": s, "loss": 3.0 / s, "learning_rate": 1e-3, "grad_norm": 1.0, "samples_per_second": 9.0,
             "data_wait_fraction": 0.01} for s in (10, 20, 30, 40)]
    rows.insert(2, {"step": 20, "eval_loss": 1.5, "eval_exact_match": 0.25})  # inline
    rows.append({"step": 30, "eval_loss": 1.2, "eval_exact_match": 0.5, "eval_async": True,
                 "eval_checkpoint": "checkpoint-30", "eval_arrived_step": 40})  # arrives after step 40's row
    rows.append({"step": 10, "eval_loss": 2.0, "eval_exact_match": 0.0, "eval_async": True,
                 "eval_checkpoint": "checkpoint-10", "eval_arrived_step": 40})
    rows.append({"step": 40, "eval_async": True, "eval_checkpoint": "checkpoint-40", "eval_arrived_step": 40,
                 "eval_async_error": "exit code 1; log: async_eval/step-40.log"})  # a failed evaluation
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = eval_records(rows, str(tmp_path))
    assert [(r.step, r.is_async, r.arrived_step) for r in records] == [(10, True, 40), (20, False, None),
                                                                        (30, True, 40), (40, True, 40)]
    assert records[-1].metrics == {} and records[-1].notes == ["exit code 1; log: async_eval/step-40.log"]
    page = Path(write_report(str(tmp_path))).read_text()
    header = re.search(r"<thead>.*?</thead>", page, re.S).group(0)
    assert re.findall(r"step (\d+) <span class=\"tag (\w+)\"", header) == [("10", "async"), ("20", "inline"),
                                                                           ("30", "async"), ("40", "async")]
    assert header.count("arrived at step 40") == 3 and "checkpoint-30" in header and "exit code 1" in header
    assert "eval_async_error" not in page
    assert "No eval_samples_step_N.jsonl" in page


def test_shapes_report_shows_blank_image_and_chance_baselines_beside_the_scores(tmp_path):
    """The demo logs an evaluation with blank images (blank_* keys); the report puts it and the data source's
    chance values in columns beside the model's scores, with the single-/multi-image means of each."""
    from vlmtrain.tasks.shapes import CHANCE, MULTI_IMAGE_QTYPES, SINGLE_IMAGE_QTYPES

    model = {q: 0.5 + i / 20 for i, q in enumerate(QTYPES)}
    blank = {q: i / 100 for i, q in enumerate(QTYPES)}
    rows = [{"step": 4, "loss": 1.0},
            *({"step": 4, f"eval_{q}_exact_match": v, f"eval_{q}_samples": 2} for q, v in model.items()),
            {"step": 4, "eval_exact_match": 0.6, "eval_loss": 1.0, "eval_samples": 14},
            *({"step": 4, f"blank_{q}_exact_match": v} for q, v in blank.items())]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"data": {"source": "shapes"}}))
    page = Path(write_report(str(tmp_path))).read_text()
    header = re.search(r"<thead>.*?</thead>", page, re.S).group(0)
    assert re.findall(r'<th class="baseline">([^<]+)</th>', header) == ["blank images (step 4)", "chance"]

    def row(name: str) -> list[str]:
        cells = re.search(rf"<tr><td>eval_{name}</td>(.*?)</tr>", page).group(1)
        return re.findall(r"<td[^>]*>([^<]*)</td>", cells)

    for q in QTYPES:
        assert row(f"{q}_exact_match") == [plot.format_number(v) for v in (model[q], blank[q], CHANCE[q])]
    single = [sum(d[q] for q in SINGLE_IMAGE_QTYPES) / len(SINGLE_IMAGE_QTYPES) for d in (model, blank, CHANCE)]
    assert row("single_image_exact_match") == [plot.format_number(v) for v in single]
    multi = sum(CHANCE[q] for q in MULTI_IMAGE_QTYPES) / len(MULTI_IMAGE_QTYPES)
    assert row("multi_image_exact_match")[2] == plot.format_number(multi)
    assert row("exact_match") == ["0.6", "", plot.format_number(sum(CHANCE.values()) / len(CHANCE))]


def test_bad_input_gives_a_clear_error_or_skip(tmp_path, capsys):
    with pytest.raises(ConfigError, match="no metrics.jsonl"):
        write_report(str(tmp_path))
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n[1, 2]\n'
                                            '{"step": 3, "loss": "nan"}\n')
    (tmp_path / "eval_samples_step_3.jsonl").write_text('{"step": 3, "index": 0, "question": "q?", '
                                                        '"generated": "a", "truth": "b", "correct": false}\nnot json\n')
    assert cli.main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    assert "metrics.jsonl: 2 line(s)" in page and "eval_samples_step_3.jsonl: 1 line(s)" in page
    assert page.count('<div class="card wrong"') == 1


def test_cards_are_half_wrong_answers_within_each_set_share():
    rows = [{"set": s, "index": i, "correct": i % 3 == 0} for s in ("a", "b") for i in range(10)]
    picked = pick_cards(rows, max_cards=8)
    assert len(picked) == 8
    for s in ("a", "b"):  # 4 cards each: the first 2 wrong answers (not multiples of 3) and the first 2 right
        assert [r["index"] for r in picked if r["set"] == s] == [0, 1, 2, 3]
    few_right = [{"set": "a", "index": i, "correct": i == 5} for i in range(10)]
    assert [r["index"] for r in pick_cards(few_right, max_cards=4)] == [0, 1, 2, 5]


def test_score_head_rows_compare_predictions_with_labels():
    configs = {"color": SimpleNamespace(type="classification", loss="ce"),
               "count": SimpleNamespace(type="regression", loss="mse")}
    output = SimpleNamespace(heads={"color": [[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]], "count": [[2.5], [1.0]]},
                             predictions=None, texts=None)
    rows = eval_samples.prediction_rows(output, SimpleNamespace(head_configs=configs), None)
    for row, labels in zip(rows, ({"color": 1, "count": 3.0}, {"color": 2, "count": 1.0})):
        row["labels"] = labels
    eval_samples.score_rows(rows)
    assert rows[0] == {"heads": {"color": {"predicted": 1, "truth": 1, "correct": True},
                                 "count": {"predicted": 2.5, "truth": 3.0}}, "correct": True}
    assert rows[1]["correct"] is False and rows[1]["heads"]["color"]["predicted"] == 0


def test_metric_groups_and_ticks():
    groups = metric_groups(["loss", "color_loss", "exact_match", "color_exact_match", "loss_lm",
                            "single_image_exact_match"])
    assert groups == {"exact_match": ["color_exact_match", "exact_match", "single_image_exact_match"],
                      "loss": ["color_loss", "loss"], "loss_lm": ["loss_lm"]}
    assert plot.nice_ticks(0.1, 3.1) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert plot.nice_ticks(5, 5)[0] <= 5 <= plot.nice_ticks(5, 5)[-1]
    # an eval set's exact match and the mean over the sets, equal but for the last bit: a few ticks, not a hang
    assert 2 <= len(plot.nice_ticks(0.55, math.nextafter(0.55, 1), 5)) <= 6


def test_async_evaluation_files_join_the_run_dir(tmp_path):
    """An async evaluation writes into async_eval/step-N/: its sample file and thumbnails move to the run dir."""
    from vlmtrain.evaluation.async_eval import DIR, move_eval_samples

    scratch = tmp_path / DIR / "step-5"
    (scratch / eval_samples.THUMBNAIL_DIR / "eval").mkdir(parents=True)
    ref = eval_samples.save_thumbnail(Image.new("RGB", (200, 100), "red"), str(scratch), "eval_thumbnails/eval/0-0")
    row = {"step": 5, "set": None, "index": 0, "question": "q?", "generated": "a", "truth": "a", "correct": True,
           "images": [ref], "num_images": 1}
    (scratch / "eval_samples_step_5.jsonl").write_text(json.dumps(row) + "\n")
    move_eval_samples(str(tmp_path), 5)
    with Image.open(tmp_path / ref) as thumb:
        assert thumb.size == (96, 48)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 5, "eval_loss": 1.0, "eval_async": True}) + "\n")
    page = Path(write_report(str(tmp_path))).read_text()
    assert page.count('<div class="card right"') == 1 and 'class="thumb img0"' in page and "thumb missing" not in page


def test_eval_on_other_data_is_recorded_apart_and_never_as_the_runs(tiny_run, tmp_path, caplog):
    """`vlmtrain eval --checkpoint` with data other than the run's (here 1 sample per set instead of 3) writes
    its rows under evals/<name>/ of the run: the run's metrics.jsonl, sample files and report stay as they were."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run, run_dir)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    argv = ["eval", "--config", str(run_dir / "config.yaml"), "--checkpoint", str(run_dir / "checkpoint-2"),
            "--train.output_dir", str(run_dir), "--data.num_eval", "1"]
    with caplog.at_level(logging.WARNING, logger="vlmtrain.run"):
        assert cli.main(argv) == 0
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
    [own] = list((run_dir / "evals").glob("*/metrics.jsonl"))
    rows = [r for r in _rows(own) if "eval_samples" in r]
    assert rows and rows[-1]["step"] == 2 and rows[-1]["eval_samples"] == len(QTYPES)  # 1 per set, not 3
    assert any("data.num_eval" in r.getMessage() and str(own.parent) in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match="data.num_eval"):  # --all appends to the run's rows: the run's data only
        run.evaluate_all(str(run_dir), load_run_config(run_dir / "config.yaml", {"data.num_eval": 1}))
