"""lmms-eval adapter: a vlmtrain checkpoint as an lmms-eval model, on a local task (JSONL + PNGs, no Hub)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from optional_extras import requires
from PIL import Image

from tests.test_vlm_run import TINY
from vlmtrain import run
from vlmtrain.config import ConfigError, load_run_config
from vlmtrain.evaluation.lmms import flatten_results
from vlmtrain.evaluation.shapes_task import write_shapes_task

NEEDS_LMMS = requires("lmms_eval", "lmms", install="pip install 'vlmtrain[lmms]' && pip install --no-deps lmms-eval==0.7.3")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A tiny VLM trained 2 steps on shapes with async evaluation of checkpoint-2/ (`vlmtrain eval` in a
    subprocess) that also runs the local lmms-eval task written in task/."""
    root = tmp_path_factory.mktemp("lmms_run")
    write_shapes_task(str(root / "task"), num_samples=6, seed=3)
    _answer_like_the_checkpoint(root)
    data = json.loads(json.dumps(TINY))
    data["train"].update(output_dir=str(root / "run"), eval_strategy="no", save_steps=2, async_eval=True, seed=SEED,
                         lmms_eval_tasks=["shapes_vqa"], lmms_eval_include_path=str(root / "task"))
    (root / "cfg.yaml").write_text(yaml.safe_dump(data))
    env = {"LMMS_EVAL_DATASETS_CACHE": str(root / "hf_datasets")}  # (the evaluation process inherits it)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        run.train(load_run_config(root / "cfg.yaml"))
    assert (root / "run" / "checkpoint-2" / "model.safetensors").is_file()
    return root


SEED = 3
"""train.seed of the fixture's runs: its checkpoint-2 answers differ between documents and have letters in them
(other seeds answer punctuation only, which the metric's ignore_punctuation turns into "" for every answer)."""


