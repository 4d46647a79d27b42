"""precompute_ref_log_probs with pairs with images (TRL 1.16 refuses it): one pass of the reference over the train
and eval pairs before training, each pair's images encoded once in it as in training; the log-probs travel with
their pairs (shuffled, padding-free, a skipped pair left out first), so the per-step losses and metrics equal the
run whose reference runs beside the policy; the reference never runs while training, and a resumed run reads the
log-probs from its checkpoint instead of running the reference again. The same through a YAML config (model.kind
hub_vlm)."""

from __future__ import annotations

import json
import random

import pytest
import torch

import vlmtrain
from tests.test_dpo import reference_calls
from tests.test_dpo_vision import METRICS, TowerCounter, _file_pairs, _pair, _pairs, qwen3_vl  # noqa: F401 (a fixture)

TRAIN_PAIRS = 10  # (and one pair whose prompt fills max_length: skipped, left out of the precomputation)


def _train_pairs(with_long: bool) -> list[dict]:
    """The train pairs; ``with_long``: and a pair whose prompt fills max_length (its batch would train one pair
    less: the live run, given the pairs without it, batches as the precomputed run, which leaves it out first)."""
    pairs = _pairs(TRAIN_PAIRS, 0)
    if not with_long:
        return pairs
    long = _pair(random.Random(3), 1)
    long["prompt"][0]["content"][-1]["text"] = " ".join(["big"] * 300)  # (fills max_length before any answer)
    return pairs[:4] + [long] + pairs[4:]


def _run(path, processor, out, precompute: bool, padding_free: bool, resume: str | None = None) -> dict:
    """A full fine-tune (the reference: a frozen copy, or the policy before it trains when precomputed) on the
    train pairs, shuffled, batch 2, AdamW with weight decay, a checkpoint every 3 steps, then an evaluation.
    Returns the logged steps, the evaluation, the policy's weights, the reference's calls (counted) and the
    images the vision tower encoded."""
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText

    args = vlmtrain.DPOConfig(str(out), max_length=160, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                              num_train_epochs=1, learning_rate=3e-3, weight_decay=0.1, logging_steps=1, seed=7,
                              bf16=False, gradient_checkpointing=False, report_to="none", save_strategy="steps",
                              save_steps=3, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
                              padding_free=padding_free, precompute_ref_log_probs=precompute)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    with reference_calls() as calls:
        trainer = vlmtrain.DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(_train_pairs(precompute)),
                                      eval_dataset=Dataset.from_list(_pairs(4, 1)), processing_class=processor)
        towers = [TowerCounter(model.model.visual)]
        if trainer.ref_model is not None:
            towers.append(TowerCounter(trainer.ref_model.model.visual))
        trainer.train(resume_from_checkpoint=resume)
        before_eval = len(calls)
        evaluation = trainer.evaluate()
    return {"logs": [e for e in trainer.state.log_history if "loss" in e], "eval": evaluation,
            "weights": {k: v.detach().clone() for k, v in trainer.policy.named_parameters()},
            "calls": before_eval, "images": sum(t.images for t in towers), "trainer": trainer}


@pytest.fixture(scope="module")
def runs(qwen3_vl, tmp_path_factory):  # noqa: F811 (the fixture)
    """The live-reference and precomputed runs, padded and padding-free."""
    path, processor = qwen3_vl
    out = tmp_path_factory.mktemp("precompute_vision")
    return {(precompute, padding_free): _run(path, processor, out / f"{precompute}-{padding_free}", precompute,
                                             padding_free)
            for precompute in (False, True) for padding_free in (False, True)}


