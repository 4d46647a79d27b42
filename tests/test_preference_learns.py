"""The two-stage preference demo learns: the shipped configs/qwen3vl-tiny-pairs-{sft,dpo,reward}.yaml train a tiny
random-init Qwen3-VL (built offline) on shapes_pairs through `vlmtrain.run.demo`: SFT on a little data, then DPO
from its checkpoint (held-out preference accuracy >= 0.95, greedy exact match above stage 1's), and a reward head
on the stage-1 model (held-out pair accuracy >= 0.95)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from vlmtrain import run
from vlmtrain.tasks.shapes import ANSWERS
from vlmtrain.tasks.shapes_pairs import PAIR_QTYPES, ShapesPairs

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {stage: ROOT / "configs" / f"qwen3vl-tiny-pairs-{stage}.yaml" for stage in ("sft", "dpo", "reward")}


def test_shapes_pairs_chosen_is_the_sft_answer_and_rejected_a_wrong_one_of_its_kind():
    pairs, sft = ShapesPairs("val", 60, seed=3), ShapesPairs("val", 60, seed=3, pairs=False)
    assert {p["qtype"] for p in pairs} == set(PAIR_QTYPES)
    for pair, conversation in zip(pairs, sft):
        (turn,) = conversation["texts"]
        assert pair["texts"] == [{"user": turn["user"]}] and pair["chosen"] == turn["assistant"]
        assert pair["rejected"] != pair["chosen"] and pair["rejected"] in ANSWERS[pair["qtype"]]
        assert len(pair["images"]) == 1 and pair["images"][0].size == (64, 64)
    assert len({p["rejected"] for p in pairs if p["qtype"] == "color"}) > 2  # (drawn, not one fixed wrong answer)
    again = ShapesPairs("val", 60, seed=3)[7]
    assert (again["rejected"], again["images"][0].tobytes()) == (pairs[7]["rejected"], pairs[7]["images"][0].tobytes())


def demo(stage: str, out: Path, pretrained: str) -> dict:
    # the shipped config unchanged, only its paths moved into the test's directory
    return run.demo(output_dir=str(out / stage), config=str(CONFIGS[stage]), overrides={"model.pretrained": pretrained})


@pytest.mark.slow
def test_tiny_qwen3vl_learns_preferences_in_two_stages(tmp_path, capsys):
    from vlmtrain.models.families import get_family

    pretrained = get_family("qwen3_vl").build_tiny(str(tmp_path / "tiny-qwen3vl"), seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (as OMP_NUM_THREADS=1: one thread trains, the loader worker renders beside it)
    start = time.perf_counter()
    try:
        sft = demo("sft", tmp_path, pretrained)
        stage1 = str(tmp_path / "sft" / f"checkpoint-{sft['global_step']}")
        dpo, reward = demo("dpo", tmp_path, stage1), demo("reward", tmp_path, stage1)
    finally:
        torch.set_num_threads(threads)
    with capsys.disabled():
        print(f"\nshapes_pairs preference check: {time.perf_counter() - start:.0f} s; stage 1 exact match "
              f"{dpo['stage1_exact_match']:.3f}, stage 2 {dpo['eval_exact_match']:.3f}, preference accuracy "
              f"{dpo['eval_rewards/accuracies']:.3f}, reward head {reward['eval_reward_accuracy']:.3f}")
    assert dpo["eval_rewards/accuracies"] >= 0.95, dpo
    assert dpo["eval_exact_match"] > dpo["stage1_exact_match"], dpo
    assert reward["eval_reward_accuracy"] >= 0.95, reward
