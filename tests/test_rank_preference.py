"""Preference training on 2 gloo ranks (torchrun, ddp_timeout 30 so a collective mismatch fails fast instead of
hanging) equals one process over the same pairs in the same global batches: vlmtrain's DPOTrainer on a tiny
Qwen3-VL under DDP with LoRA (the reference: the adapters off) and under FSDP as a full fine-tune (the reference:
a frozen copy, sharded with the policy), with pairs with and without images and of different lengths, a
micro-batch with images on one rank only, and gradient accumulation in one case; and RewardTrainer on a tiny
Llama under DDP. Every case runs in one torchrun launch; the 1-process references in the test's process.

Compared: the final weights of the policy (AdamW with weight decay) and the logged loss and per-pair metrics
(TRL's names) of every step, and DPO's evaluation after training."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests import preloaded
from tests.optional_extras import requires
from tests.rank_preference_worker import CASES
from tests.test_reward import model_dir  # noqa: F401 (the tiny Llama reward model, a fixture)

ROOT = Path(__file__).resolve().parents[1]
# The largest weight difference float error explains: the ranks sum each gradient in another order and pad their
# micro-batches to other lengths; Adam's normalized first steps magnify that on small gradients.
WEIGHT_TOLERANCE = 1e-6
# Per-pair means: the mean of the ranks' equal-sized micro-batch means is the global batch's mean. (Token means,
# logits/*, entropy, mean_token_accuracy, are per micro-batch in TRL too, and min/max_reward per rank.)
LOGGED = {"dpo": ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                  "logps/chosen", "logps/rejected"),
          "reward": ("loss", "accuracy", "margin", "mean_reward")}


def _problem(tmp: Path, case: str, output: str) -> str | None:
    """What is wrong with a case's 2-rank run against its 1-process one (None: nothing)."""
    runs = {n: tmp / f"{case}-{n}.pt" for n in (2, 1)}
    if not runs[2].is_file():
        return f"the 2-rank run did not finish:\n{output}"
    two, one = (torch.load(runs[n], weights_only=False) for n in (2, 1))
    if (two["global_step"], one["global_step"]) != (2, 2):
        return f"steps: {two['global_step']} on 2 ranks, {one['global_step']} in 1 process"
    if two["weights"].keys() != one["weights"].keys():
        return "not the same parameters"
    gaps = {k: float((w - one["weights"][k]).abs().max()) for k, w in two["weights"].items()}
    if max(gaps.values()) >= WEIGHT_TOLERANCE:
        return f"weights differ from one process's: {max(gaps.items(), key=lambda kv: kv[1])}"
    if all(torch.equal(two["weights"][k], two["initial"][k]) for k in two["weights"]):
        return "nothing trained"
    kind, _, _, fsdp, lora = CASES[case]
    if kind == "dpo" and (two["reference"] is None) != lora:
        return "the reference is not the adapters off (LoRA) or a frozen copy (a full fine-tune)"
    if two["reference"] is not None:
        if fsdp and not two["reference"]["sharded"]:
            return "under FSDP the reference's parameters are not sharded"
        if fsdp and two["reference"]["gathered"]:  # (gathered for its forward alone, not through the backward)
            return f"the reference's parameters stay gathered after the forward: {two['reference']['gathered']}"
        moved = [k for k, w in two["reference"]["weights"].items() if not torch.equal(w, two["initial"][k])]
        if moved:
            return f"the reference is not the frozen initial policy: {moved[:5]}"
    rows = [[r for r in run["logs"] if "loss" in r] for run in (two, one)]
    if not len(rows[0]) == len(rows[1]) == 2:
        return f"logged rows: {rows}"
    for step, (a, b) in enumerate(zip(*rows, strict=True), 1):
        for key in LOGGED[kind]:
            if key not in a or abs(a[key] - b[key]) > 1e-5 * max(1.0, abs(b[key])):
                return f"step {step} {key}: {a.get(key)} (2 ranks) vs {b[key]} (1 process)"
    for key in (f"eval_{k}" for k in LOGGED[kind] if kind == "dpo"):
        if abs(two["eval"][key] - one["eval"][key]) > 1e-5 * max(1.0, abs(one["eval"][key])):
            return f"{key}: {two['eval'][key]} (2 ranks) vs {one['eval'][key]} (1 process)"
    return None


@requires("peft", "lora")
def test_preference_training_on_two_ranks_equals_one_process(tmp_path, tiny_hub, request, one_thread):
    from tests.rank_preference_worker import run

    reward_dir = request.getfixturevalue("model_dir")

    _, vlm_dir, _ = tiny_hub("qwen3_vl")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    (tmp_path / "logs").mkdir()
    # the ranks: torchrun's rank environment, forked with their imports done (tests/preloaded.py; no launcher)
    _, output = preloaded.launch("tests.preloaded:run_script", [
        str(ROOT / "tests" / "rank_preference_worker.py"), str(tmp_path), vlm_dir, str(reward_dir), *CASES], env, 2,
        tmp_path / "logs", timeout=600)
    for case in CASES:
        run(case, vlm_dir, str(reward_dir), str(tmp_path))
    problems = {case: _problem(tmp_path, case, output) for case in CASES}
    assert not any(problems.values()), "\n".join(f"{c}: {p}" for c, p in problems.items() if p)
