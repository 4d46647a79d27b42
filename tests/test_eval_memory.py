"""Evaluation memory (issue 14, item 6): what evaluate() keeps per batch does not grow with B x L x vocab.

A tiny Llama with a 150k vocabulary (Qwen's size): one eval batch of logits is 2 x 40 x 150_000 float32 =
48 MB. Peak RSS is sampled from /proc/self/statm while evaluate() runs; buffers this large are mmapped by
glibc (above its 32 MB maximum mmap threshold) and unmapped when freed, so RSS follows them closely. Keeping
the full logits would add 48 MB per batch (12 batches, ~550 MB, between 4 and 16 batches); the tests allow less
than two batches between 4 and 16 batches: a batch's logits may briefly coexist with the next one's, and the
1 ms sampling of a loaded machine can catch that moment in the 16-batch run and miss it in the 4-batch one (CI
under load: 45.8 MB, one batch, with nothing kept).
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from contextlib import contextmanager

import pytest
import torch

from tests.tiny import tiny_llama
from vlmtrain import Trainer, TrainingArguments

VOCAB, BATCH, LENGTH, PROMPT = 150_000, 2, 40, 8
LOGITS_MB = BATCH * LENGTH * VOCAB * 4 / 2**20  # one batch of full logits
PAGE = os.sysconf("SC_PAGE_SIZE")


@contextmanager
def peak_rss_growth_mb():
    """Yields a dict whose "mb" is, on exit, the peak resident memory while inside minus the memory at entry."""
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE

    start, peak, done, out = rss(), [0], threading.Event(), {}

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        done.set()
        thread.join()
        out["mb"] = (max(peak[0], rss()) - start) / 2**20


def _samples(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (LENGTH,), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones(LENGTH, dtype=torch.long),
                    "labels": torch.cat([torch.full((PROMPT,), -100), ids[PROMPT:]]),
                    "prompt_input_ids": ids[:PROMPT], "prompt_attention_mask": torch.ones(PROMPT, dtype=torch.long)})
    return out


def _collate(items: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


class WithScoreHead(torch.nn.Module):
    """The LM's outputs plus a score head (`logits_score`) and head_metrics, as vlmtrain's WithHeads returns."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm, self.score = lm, torch.nn.Linear(lm.config.hidden_size, 1)

    def forward(self, **inputs):
        out = self.lm(**inputs, output_hidden_states=True)
        return {"loss": out.loss, "logits": out.logits, "logits_score": self.score(out.hidden_states[-1][:, -1])}

    def head_metrics(self, predictions, labels):
        return {"score_mean": float(predictions["score"].mean())}


def _metric_rows(p) -> dict[str, float]:
    return {"rows": float(len(p.predictions)), "ndim": float(p.predictions.ndim)}


