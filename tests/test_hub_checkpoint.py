"""Checkpoints of a Hub VLM (tiny Qwen3-VL): plain, with score heads, with LoRA. They load back with transformers
alone, resume exactly, count as complete when sharded or an adapter, rotate, load the best, and export merged."""

from __future__ import annotations

import json
import os

import pytest
import safetensors.torch
import torch
from optional_extras import requires
from test_lora import (
    HEADS,
    collate,
    collate_heads,
    load_tiny,
    perturb_adapters,
    tiny_dir,  # noqa: F401  (a fixture)
    vlm_samples,
)
from transformers import AutoModelForImageTextToText

from vlmtrain import Trainer, TrainingArguments
from vlmtrain.cli import main
from vlmtrain.models.families.qwen3_vl import FAMILY
from vlmtrain.models.files.head_files import load_heads
from vlmtrain.models.hub.lora import apply_lora
from vlmtrain.models.objectives.heads import WithHeads
from vlmtrain.trainer import CheckpointError, TrainerCallback
from vlmtrain.trainer import checkpoint as ckpt

pytestmark = [requires("peft", "lora"), pytest.mark.usefixtures("one_thread")]

LORA = {"r": 4, "alpha": 8, "dropout": 0.1}  # dropout: resume must restore the RNG too


def build(path: str, variant: str, seed: int = 0):
    """The model a run of `variant` trains: heads and LoRA initialize from torch's RNG (seeded here)."""
    torch.manual_seed(seed)
    model = load_tiny(path)
    if "heads" in variant:
        model = WithHeads(model, HEADS)
    if "lora" in variant:
        model = apply_lora(model, LORA, FAMILY.text_module)
    return model


def make_args(out, **overrides) -> TrainingArguments:
    kwargs = dict(output_dir=str(out), max_steps=4, per_device_train_batch_size=2, learning_rate=5e-3,
                  logging_steps=1, save_steps=2, disable_tqdm=True, seed=0)
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def trainer_for(model, out, samples, **overrides) -> Trainer:
    heads = hasattr(model, "heads")
    return Trainer(model, make_args(out, **overrides), data_collator=collate_heads if heads else collate,
                   train_dataset=samples, **({"eval_dataset": samples[:4]} if "eval_strategy" in overrides else {}))


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def losses(trainer: Trainer) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def samples(tiny_dir):  # noqa: F811
    return vlm_samples(load_tiny(tiny_dir).config, 12, seed=3)


def frozen_logits(model, batch):
    with torch.no_grad():
        return model.eval()(**batch)


# -- what a checkpoint holds ------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["plain", "heads"])
def test_checkpoint_loads_with_transformers_alone(tiny_dir, samples, tmp_path, variant):  # noqa: F811
    trainer = trainer_for(build(tiny_dir, variant), tmp_path, samples, max_steps=2)
    trainer.train()
    path = tmp_path / "checkpoint-2"
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    assert ("heads" in variant) == (path / "heads.safetensors").is_file()
    batch = collate(samples[:2])
    ref = frozen_logits(trainer.model, batch)
    loaded = AutoModelForImageTextToText.from_pretrained(path)
    if "heads" in variant:  # transformers loads the base; vlmtrain adds the heads
        loaded = WithHeads(loaded, HEADS)
        load_heads(loaded, str(path))
    got = frozen_logits(loaded, batch)
    assert torch.equal(got["logits"], ref["logits"])
    if "heads" in variant:
        assert torch.equal(got["logits_score"], ref["logits_score"]) and torch.equal(got["logits_kind"],
                                                                                   ref["logits_kind"])