def _images(pairs: list[dict]) -> int:
    return sum(len(p["images"]) for p in pairs)


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding_free"])
def test_precomputed_vision_reference_equals_the_live_reference(runs, padding_free):
    """Per-step loss and TRL's metrics (rel 1e-5) and the final weights of the precomputed run are the run's whose
    reference runs beside the policy, and so is the evaluation; the reference ran once per batch of the pass before
    training (5 train batches: the skipped pair left out; 2 eval batches), never in a training step, and the
    vision tower encoded each pair's images once in that pass."""
    live, pre = runs[(False, padding_free)], runs[(True, padding_free)]
    assert len(live["logs"]) == len(pre["logs"]) == TRAIN_PAIRS // 2
    for step, (theirs, ours) in enumerate(zip(live["logs"], pre["logs"]), 1):
        for key in METRICS:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (step, key)
    assert pre["logs"][-1]["rewards/margins"] != pytest.approx(0.0, abs=1e-5)  # (the policy moved)
    for key in METRICS[:7]:
        assert pre["eval"]["eval_" + key] == pytest.approx(live["eval"]["eval_" + key], rel=1e-5, abs=1e-6), key
    for name, value in pre["weights"].items():
        torch.testing.assert_close(value, live["weights"][name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert live["calls"] == TRAIN_PAIRS // 2  # (a reference forward per training step)
    assert pre["calls"] == TRAIN_PAIRS // 2 + 2  # (the pass: 5 train batches, 2 eval batches; then none)
    assert pre["trainer"].ref_model is None  # (a full fine-tune keeps no second copy)
    # each pair's images encoded once per forward: live, by the policy and the reference in each step and in the
    # evaluation; precomputed, by the policy there and once in the pass before training (train and eval pairs)
    once = _images(_pairs(TRAIN_PAIRS, 0)) + _images(_pairs(4, 1))
    assert live["images"] == pre["images"] == 2 * once


def test_precomputed_vision_resume_reads_the_checkpoint(runs, qwen3_vl, tmp_path):  # noqa: F811
    """Resumed from checkpoint-3 by a new DPOTrainer given the original model: steps 4-5 and the final weights are
    the uninterrupted run's, and the reference does not run (the log-probs come from the checkpoint's
    ref_logps.pt)."""
    path, processor = qwen3_vl
    first = runs[(True, False)]
    checkpoint = first["trainer"].args.output_dir + "/checkpoint-3"
    resumed = _run(path, processor, tmp_path / "resumed", True, False, resume=checkpoint)
    assert resumed["calls"] == 0
    assert [e["step"] for e in resumed["logs"]][-2:] == [4, 5]
    for theirs, ours in zip(first["logs"][3:], resumed["logs"][3:]):
        for key in METRICS[:7]:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-7), (ours["step"], key)
    for name, value in resumed["weights"].items():
        torch.testing.assert_close(value, first["weights"][name], rtol=1e-6, atol=1e-7)


def test_yaml_precomputed_vision_reference_equals_the_live_reference(qwen3_vl, tmp_path, one_thread):  # noqa: F811
    """`vlmtrain train` with train.precompute_ref_log_probs on model.kind hub_vlm (pairs with images from a JSONL,
    both layouts; a pair with more images than data.max_images skipped before the pass): the per-step losses and
    metrics of the live-reference run (rel 1e-5); resumed from checkpoint-2, steps 3-4 equal the uninterrupted
    run's, read from the checkpoint's ref_logps.pt."""
    import yaml

    from vlmtrain import cli

    path, _ = qwen3_vl
    rows, _ = _file_pairs(tmp_path, 8, 0)
    eval_rows, _ = _file_pairs(tmp_path, 4, 1)
    # (3 images > data.max_images 2: skipped; the live run's batches would hold one pair less, so it reads the
    # pairs without it, batched as the precomputed run's, which leaves it out before its pass)
    too_many = {**rows[1], "images": [rows[1]["images"][0]] * 3}
    with_skip = [*rows[:3], too_many, *rows[3:]]
    for name, data in (("train-True", with_skip), ("train-False", rows), ("eval", eval_rows)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    cfg = {"model": {"kind": "hub_vlm", "pretrained": str(path), "torch_dtype": "float32"},
           "data": {"source": "jsonl", "eval_file": str(tmp_path / "eval.jsonl"), "max_length": 512, "max_images": 2},
           "train": {"objective": "dpo", "learning_rate": 3e-3, "weight_decay": 0.1, "logging_steps": 1, "seed": 7,
                     "report_to": "none", "dataloader_num_workers": 0, "disable_tqdm": True,
                     "per_device_train_batch_size": 2, "per_device_eval_batch_size": 2, "max_steps": 4,
                     "save_strategy": "steps", "save_steps": 2}}
    config = tmp_path / "dpo.yaml"
    config.write_text(yaml.safe_dump(cfg))

    def losses(out) -> list[dict]:
        return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    runs = {}
    for precompute in (False, True):
        out = tmp_path / f"run-{precompute}"
        settings = ["--train.output_dir", str(out), "--train.precompute_ref_log_probs", str(precompute).lower(),
                    "--data.train_file", str(tmp_path / f"train-{precompute}.jsonl")]
        assert cli.main(["train", "--config", str(config), *settings]) == 0
        runs[precompute] = losses(out)
        assert (out / "checkpoint-2" / "ref_logps.pt").exists() == precompute
    assert len(runs[True]) == len(runs[False]) == 4
    for mine, theirs in zip(runs[True], runs[False]):
        for key in METRICS[:7]:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (mine["step"], key)
    with reference_calls() as calls:
        resumed = tmp_path / "resumed"
        assert cli.main(["train", "--config", str(config), "--train.output_dir", str(resumed),
                         "--train.precompute_ref_log_probs", "true", "--data.train_file",
                         str(tmp_path / "train-True.jsonl"), "--train.resume_from_checkpoint", str(tmp_path / "run-True" / "checkpoint-2")]) == 0
    assert calls == []  # (the log-probs read from checkpoint-2)
    for mine, theirs in zip(losses(resumed), runs[True][2:]):
        for key in METRICS[:7]:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-7), (mine["step"], key)
