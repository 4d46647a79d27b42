"""The GRPO learning demo (configs/qwen3vl-tiny-pairs-grpo.yaml after configs/qwen3vl-tiny-pairs-sft.yaml): a tiny
Qwen3-VL SFT'd briefly on colour questions, then GRPO with an exact-match reward; the prompts data.source
shapes_pairs gives a GRPO run, the report `vlmtrain demo` prints (held-out greedy exact match after SFT, after
GRPO, chance), and (slow) that the shipped recipe learns (docs/grpo.md, "Proof that it learns")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vlmtrain import run
from vlmtrain.tasks.shapes_pairs import ShapesPairs

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {stage: ROOT / "configs" / f"qwen3vl-tiny-pairs-{stage}.yaml" for stage in ("sft", "grpo")}


def test_a_grpo_run_of_shapes_pairs_gets_fresh_colour_questions_as_prompts_with_their_answer():
    from vlmtrain.config import load_run_config
    from vlmtrain.tasks.shapes_pairs_source import build

    cfg = load_run_config(CONFIGS["grpo"], {"data.num_train": 12, "data.seed": 5})
    built = build(cfg)
    assert built["eval_dataset"] is None  # (the report measures greedy exact match itself: no GRPO evaluation)
    sft = ShapesPairs("train", 12, seed=5, pairs=False)
    rows = list(built["train_dataset"])
    assert len(rows) == 12
    for row in rows:
        assert set(row) == {"images", "texts", "answer", "qtype", "id"}
        assert row["texts"] == [{"user": "What color is the shape?"}] and len(row["images"]) == 1
    assert [r["answer"] for r in rows] == [s["texts"][0]["assistant"] for s in sft]  # (balanced colours, in turn)
    # fresh scenes: not the ones stage 1 trained on (the same data.seed)
    assert all(r["images"][0].tobytes() != s["images"][0].tobytes() for r, s in zip(rows, sft))


def test_the_grpo_demo_reports_greedy_exact_match_after_sft_and_after_grpo_beside_chance(tmp_path, tiny_hub, capsys):
    """Stage 2 shortened to one step at a learning rate of 1e-12 (0 is refused): its checkpoint is the stage-1
    model, so the report must measure both the same, each from its own checkpoint."""
    from vlmtrain import load_for_inference

    _, stage1, _ = tiny_hub("qwen3_vl")
    metrics = run.demo(output_dir=str(tmp_path / "grpo"), config=str(CONFIGS["grpo"]), overrides={
        "model.pretrained": stage1, "train.max_steps": 1, "train.save_steps": 1, "train.learning_rate": 1e-12,
        "train.num_generations": 2, "train.per_device_train_batch_size": 4, "data.num_train": 4,
        "data.num_eval": 6, "train.dataloader_num_workers": 0})
    printed = capsys.readouterr().out
    for name in ("greedy exact match", "after SFT", "after GRPO", "chance", "0.167"):
        assert name in printed, name
    assert metrics["eval_exact_match"] == metrics["stage1_exact_match"]
    pairs = ShapesPairs("val", 6, seed=0)
    answers = load_for_inference(stage1, "cpu", "float32").generate([{"images": p["images"], "texts": p["texts"]}
                                                                      for p in pairs], max_new_tokens=8)
    assert metrics["stage1_exact_match"] == sum(a.strip() == p["chosen"] for a, p in zip(answers, pairs)) / 6
    from transformers import AutoModelForImageTextToText

    (checkpoint,) = (tmp_path / "grpo").glob("checkpoint-*")
    trained = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32)  # (the policy)
    before = AutoModelForImageTextToText.from_pretrained(stage1, dtype=torch.float32)
    for (name, a), b in zip(trained.state_dict().items(), before.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=name)


def test_the_held_out_measure_counts_an_answer_right_when_it_is_the_truth(tiny_hub):
    from vlmtrain import load_for_inference
    from vlmtrain.evaluation.grpo_demo import exact_match

    _, checkpoint, _ = tiny_hub("qwen3_vl")
    pairs = [dict(p) for p in ShapesPairs("val", 6, seed=0)]
    answers = load_for_inference(checkpoint, "cpu", "float32").generate(
        [{"images": p["images"], "texts": p["texts"]} for p in pairs], max_new_tokens=8)
    for pair, answer in zip(pairs, answers):  # its own greedy answer is the truth for 4 of the 6
        pair["chosen"], pair["rejected"] = answer, answer + "x"
    for pair in pairs[4:]:
        pair["chosen"] = pair["chosen"] + "x"
    assert exact_match(checkpoint, pairs) == pytest.approx(4 / 6)


@pytest.mark.slow
def test_the_grpo_demo_learns(tmp_path):
    """The two shipped configs unchanged but for their paths (seed 0, one torch thread, as docs/grpo.md runs
    them): GRPO raises the held-out greedy exact match well above the SFT start, which is clearly below the
    ceiling."""
    from vlmtrain.models.families import get_family

    hub = get_family("qwen3_vl").build_tiny(str(tmp_path / "tiny-qwen3vl"), seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run.demo(output_dir=str(tmp_path / "sft"), config=str(CONFIGS["sft"]), overrides={"model.pretrained": hub})
        (stage1,) = (tmp_path / "sft").glob("checkpoint-*")
        got = run.demo(output_dir=str(tmp_path / "grpo"), config=str(CONFIGS["grpo"]),
                       overrides={"model.pretrained": str(stage1)})
    finally:
        torch.set_num_threads(threads)
    assert got["stage1_exact_match"] <= 0.8
    assert got["eval_exact_match"] >= got["stage1_exact_match"] + 0.2