def test_lora_checkpoint_holds_adapter_and_heads_not_full_weights(tiny_dir, samples, tmp_path):  # noqa: F811
    trainer = trainer_for(build(tiny_dir, "lora+heads"), tmp_path, samples, max_steps=2)
    trainer.train()
    path = tmp_path / "checkpoint-2"
    names = set(os.listdir(path))
    assert {"adapter_model.safetensors", "adapter_config.json", "heads.safetensors", "heads.json"} <= names
    assert not any(n.startswith("model") and n.endswith((".safetensors", ".json")) for n in names)
    saved = safetensors.torch.load_file(path / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    n_trainable_base = sum(p.numel() for n, p in trainer.model.base.named_parameters() if p.requires_grad)
    assert sum(t.numel() for t in saved.values()) == n_trainable_base
    ckpt.check_complete(str(path), files=Trainer.parts.model_files)
    # transformers alone (with peft installed) loads base + adapter from the checkpoint
    batch = collate(samples[:2])
    ref = frozen_logits(trainer.model.base, batch)["logits"]
    loaded = AutoModelForImageTextToText.from_pretrained(path)
    torch.testing.assert_close(frozen_logits(loaded, batch)["logits"], ref, atol=1e-5, rtol=0)


# -- exact resume --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["plain", "heads", "lora", "lora+heads"])
def test_resume_is_exact(tiny_dir, samples, tmp_path, variant):  # noqa: F811
    straight = trainer_for(build(tiny_dir, variant), tmp_path / "a", samples)
    straight.train()
    first = trainer_for(build(tiny_dir, variant), tmp_path / "b", samples)
    first.add_callback(StopAt(2))
    first.train()
    assert first.state.global_step == 2
    resumed = trainer_for(build(tiny_dir, variant, seed=9), tmp_path / "b", samples)  # other init: all loaded
    resumed.train(resume_from_checkpoint=True)
    assert losses(straight) == {**losses(first), **losses(resumed)} and len(losses(straight)) == 4
    want, got = trainable(straight.model), trainable(resumed.model)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_sharded_checkpoint_is_complete_and_resumes_exactly(tiny_dir, samples, tmp_path):  # noqa: F811
    straight = trainer_for(build(tiny_dir, "heads"), tmp_path / "a", samples)
    straight.train()
    first = trainer_for(build(tiny_dir, "heads"), tmp_path / "b", samples)
    first.add_callback(StopAt(2))
    first.train()
    path = str(tmp_path / "b" / "checkpoint-2")
    os.remove(os.path.join(path, "model.safetensors"))  # re-write the weights as shards with an index
    Trainer.parts.model_files.save_model_files(first.model, path, max_shard_size="40KB")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    assert len(shards) > 2 and not os.path.exists(os.path.join(path, "model.safetensors"))
    ckpt.check_complete(path, files=Trainer.parts.model_files)

    resumed = trainer_for(build(tiny_dir, "heads", seed=9), tmp_path / "b", samples)
    resumed.train(resume_from_checkpoint=True)
    assert losses(straight) == {**losses(first), **losses(resumed)}
    want, got = trainable(straight.model), trainable(resumed.model)
    assert all(torch.equal(want[k], got[k]) for k in want)

    os.remove(os.path.join(path, shards[1]))
    with pytest.raises(CheckpointError, match=shards[1]):
        ckpt.check_complete(path, files=Trainer.parts.model_files)


@pytest.mark.parametrize("removed", ["adapter_model.safetensors", "heads.safetensors"])
def test_adapter_checkpoint_missing_a_file_is_incomplete(tiny_dir, samples, tmp_path, removed):  # noqa: F811
    trainer_for(build(tiny_dir, "lora+heads"), tmp_path, samples, max_steps=2).train()
    os.remove(tmp_path / "checkpoint-2" / removed)
    with pytest.raises(CheckpointError, match=removed):
        ckpt.check_complete(str(tmp_path / "checkpoint-2"), files=Trainer.parts.model_files)


def test_full_checkpoint_into_a_lora_model_names_the_mismatch(tiny_dir, samples, tmp_path):  # noqa: F811
    trainer_for(build(tiny_dir, "plain"), tmp_path, samples, max_steps=2).train()
    with pytest.raises(CheckpointError, match="full weights but the model carries LoRA"):
        Trainer.parts.model_files.load_model_weights(build(tiny_dir, "lora"), str(tmp_path / "checkpoint-2"))


def test_legacy_key_names_load_through_from_pretrained(tmp_path):
    """Qwen2.5-VL's save_pretrained writes legacy key names (model.layers.* for model.language_model.layers.*):
    loading matches them through transformers' own renaming, not by raw key."""
    from vlmtrain.models.families import get_family

    path = get_family("qwen2_5_vl").build_tiny(str(tmp_path / "q25"), seed=0)
    written = safetensors.torch.load_file(os.path.join(path, "model.safetensors"))
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert set(written) != set(model.state_dict())  # the premise: names differ
    torch.manual_seed(5)
    fresh = type(model)(model.config)
    assert not torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    Trainer.parts.model_files.load_model_weights(fresh, path)
    want = model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())


