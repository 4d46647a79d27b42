"""Every rank in step, whatever its data: 2 gloo ranks, each with its own mixture of answered, score-only,
no-target and bad samples (tests/rank_mixtures_worker.py), finish their run, and what they log (loss, each
loss_*, skip counts, in training and evaluation) and their final weights equal a 1-process run over the same
global samples. A collective mismatch fails within ddp_timeout=60 s instead of hanging."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from tests import preloaded
from tests.rank_mixtures_worker import run

ROOT = Path(__file__).resolve().parents[1]
# each equivalence with SGD and with AdamW and weight decay (a scenario name's suffix), in one launch: AdamW moves a
# parameter whose gradient is zero where one process gives none, which SGD hides; SGD shows a wrong gradient scale,
# which AdamW's normalized step hides
OPTIMIZERS = ("", "-adamw")


def _torchrun(tmp_path: Path, *names: str, nproc: int = 2) -> Path:
    """The scenarios run one after the other by ``nproc`` ranks (one launch); their results in OUT/<name>."""
    out = tmp_path / "two"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    (tmp_path / "logs").mkdir()
    # the ranks: torchrun's rank environment, forked with their imports done (tests/preloaded.py; no launcher)
    codes, output = preloaded.launch("tests.preloaded:run_script", [
        str(ROOT / "tests" / "rank_mixtures_worker.py"), str(out), ",".join(names)], env, nproc, tmp_path / "logs")
    assert codes == [0] * nproc, output
    return out


def _logged(rows: list[dict]) -> list[dict]:
    """Each row's losses and skip counts (what must not depend on how samples are spread over ranks)."""
    return [{k: v for k, v in r.items() if k == "loss" or k.startswith(("loss_", "skipped_", "train_skipped_"))
             or k == "train_loss"} for r in rows]


def _same_numbers(got: list[dict], want: list[dict]) -> None:
    assert [sorted(r) for r in got] == [sorted(r) for r in want]
    for mine, theirs in zip(got, want):
        for key, value in theirs.items():
            assert not math.isnan(mine[key]), (key, mine)
            assert mine[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (key, mine, theirs)


def _eval_counts(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k.startswith(("eval_loss_", "eval_skipped_")) or k == "eval_samples"}


def _same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 1e-7) -> None:
    """Float error only: ranks sum the gradients in another order (a count or weighting bug is ~1e-2 off)."""
    for name, w in want.items():
        err = float((got[name] - w).abs().max())
        assert err <= 1e-5 * float(w.abs().max()) + atol, (name, err)


def _compare(tmp_path: Path, name: str, two_ranks: Path | None = None, world: int = 2) -> tuple[dict, dict]:
    one = run(str(tmp_path / name), name)
    two = torch.load((two_ranks or _torchrun(tmp_path, name)) / name / "result.pt", weights_only=False)
    assert two["world_size"] == world and one["world_size"] == 1
    _same_numbers(_logged(two["logs"]), _logged(one["logs"]))  # log_history (the final row too)
    _same_numbers(_logged(two["rows"]), _logged(one["rows"]))  # metrics.jsonl: what trackers get
    # (AdamW's normalized step magnifies that float error on small gradients: 1.2e-5 seen; a zero gradient where one
    # process has none moves a weight by its momentum, ~0.7 x lr = 7e-3)
    _same_weights(two["weights"], one["weights"], 1e-4 if name.endswith("-adamw") else 1e-7)
    if "eval" in one:
        # (eval_loss itself weighs each batch by its num_items: it depends on the batches, not only the samples)
        _same_numbers([_eval_counts(two["eval"])], [_eval_counts(one["eval"])])
    return one, two


def _compare_optimizers(tmp_path: Path, name: str) -> list[tuple[dict, dict]]:
    """_compare for the scenario with SGD and with AdamW, both run by one 2-rank launch."""
    names = [name + optim for optim in OPTIMIZERS]
    two_ranks = _torchrun(tmp_path, *names)
    return [_compare(tmp_path, n, two_ranks) for n in names]