def _argmax(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


SETUPS = {  # name: (Trainer keyword arguments, TrainingArguments overrides)
    "losses only": ({}, {}),
    "user metrics + preprocess_logits_for_metrics": (
        {"compute_metrics": _metric_rows, "preprocess_logits_for_metrics": _argmax}, {}),
    "generated ids (predict_with_generate)": (
        {"compute_metrics": _metric_rows}, {"predict_with_generate": True, "generation_max_new_tokens": 3}),
    "score head": ({"heads": True}, {}),
}


def _trainer(tmp_path, kwargs: dict, overrides: dict) -> Trainer:
    kwargs = dict(kwargs)
    model = tiny_llama(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)
    if kwargs.pop("heads", False):
        model = WithScoreHead(model)
    args = TrainingArguments(output_dir=str(tmp_path), disable_tqdm=True, report_to=[], save_strategy="no",
                             per_device_eval_batch_size=BATCH, **overrides)
    return Trainer(model, args, data_collator=_collate, **kwargs)


def _growth(trainer: Trainer, batches: int) -> tuple[float, dict]:
    data = _samples(batches * BATCH)
    with peak_rss_growth_mb() as peak:
        metrics = trainer.evaluate(data)
    assert metrics["eval_samples"] == len(data)
    return peak["mb"], metrics


@pytest.mark.parametrize("setup", list(SETUPS))
def test_eval_peak_memory_does_not_grow_with_eval_batches(tmp_path, one_thread, setup):
    kwargs, overrides = SETUPS[setup]
    trainer = _trainer(tmp_path, kwargs, overrides)
    _growth(trainer, 1)  # warm-up: lazy allocations of the first forward are not the eval set's
    few, _ = _growth(trainer, 4)
    many, metrics = _growth(trainer, 16)
    assert many - few < 2 * LOGITS_MB, (setup, few, many)  # full logits kept: about 12 x 46 MB more
    if "compute_metrics" in kwargs:
        assert metrics["eval_rows"] == 16 * BATCH and metrics["eval_ndim"] == 2  # ids, not B x L x vocab
    if kwargs.get("heads"):
        assert "eval_score_mean" in metrics


def test_user_metrics_without_preprocess_keep_full_logits_as_transformers_does(tmp_path, one_thread):
    """The control: transformers' contract (compute_metrics on the logits) is kept, with a warning naming the
    remedy; the measurement above sees those logits (so it cannot pass if they were kept there)."""
    trainer = _trainer(tmp_path, {"compute_metrics": lambda p: {"ndim": float(p.predictions.ndim)}}, {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _growth(trainer, 1)
        few, _ = _growth(trainer, 2)
        many, metrics = _growth(trainer, 5)
    assert metrics["eval_ndim"] == 3
    assert many - few > 2 * LOGITS_MB, (few, many)  # 3 batches more of logits held
    assert any("preprocess_logits_for_metrics" in str(w.message) for w in caught)


def test_predictions_are_the_reduced_ids_in_order(tmp_path, one_thread):
    trainer = _trainer(tmp_path, {"preprocess_logits_for_metrics": _argmax}, {})
    data = _samples(5)
    out = trainer.predict(data)
    assert out.predictions.shape == (5, LENGTH) and out.label_ids.shape == (5, LENGTH)
    with torch.no_grad():
        expected = trainer.model(**_collate(data[3:5])).logits.argmax(-1)
    assert out.predictions[3:].tolist() == expected.tolist()


def test_a_run_without_generation_evaluates_losses_only(tmp_path, one_thread):
    """vlmtrain's own exact match scores generated answers: without predict_with_generate a run's evaluation
    keeps no predictions (it used to hold the whole eval set's logits, then fail to decode them)."""
    import yaml

    from tests.test_kinds import _write_text_run
    from vlmtrain import run
    from vlmtrain.config import load_run_config

    path = _write_text_run(tmp_path, packing=False)
    cfg = yaml.safe_load(path.read_text())
    cfg["train"]["predict_with_generate"] = False
    path.write_text(yaml.safe_dump(cfg))
    trainer = run.build(load_run_config(path))
    assert trainer.compute_metrics is None
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] > 0 and metrics["eval_samples"] == 8 and "eval_exact_match" not in metrics


@pytest.mark.slow
def test_two_ranks_gather_predictions_as_tensors_in_dataset_order(tmp_path):
    """2 gloo processes: predictions and labels cross ranks as tensors (padded all_gather), never pickled;
    rows come back in dataset order, sequences padded with -100 to the longest on any rank, a buffer empty on
    one rank still gathered; losses, sample and skip counts combined."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{root / 'src'}{os.pathsep}{root}"}
    worker = str(root / "tests" / "eval_gather_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, str(r), str(tmp_path / "store"), str(tmp_path / f"{r}.json")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    widths = {0: 4, 1: 5, 2: 4, 3: 5, 4: 3}  # per sample: 2 + rank + batch size
    expected = [[i * 10 + k if k < widths[i] else -100 for k in range(5)] for i in range(5)]
    for rank, g in enumerate(got):
        assert g["generated"] == expected, rank
        assert g["score"] == [[i / 4] for i in range(5)]
        assert g["labels"] == [0, 200, 400]  # only rank 0 had labels: its rows, in its order
        assert g["loss"] == pytest.approx((1 * 3 + 2 * 2) / 5)
        assert g["samples"] == 5 and g["skipped"] == {"bad": 1}
        assert not any("tensor" in p for p in g["pickled"]), g["pickled"]  # layouts and counts only