def _answer_like_the_checkpoint(root: Path) -> None:
    """Two steps teach the tiny VLM no right answer (an exact match of 0 proves nothing), so the task's answers
    are seeded: the same training (same seed, so the same checkpoint-2) is run first without evaluation, and
    the even documents' answers become that checkpoint's greedy answers; the odd ones keep their true answers."""
    from vlmtrain.models.kinds import kind_of_checkpoint

    data = json.loads(json.dumps(TINY))
    data["train"].update(output_dir=str(root / "probe"), eval_strategy="no", save_steps=2, seed=SEED)
    (root / "probe.yaml").write_text(yaml.safe_dump(data))
    run.train(load_run_config(root / "probe.yaml"))
    ckpt = str(root / "probe" / "checkpoint-2")
    answer = kind_of_checkpoint(ckpt).load_generator(ckpt, "cpu")
    path = root / "task" / "shapes_vqa.jsonl"
    docs = [json.loads(line) for line in path.read_text().splitlines()]
    for i, doc in enumerate(docs):
        if i % 2 == 0:
            images = [str(root / "task" / p) for p in doc["images"]]
            doc["answer"] = answer(doc["question"], images, 4).split("\n")[0].strip()
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    """lmms-eval's HF datasets cache (the JSONL's arrow copy) in tmp, not ~/.cache."""
    monkeypatch.setenv("LMMS_EVAL_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


def test_flatten_results_names_metrics_and_leaves_out_stderr_alias_and_non_numbers():
    results = {"shapes_vqa": {"alias": "shapes_vqa", "exact_match,none": 0.5, "exact_match_stderr,none": "N/A",
                              "exact_match_stderr_clt,none": 0.2, "anls,strict": 1, "score,none": float("nan")}}
    assert flatten_results(results) == {"eval_lmms_shapes_vqa_exact_match": 0.5,
                                        "eval_lmms_shapes_vqa_anls_strict": 1.0}


def test_shapes_task_files(tmp_path):
    write_shapes_task(str(tmp_path), num_samples=6, seed=1)
    rows = [json.loads(line) for line in (tmp_path / "shapes_vqa.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {"id", "qtype", "images", "question", "answer"} <= set(rows[0])
    assert all((tmp_path / p).is_file() for r in rows for p in r["images"])
    config = yaml.safe_load((tmp_path / "shapes_vqa.yaml").read_text().replace("!function ", ""))
    assert config["task"] == "shapes_vqa" and config["dataset_kwargs"]["data_files"]["test"] == "shapes_vqa.jsonl"


@NEEDS_LMMS
def test_lmms_eval_scores_what_the_checkpoint_answers(tiny_run, tmp_path, monkeypatch, datasets_cache):
    """The answers the model gives reach lmms-eval's metric: a generator that answers right (in upper case,
    with a trailing period and text after a newline, which `until` and the metric's options remove) on the
    even documents and wrong on the odd ones scores exactly 0.5; it is given each document's images."""
    from vlmtrain.evaluation.lmms import lmms_eval_metrics
    from vlmtrain.models import kinds

    task_dir = tmp_path / "task"
    write_shapes_task(str(task_dir), num_samples=8, seed=2)
    rows = [json.loads(line) for line in (task_dir / "shapes_vqa.jsonl").read_text().splitlines()]
    truth = {(r["question"], _pixels([Image.open(task_dir / p) for p in r["images"]])): r for r in rows}
    seen: list[int] = []

    def load_generator(checkpoint, device=None):
        assert checkpoint.endswith("checkpoint-2") and device == "cpu"

        def answer(prompt, images, max_new_tokens):
            assert max_new_tokens == 4  # the task's generation_kwargs
            row = truth[(prompt, _pixels(images))]
            seen.append(row["id"])
            return f"{row['answer'].upper()}.\nmore words" if row["id"] % 2 == 0 else "wrong"
        return answer

    fake = kinds.ModelKind("fake", build=None, load_generator=load_generator)
    monkeypatch.setattr(kinds, "kind_of_checkpoint", lambda checkpoint: fake)
    metrics = lmms_eval_metrics(str(tiny_run / "run"), ["shapes_vqa"], include_path=str(task_dir), device="cpu")
    assert metrics == {"eval_lmms_shapes_vqa_exact_match": 0.5}
    assert sorted(seen) == list(range(8))
    limited = lmms_eval_metrics(str(tiny_run / "run"), ["shapes_vqa"], include_path=str(task_dir), limit=3,
                                device="cpu")
    assert limited == {"eval_lmms_shapes_vqa_exact_match": pytest.approx(2 / 3)}  # documents 0, 1, 2

    with pytest.raises(ConfigError, match=r"\['nope'\] not found.*defines: shapes_vqa"):
        lmms_eval_metrics(str(tiny_run / "run"), ["nope"], include_path=str(task_dir))


@NEEDS_LMMS
@pytest.mark.slow
def test_async_evaluation_logs_lmms_metrics_of_each_checkpoint(tiny_run):
    """Async evaluation runs `vlmtrain eval --checkpoint`, which adds eval_lmms_<task>_<metric> to the eval set's
    metrics: metrics.jsonl's row for checkpoint-2 has it, equal to the exact match of the checkpoint's own
    greedy answers to the task."""
    from vlmtrain.models.kinds import kind_of_checkpoint

    rows = [json.loads(line) for line in (tiny_run / "run" / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if r.get("eval_async")]
    assert row["step"] == 2 and "eval_loss" in row and "eval_async_error" not in row, row

    task_dir, ckpt = tiny_run / "task", str(tiny_run / "run" / "checkpoint-2")
    answer = kind_of_checkpoint(ckpt).load_generator(ckpt, "cpu")
    docs = [json.loads(line) for line in (task_dir / "shapes_vqa.jsonl").read_text().splitlines()]
    right = [_normalize(answer(d["question"], [str(task_dir / p) for p in d["images"]], 4).split("\n")[0].strip())
             == _normalize(d["answer"]) for d in docs]
    assert right == [i % 2 == 0 for i in range(len(docs))], right  # (seeded: even documents answer as the model)
    assert len({_normalize(d["answer"]) for d in docs[::2]}) > 1  # answers that differ, not one empty string
    assert row["eval_lmms_shapes_vqa_exact_match"] == pytest.approx(sum(right) / len(docs)), right


def test_lmms_tasks_need_a_checkpoint_and_a_sane_limit(tmp_path):
    data = json.loads(json.dumps(TINY))
    data["train"].update(output_dir=str(tmp_path / "run"), lmms_eval_tasks=["shapes_vqa"])
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="pass --checkpoint"):
        run.evaluate(load_run_config(tmp_path / "cfg.yaml"))
    data["train"]["lmms_eval_limit"] = 0
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="lmms_eval_limit must be >= 1"):
        load_run_config(tmp_path / "cfg.yaml")


@NEEDS_LMMS
def test_lmms_eval_finds_the_model_by_name():
    """lmms-eval's own registry (its CLI's --model vlmtrain) reaches VlmtrainLMM through the entry point."""
    from lmms_eval.models import get_model

    from vlmtrain.evaluation.lmms_model import VlmtrainLMM, cut_at_stop

    assert get_model("vlmtrain") is VlmtrainLMM
    assert cut_at_stop(" red.\nblue", ["\n"]) == "red." and cut_at_stop("red</s>x", "</s>") == "red"


def _pixels(images) -> tuple[bytes, ...]:
    return tuple(Image.open(i).convert("RGB").tobytes() if isinstance(i, str) else i.convert("RGB").tobytes()
                 for i in images)


def _normalize(text: str) -> str:
    """lmms-eval's exact_match with ignore_case and ignore_punctuation."""
    import string

    return text.lower().translate(str.maketrans("", "", string.punctuation))