def test_a_logging_window_with_only_score_only_samples_on_one_rank(tmp_path, one_thread):
    """Rank 1's model returns no loss_lm for a whole logging window (training), nor for its share of the eval
    set: each loss is averaged over the ranks that had it, as one process averages it."""
    for _, two in _compare_optimizers(tmp_path, "score_only_window"):
        rows = [r for r in two["logs"] if "loss" in r]
        assert all("loss_lm" in r and "loss_cls" in r for r in rows)
        assert "eval_loss_lm" in two["eval"]


def test_bad_samples_on_rank_1_are_counted_and_checked_over_ranks(tmp_path, one_thread):
    """2 of rank 1's 4 samples are bad (2 of 8 over the ranks): logged in the window's row, metrics.jsonl and
    train_skipped_*, as one process logs them; max_bad_sample_fraction=0.4 is checked on the 2 ranks' 25%, so
    rank 1 (50% alone) does not stop."""
    for _, two in _compare_optimizers(tmp_path, "bad_on_rank1"):
        assert [r["skipped_corrupt_image"] for r in two["rows"] if "loss" in r] == [2]
        assert two["logs"][-1]["train_skipped_corrupt_image"] == 2


def test_too_many_bad_samples_stop_every_rank_with_one_message(tmp_path, one_thread):
    """max_bad_sample_fraction=0.2 against 2 of 8: every rank stops at the same point with the message the
    1-process run gives."""
    run(str(tmp_path), "too_many_bad")
    want = (tmp_path / "error_0.txt").read_text()
    out = _torchrun(tmp_path, "too_many_bad") / "too_many_bad"
    assert "2 of the last 8 training samples were bad" in want
    assert [(out / f"error_{r}.txt").read_text() for r in range(2)] == [want, want]


def test_a_whole_accumulation_window_without_targets_on_one_rank(tmp_path, one_thread):
    """A plain LM (no per-loss counts): rank 1's first accumulation window has no target; the logged loss and
    train_loss are the 1-process run's (no NaN), the weights too."""
    for one, two in _compare_optimizers(tmp_path, "no_target_window"):
        assert two["logs"][-1]["train_loss"] == pytest.approx(one["logs"][-1]["train_loss"], rel=1e-5)


def test_random_mixtures_per_rank(tmp_path, one_thread):
    """Seeds 0, 1, 2: each rank draws its own mixture of answered, score-only, no-target and bad samples
    (training and evaluation)."""
    names = [f"random_{seed}{optim}" for seed in range(3) for optim in OPTIMIZERS]
    two_ranks = _torchrun(tmp_path, *names)
    for name in names:
        _compare(tmp_path, name, two_ranks)


def test_random_mixtures_on_three_ranks(tmp_path, one_thread):
    """Seeds 0 and 1 on 3 ranks: each rank draws its own mixture of answered, score-only, no-target and bad
    samples (training and evaluation); everything logged and the final weights equal one process's."""
    names = [f"random3_{seed}{optim}" for seed in range(2) for optim in OPTIMIZERS]
    three_ranks = _torchrun(tmp_path, *names, nproc=3)
    for name in names:
        _, three = _compare(tmp_path, name, three_ranks, world=3)
        assert any("loss_lm" in r for r in three["logs"]) and "eval_loss_cls" in three["eval"]


@pytest.mark.parametrize("zero", [0.0, torch.tensor(0.0)], ids=["float", "tensor"])
def test_a_loss_weighted_zero_adds_nothing_even_if_nan(zero):
    """The mean loss of a micro-batch without targets is NaN and its weight 0: it leaves the average as it is,
    and a loss with no weight at all in the window is left out (never NaN)."""
    from vlmtrain.trainer.stats import LossAverager

    averager = LossAverager()
    averager.add({"loss": torch.tensor(math.nan), "loss_lm": torch.tensor(math.nan)}, zero)
    assert averager.compute() == {}
    averager.add({"loss": torch.tensor(2.0)}, torch.tensor(3.0))
    assert averager.compute() == {"loss": 2.0}
