"""The two-stage preference demo: data.source shapes_pairs (one shape, a colour or shape question, as preference
pairs or as SFT conversations for stage 1), the report `vlmtrain demo --config configs/qwen3vl-tiny-pairs-dpo.yaml`
prints (stage 1 and stage 2 beside chance), and (slow) that the shipped recipe learns (docs/preference.md,
"Proof that it learns")."""

from __future__ import annotations

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


def test_the_dpo_demo_reports_stage_1_and_stage_2_beside_chance(tmp_path, tiny_hub, capsys):
    from vlmtrain import load_for_inference

    _, stage1, _ = tiny_hub("qwen3_vl")
    # a learning rate of 1e-12 (0 is refused): stage 2 is stage 1, so the report must measure both the same
    metrics = run.demo(output_dir=str(tmp_path / "dpo"), config=str(CONFIGS["dpo"]), overrides={
        "model.pretrained": stage1, "train.max_steps": 1, "train.save_steps": 1, "train.learning_rate": 1e-12,
        "data.num_train": 4, "data.num_eval": 6, "train.per_device_train_batch_size": 2,
        "train.dataloader_num_workers": 0})
    printed = capsys.readouterr().out
    for name in ("preference accuracy (eval_rewards/accuracies)", "greedy exact match", "chance", "stage 1"):
        assert name in printed
    for key in ("exact_match", "prefers_chosen", *(f"{q}_exact_match" for q in PAIR_QTYPES)):
        assert metrics[f"eval_{key}"] == metrics[f"stage1_{key}"], key
    pairs = ShapesPairs("val", 6, seed=0)
    answers = load_for_inference(stage1, "cpu", "float32").generate([{"images": p["images"], "texts": p["texts"]}
                                                                      for p in pairs], max_new_tokens=8)
    assert metrics["stage1_exact_match"] == sum(a == p["chosen"] for a, p in zip(answers, pairs)) / 6
    assert 0 <= metrics["stage1_prefers_chosen"] <= 1


def test_the_report_counts_an_answer_right_when_it_is_the_chosen_one(tiny_hub):
    from vlmtrain import load_for_inference
    from vlmtrain.data.hub_pairs import HubPairCollator
    from vlmtrain.evaluation.preference_demo import measure

    _, stage1, processor = tiny_hub("qwen3_vl")
    pairs = [dict(p) for p in ShapesPairs("val", 6, seed=0)]
    answers = load_for_inference(stage1, "cpu", "float32").generate([{"images": p["images"], "texts": p["texts"]}
                                                                      for p in pairs], max_new_tokens=8)
    for pair, answer in zip(pairs, answers):  # the model's own greedy answer chosen: all right
        pair["chosen"], pair["rejected"] = answer, answer + "x"
    got = measure(stage1, pairs, HubPairCollator(processor, 128, 1), "m")
    assert got["m_exact_match"] == 1.0 and {f"m_{q}_exact_match" for q in PAIR_QTYPES} <= set(got)
    assert 0 <= got["m_prefers_chosen"] <= 1


@pytest.mark.slow
def test_the_two_stage_preference_demo_learns(tmp_path):
    """The three shipped configs unchanged but for their paths (seed 0), as docs/preference.md runs them: DPO
    from the stage-1 SFT model reaches held-out preference accuracy >= 0.95 and a greedy exact match above stage
    1's; a reward head on stage 1 tells >= 0.95 of the held-out pairs apart."""
    from vlmtrain.models.families import get_family

    hub = get_family("qwen3_vl").build_tiny(str(tmp_path / "tiny-qwen3vl"), seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the docs run it (OMP_NUM_THREADS=1)
    try:
        run.demo(output_dir=str(tmp_path / "sft"), config=str(CONFIGS["sft"]), overrides={"model.pretrained": hub})
        (stage1,) = (tmp_path / "sft").glob("checkpoint-*")
        dpo = run.demo(output_dir=str(tmp_path / "dpo"), config=str(CONFIGS["dpo"]),
                       overrides={"model.pretrained": str(stage1)})
        reward = run.demo(output_dir=str(tmp_path / "reward"), config=str(CONFIGS["reward"]),
                          overrides={"model.pretrained": str(stage1)})
    finally:
        torch.set_num_threads(threads)
    assert dpo["eval_rewards/accuracies"] >= 0.95
    assert dpo["eval_exact_match"] > dpo["stage1_exact_match"] + 0.1
    assert reward["eval_reward_accuracy"] >= 0.95