# -- rotation, best model -----------------------------------------------------------------------------------
def test_rotation_and_best_model_with_adapter_checkpoints(tiny_dir, samples, tmp_path):  # noqa: F811
    saved, present = {}, {}

    class Snapshot(TrainerCallback):
        def on_save(self, args, state, control, model=None, **kwargs):
            saved[state.global_step] = trainable(model)
            present[state.global_step] = {k for k in os.listdir(args.output_dir) if k.startswith("checkpoint-")}

    trainer = trainer_for(build(tiny_dir, "lora+heads"), tmp_path, samples, max_steps=6, learning_rate=0.2,
                          eval_strategy="steps", eval_steps=2, save_total_limit=1, load_best_model_at_end=True,
                          metric_for_best_model="eval_loss")
    trainer.add_callback(Snapshot())
    trainer.train()
    best = trainer.state.best_model_checkpoint
    kept = sorted(os.listdir(tmp_path))
    assert best is not None and os.path.basename(best) in kept
    # During training the newest checkpoint stays beside the best one (resumable); when training ends
    # save_total_limit=1 leaves the best one only, as transformers' Trainer does.
    assert present[6] == {os.path.basename(best), "checkpoint-6"}
    assert {k for k in kept if k.startswith("checkpoint-")} == {os.path.basename(best)}
    best_step = int(best.rsplit("-", 1)[1])
    got = trainable(trainer.model)
    assert all(torch.equal(got[k], saved[best_step][k]) for k in got)
    if best_step != 6:  # loading the best really changed the weights back
        assert any(not torch.equal(got[k], saved[6][k]) for k in got)


# -- export --merge ------------------------------------------------------------------------------------------
def test_export_merge_writes_full_weights_with_the_adapters_logits(tiny_dir, samples, tmp_path, capsys):  # noqa: F811
    model = build(tiny_dir, "lora+heads")
    trainer = trainer_for(model, tmp_path / "run", samples, max_steps=2)
    trainer.train()
    path = tmp_path / "run" / "checkpoint-2"
    perturb_adapters(model)  # larger adapters than 2 steps make, so merging is not trivially exact
    Trainer.parts.model_files.save_model_files(model, str(path), FAMILY.load_processor(tiny_dir))
    batch = collate(samples[:2])
    ref = frozen_logits(model, batch)

    out = tmp_path / "merged"
    assert main(["export", "--checkpoint", str(path), "--merge", "--output-dir", str(out)]) == 0
    names = set(os.listdir(out))
    assert {"model.safetensors", "config.json", "heads.safetensors", "heads.json", "tokenizer.json"} <= names
    assert not {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "trainer_state.json"} & names
    merged = AutoModelForImageTextToText.from_pretrained(out)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with_heads = WithHeads(merged, HEADS)
    load_heads(with_heads, str(out))
    got = frozen_logits(with_heads, batch)
    torch.testing.assert_close(got["logits"], ref["logits"], atol=1e-5, rtol=0)
    torch.testing.assert_close(got["logits_score"], ref["logits_score"], atol=1e-5, rtol=0)


def test_export_merge_of_a_full_checkpoint_is_a_clear_error(tiny_dir, samples, tmp_path, capsys):  # noqa: F811
    trainer_for(build(tiny_dir, "plain"), tmp_path, samples, max_steps=2).train()
    assert main(["export", "--checkpoint", str(tmp_path / "checkpoint-2"), "--merge"]) == 2
    err = capsys.readouterr().err
    assert "no LoRA adapter" in err and "nothing to merge" in err
