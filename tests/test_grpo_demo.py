"""The GRPO learning demo (examples/grpo_shapes.py): a tiny Qwen3-VL SFT'd briefly on colour questions, then
GRPO with an exact-match reward; its report (held-out greedy exact match after SFT, after GRPO, chance), its
pieces (the reward, the prompts in TRL's vision layout, the held-out measure), and (slow) that the shipped
recipe learns (docs/grpo.md, "Proof that it learns")."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from vlmtrain.tasks.shapes_pairs import ShapesPairs

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "grpo_shapes.py"


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("grpo_shapes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_the_prompts_are_the_sft_questions_in_trls_vision_layout_and_the_reward_is_exact_match(demo):
    rows, sft = demo.Questions("train", 12, seed=5), ShapesPairs("train", 12, seed=5, pairs=False)
    for row, conversation in zip(rows, sft):
        (turn,) = conversation["texts"]
        assert row["prompt"] == [{"role": "user", "content": [{"type": "image"},
                                                              {"type": "text", "text": turn["user"]}]}]
        assert row["answer"] == turn["assistant"]
        assert row["images"][0].tobytes() == conversation["images"][0].tobytes()
    completions = [[{"role": "assistant", "content": " red"}], [{"role": "assistant", "content": "red."}], "blue"]
    assert demo.exact_match(completions, answer=["red", "red", "red"]) == [1.0, 0.0, 0.0]


def test_the_held_out_measure_counts_an_answer_right_when_it_is_the_truth(demo, tiny_hub):
    from vlmtrain import load_for_inference

    _, checkpoint, _ = tiny_hub("qwen3_vl")
    pairs = [dict(p) for p in ShapesPairs("val", 6, seed=0)]
    answers = load_for_inference(checkpoint, "cpu", "float32").generate(
        [{"images": p["images"], "texts": p["texts"]} for p in pairs], max_new_tokens=8)
    for pair, answer in zip(pairs[:4], answers):  # its own greedy answer is the truth for 4 of the 6
        pair["chosen"] = answer
    for pair, answer in zip(pairs[4:], answers[4:]):
        pair["chosen"] = answer + "x"
    assert demo.accuracy(checkpoint, pairs) == pytest.approx(4 / 6)


def test_the_demo_reports_the_sft_and_grpo_stages_beside_chance(demo, tiny_hub, tmp_path, capsys):
    """Both stages shortened (2 SFT steps, 1 GRPO step at a learning rate of 1e-12: the GRPO checkpoint is the SFT
    model): the report measures both the same, from their checkpoints (a GRPO checkpoint is the policy's)."""
    _, hub, _ = tiny_hub("qwen3_vl")
    got = demo.main(["--output-dir", str(tmp_path), "--pretrained", hub, "--eval", "4",
                     "--sft-set", "train.max_steps=2", "--sft-set", "train.save_steps=2",
                     "--set", "max_steps=1", "--set", "learning_rate=1e-12", "--set", "num_generations=2",
                     "--set", "per_device_train_batch_size=4"])
    printed = capsys.readouterr().out
    assert "after SFT" in printed and "after GRPO" in printed and "chance" in printed
    assert got["chance"] == pytest.approx(1 / 6) and f"{got['chance']:.3f}" in printed
    assert got["sft"] == got["grpo"]
    grpo = tmp_path / "grpo" / "checkpoint-1"
    from transformers import AutoModelForImageTextToText

    trained = AutoModelForImageTextToText.from_pretrained(grpo, dtype=torch.float32)  # (the policy, not GRPO's wrapper)
    (sft,) = (tmp_path / "sft").glob("checkpoint-*")
    before = AutoModelForImageTextToText.from_pretrained(sft, dtype=torch.float32)
    for (name, a), b in zip(trained.state_dict().items(), before.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=name)


@pytest.mark.slow
def test_the_grpo_demo_learns(demo, tmp_path):
    """The shipped script as it is (seed 0, one torch thread as CI runs it): GRPO raises the held-out greedy exact
    match well above the SFT start, which is clearly below the ceiling."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got = demo.main(["--output-dir", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert got["sft"] <= 0.8
    assert got["grpo"] >= got["sft"] + 0.2
