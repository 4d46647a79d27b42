"""GRPO on 2 gloo ranks (torchrun's rank environment, ddp_timeout 30 so a collective mismatch fails fast instead of
hanging) equals one process over the same prompts and completions (tests/grpo_ranks_worker.py): ranks whose prompts
and completions differ in length, a rank whose group is all truncated (``mask_truncated_completions``: no loss
token there), a rank whose group's rewards are all equal (zero advantage), a tiny Qwen3-VL's groups cut by the
ranks' slices (each rank's rows read their own prompt's images), videos on rank 0 only (rank 1 text only: its
forwards run the dummy image and video); rewards gathered over the ranks before
the advantages (``scale_rewards: batch`` over the global batch), ``dapo`` normalised by the global token count. Every
case runs in one launch; the 1-process references in the test's process.

Compared: the policy's final weights (AdamW with weight decay), every step's logged loss and rollout metrics
(TRL's names) and completions table (``log_completions``: the generation batch's rows of both ranks, rank 0's
first), and the evaluation after training (5 eval groups dealt to the ranks 3 and 2, each evaluated once; in the
vision case rank 0's with images, rank 1's text only): every eval_ metric equals one process's over the same eval
batches."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests import preloaded
from tests.grpo_ranks_worker import CASES, EVAL_PROMPTS
from tests.test_grpo import model_dir  # noqa: F401 (the tiny Llama, a fixture)

ROOT = Path(__file__).resolve().parents[1]
LOGGED = ("loss", "reward", "reward_std", "rewards/length_reward/mean", "frac_reward_zero_std",
          "completions/mean_length", "completions/max_length", "completions/clipped_ratio",
          "completions/mean_terminated_length")
TOKEN_MEANS = ("kl", "entropy", "clip_ratio/region_mean")  # (dapo: micro-batches weighted by their tokens)
TIMES = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_model_preparation_time")


def _table_problem(step: int, a: dict, b: dict, case: str) -> str | None:
    """Both ranks' rows in one process's order (prompts and completions alike, rewards and advantages to 1e-5),
    each step's table the last generation batch's."""
    x, y = a.get("completions"), b.get("completions")
    size = 2 * CASES[case]["per_device_train_batch_size"] * CASES[case]["gradient_accumulation_steps"]
    if y is None or len(y) != size or len(x or []) != len(y) or any(
            r.keys() != s.keys() or any(r[k] != (s[k] if k in ("prompt", "completion") else pytest.approx(s[k], rel=1e-5))
                                        for k in s) for r, s in zip(x, y, strict=True)):
        return f"step {step} completions table ({size} rows expected): {x} (2 ranks) vs {y} (1 process)"
    return None


def _eval_problem(tmp: Path, case: str, two: dict, one: dict) -> str | None:
    calls = {n: [tuple(map(int, (tmp / f"{case}-{n}-evals-{r}.txt").read_text().split())) for r in range(n)]
             for n in (2, 1)}  # (eval batches generated, those with an image)
    images = 3 if CASES[case].get("vision") else 0
    if calls != {2: [(3, images), (2, 0)], 1: [(5, images)]}:  # (each eval batch generated once, by one process)
        return f"eval batches generated per rank (with an image): {calls}"
    a, b = ({k: v for k, v in run["eval"].items() if k not in TIMES} for run in (two, one))
    if a.keys() != b.keys() or not {"eval_reward", "eval_loss", "eval_completions/mean_length"} <= b.keys():
        return f"eval keys: {sorted(a)} (2 ranks) vs {sorted(b)} (1 process)"
    if a.get("eval_samples") != EVAL_PROMPTS:  # (the prompts of every process, as TRL's len(eval_dataset))
        return f"eval_samples: {a.get('eval_samples')} on 2 ranks ({EVAL_PROMPTS} eval prompts)"
    for key, value in b.items():
        if a[key] != pytest.approx(value, rel=1e-5, abs=1e-6):
            return f"{key}: {a[key]} (2 ranks) vs {value} (1 process)"
    return None


def _problem(tmp: Path, case: str, output: str) -> str | None:
    runs = {n: tmp / f"{case}-{n}.pt" for n in (2, 1)}
    if not runs[2].is_file():
        return f"the 2-rank run did not finish:\n{output}"
    two, one = (torch.load(runs[n], weights_only=False) for n in (2, 1))
    if (two["global_step"], one["global_step"]) != (3, 3):
        return f"steps: {two['global_step']} on 2 ranks, {one['global_step']} in 1 process"
    for name, w in one["weights"].items():
        if not torch.allclose(two["weights"][name], w, rtol=1e-5, atol=1e-6):
            return f"{name} differs from one process's by {float((two['weights'][name] - w).abs().max())}"
    rows = [[r for r in run["logs"] if "loss" in r] for run in (two, one)]
    if not len(rows[0]) == len(rows[1]) == 3:
        return f"logged rows: {rows}"
    keys = LOGGED + (TOKEN_MEANS if CASES[case]["loss_type"] == "dapo" else ())
    for step, (a, b) in enumerate(zip(*rows, strict=True), 1):
        for key in keys:
            if (key in a) != (key in b) or (key in b and a[key] != pytest.approx(b[key], rel=1e-5, abs=1e-6)):
                return f"step {step} {key}: {a.get(key)} (2 ranks) vs {b.get(key)} (1 process)"
        if problem := _table_problem(step, a, b, case):
            return problem
    scripted = CASES[case].get("mask_truncated_completions")  # (the text cases: KINDS's equal and truncated groups)
    if scripted and not any(r.get("completions/clipped_ratio", 0) > 0 for r in rows[1]) or (
            scripted and CASES[case].get("scale_rewards", "group") == "group"
            and not any(r.get("frac_reward_zero_std", 0) > 0 for r in rows[1])):
        return "the scripted cases (an equal-reward group, a truncated one) did not happen"
    return _eval_problem(tmp, case, two, one)


@pytest.mark.slow
def test_grpo_on_two_ranks_equals_one_process(tmp_path, model_dir, tiny_hub, one_thread):  # noqa: F811
    from tests.grpo_ranks_worker import run

    _, vlm_dir, _ = tiny_hub("qwen3_vl")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    (tmp_path / "logs").mkdir()
    _, output = preloaded.launch("tests.preloaded:run_script", [
        str(ROOT / "tests" / "grpo_ranks_worker.py"), str(tmp_path), str(model_dir), vlm_dir, *CASES], env, 2,
        tmp_path / "logs", timeout=300)
    for case in CASES:
        run(case, str(model_dir), vlm_dir, str(tmp_path))
    problems = {case: _problem(tmp_path, case, output) for case in CASES}
    assert not any(problems.values()), "\n".join(f"{c}: {p}" for c, p in problems.items() if p)


def test_grpo_evaluation_on_several_processes_needs_whole_groups_per_process():
    """Each process evaluates its own eval batches without a collective per batch: a group cut by two processes'
    batches (TRL's global rule alone would allow per_device_eval_batch_size 4 x 2 processes for groups of 8) is
    refused in one line naming the option."""
    from types import SimpleNamespace

    from vlmtrain.compat.grpo_eval import check_eval_batch
    from vlmtrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"per_device_eval_batch_size=4 on 2 processes: .* num_generations=8"):
        check_eval_batch(SimpleNamespace(per_device_eval_batch_size=4, world_size=2, num_generations=8))
    check_eval_batch(SimpleNamespace(per_device_eval_batch_size=8, world_size=2, num_generations=8))
