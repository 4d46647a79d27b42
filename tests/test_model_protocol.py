"""The interfaces between the trainer and the model layer, which never import each other: the attribute names
both sides spell, the parts vlmtrain.Trainer takes from the model layer, the checkpoint-parts protocol of score heads, the data
layer's padding collator against the Trainer's default, and one direction of imports among the trainer's
checkpoint modules."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from optional_extras import requires
from tiny import tiny_llama, token_samples

import vlmtrain
from vlmtrain.data.collate import DefaultCollator
from vlmtrain.errors import CheckpointError
from vlmtrain.models import generation, protocol, sharding
from vlmtrain.models.files import head_files, lora_files, sharded_files
from vlmtrain.models.files import model_files as hub_model_files
from vlmtrain.models.objectives.heads import WithHeads
from vlmtrain.models.speed import flops, lm_loss, training_prep
from vlmtrain.trainer import model_files as core_files
from vlmtrain.trainer import optim
from vlmtrain.trainer.stats import num_items_of

SRC = Path(vlmtrain.__file__).parent
model_files = vlmtrain.Trainer.parts.model_files  # the format vlmtrain.Trainer writes checkpoints in


def test_the_attribute_names_models_set_are_the_ones_the_trainer_reads():
    assert protocol.MODULE_GROUPS_ATTR == optim.MODULE_GROUPS_ATTR
    assert protocol.REGIONAL_COMPILE_ATTR == training_prep.REGIONAL_COMPILE_ATTR
    assert sharded_files.DCP_DIR == core_files.DCP_DIR
    assert head_files.HEAD_PARTS.part_files == (head_files.HEADS_CONFIG, head_files.HEADS_WEIGHTS)
    model = tiny_llama()
    setattr(model.model, protocol.MODULE_GROUPS_ATTR, {"text": "model.layers", "head": ("lm_head",)})
    assert protocol.module_groups(model) == optim.module_groups(model) == {"text": ("model.layers",),
                                                                         "head": ("lm_head",)}


def test_a_step_hook_runs_before_each_optimizer_step(tmp_path):
    """A module carrying protocol.STEP_HOOK_ATTR (as the dummy vision input's VisionInput): cleared as training
    starts, then called on every optimizer step before clipping and the step; here it drops lm_head's gradient,
    and AdamW with weight decay leaves that weight as it was."""
    class DropHead:
        def __init__(self):
            self.calls = []

        def clear(self):
            self.calls.append("clear")

        def before_optimizer_step(self, module, any_rank):
            self.calls.append(any_rank(True))
            module.lm_head.weight.grad = None

    from vlmtrain.trainer import step

    assert protocol.STEP_HOOK_ATTR == step.STEP_HOOK_ATTR
    model, hook = tiny_llama(), DropHead()
    setattr(model, protocol.STEP_HOOK_ATTR, hook)
    before = model.lm_head.weight.detach().clone()
    args = vlmtrain.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                                      weight_decay=0.1, save_strategy="no", report_to="none", disable_tqdm=True)
    vlmtrain.Trainer(model, args, train_dataset=token_samples(8)).train()
    assert hook.calls == ["clear", True, True]
    assert torch.equal(model.lm_head.weight, before) and not torch.equal(model.model.norm.weight, torch.ones(32))


def test_vlmtrain_trainer_has_every_part_the_models_provide():
    parts = vlmtrain.Trainer.parts
    assert parts.flop_counter is flops.flop_counter
    assert parts.activation_checkpointing is training_prep.enable_activation_checkpointing
    assert parts.compile_model is training_prep.compile_model
    assert parts.generation is generation.GREEDY
    assert parts.model_files is hub_model_files.MODEL_FILES
    assert model_files.read_sharded is sharded_files.read_model_weights
    assert model_files.part_kinds == (lora_files.ADAPTER_PARTS, head_files.HEAD_PARTS)
    blocks = sharding.transformer_blocks(tiny_llama())  # (what parallel/fsdp.py shards one by one)
    assert blocks and all(type(b).__name__ == "LlamaDecoderLayer" for b in blocks)


def test_the_generation_slot_tells_which_generate_keeps_fsdp_ranks_in_step():
    """Evaluation lets FSDP ranks generate for different batches only with a generate that takes `synced_gpus`
    (transformers' does; so does a wrapper passing **kwargs on, as peft's)."""
    class FixedArguments(torch.nn.Module):
        def generate(self, input_ids, max_new_tokens=1):
            return input_ids

    class PassesOn(torch.nn.Module):
        def generate(self, **kwargs):
            return kwargs

    in_step = generation.GREEDY.generates_in_step
    assert in_step(tiny_llama()) and in_step(PassesOn())
    assert not in_step(FixedArguments()) and not in_step(torch.nn.Linear(1, 1))


def _with_heads() -> WithHeads:
    torch.manual_seed(0)
    return WithHeads(tiny_llama(), {"score": {"type": "regression"}})


def test_score_heads_save_and_load_as_a_checkpoint_part(tmp_path):
    model = _with_heads()
    assert model_files.has_score_heads(model) and not model_files.has_score_heads(model.base)
    model_files.save_model_files(model, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".json", ".safetensors")) == [
        "config.json", "generation_config.json", "heads.json", "heads.safetensors", "model.safetensors"]
    os.remove(tmp_path / "heads.safetensors")
    assert model_files.missing_weight_files(str(tmp_path)) == ["heads.safetensors"]
    model_files.save_model_files(model, str(tmp_path))
    other = _with_heads()
    with torch.no_grad():
        other.heads.layers.head_score.weight.add_(1.0)
        other.base.lm_head.weight.add_(1.0)
    model_files.load_model_weights(other, str(tmp_path))
    assert torch.equal(other.heads.layers.head_score.weight, model.heads.layers.head_score.weight)
    assert torch.equal(other.base.lm_head.weight, model.base.lm_head.weight)


def test_a_checkpoint_of_other_heads_fails_before_any_weight_is_read(tmp_path):
    model_files.save_model_files(_with_heads(), str(tmp_path))
    meta = json.loads((tmp_path / "heads.json").read_text())
    meta["heads"]["score"]["weight"] = 2.0
    (tmp_path / "heads.json").write_text(json.dumps(meta))
    other = _with_heads()
    before = other.base.lm_head.weight.clone()
    with torch.no_grad():
        other.base.lm_head.weight.add_(1.0)
    with pytest.raises(CheckpointError, match="the checkpoint's heads .* differ from the model's"):
        model_files.load_model_weights(other, str(tmp_path))
    assert not torch.equal(other.base.lm_head.weight, before)  # untouched


def test_gathered_weights_are_split_between_base_and_heads(tmp_path):
    """What FSDP gathers (keys as the whole model names them) is written as base files + heads files."""
    model = _with_heads()
    state = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    model_files.save_model_files(model, str(tmp_path), state_dict=state)
    loaded = _with_heads()
    model_files.load_model_weights(loaded, str(tmp_path))
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, state[key]), key


@requires("peft", "lora")
def test_a_lora_adapter_stands_in_for_the_base_weights(tmp_path):
    import peft

    def lora_model() -> torch.nn.Module:
        torch.manual_seed(0)
        return peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=2, target_modules=["q_proj"]))

    model = lora_model()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    assert model_files.saves_trainable_only(model) and not model_files.saves_trainable_only(model.base_model.model)
    model_files.save_model_files(model, str(tmp_path))
    assert (tmp_path / "adapter_model.safetensors").is_file() and not (tmp_path / "model.safetensors").exists()
    assert model_files.has_model_files(str(tmp_path)) and model_files.missing_weight_files(str(tmp_path)) == []
    other = lora_model()
    model_files.load_model_weights(other, str(tmp_path))
    for (name, a), b in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(CheckpointError, match="holds a LoRA adapter but the model has no LoRA adapters"):
        model_files.load_model_weights(tiny_llama(), str(tmp_path))
    os.remove(tmp_path / "adapter_model.safetensors")
    assert model_files.missing_weight_files(str(tmp_path)) == ["adapter_model.safetensors"]


def test_the_trainer_writes_model_files_in_the_model_layers_format(tmp_path):
    """vlmtrain.Trainer's model_files part writes the Hugging Face layouts (config.json beside the weights);
    the core's own (PlainModelFiles) writes a plain module's state dict as model.safetensors, loaded back by key."""
    model_files.save_model_files(tiny_llama(), str(tmp_path / "hub"))
    assert (tmp_path / "hub" / "config.json").is_file()


def test_the_format_saves_in_the_kinds_of_parts_it_is_made_with():
    assert model_files.has_score_heads(_with_heads())
    assert not hub_model_files.HubModelFiles((lora_files.ADAPTER_PARTS,)).has_score_heads(_with_heads())


def test_the_cores_own_format_round_trips_a_plain_module_as_model_safetensors(tmp_path):
    model_files = core_files.PlainModelFiles

    def plain(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False))
        model[1].weight = model[0].weight  # tied: written once
        return model

    model, directory = plain(0), str(tmp_path)
    assert model_files.missing_weight_files(directory) == ["model.safetensors"]
    model_files.save_model_files(model, directory, state_dict=model.state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert model_files.has_model_files(directory) and not model_files.has_score_heads(model)
    other = plain(1)
    model_files.load_model_weights(other, directory)
    assert torch.equal(other[1].weight, model[0].weight) and other[1].weight is other[0].weight
    with pytest.raises(CheckpointError, match="do not fit Linear: missing"):
        model_files.load_model_weights(torch.nn.Linear(4, 4), directory)


def test_a_causal_lm_loss_averages_over_the_shifted_labels_the_model_layer_counts():
    count = vlmtrain.Trainer.parts.loss_targets
    assert count is lm_loss.causal_lm_targets
    labels = torch.tensor([[-100, 5, 6, -100], [7, 8, 9, 10]])  # shifted: 2 + 3 targets
    assert num_items_of({"loss": torch.tensor(1.0)}, tiny_llama(), {"labels": labels}, count).item() == 5
    assert num_items_of({"loss": torch.tensor(1.0)}, torch.nn.Linear(2, 2), {"labels": labels}, count) is None
    assert num_items_of({"loss": torch.tensor(1.0)}, tiny_llama(), {"labels": labels}) is None  # (the core's)


def test_a_trainer_without_a_collator_pads_with_the_data_default_collator(tmp_path):
    """One default collator (data/collate.py), reached by the trainer through its default_collator part, with
    the pad id of the processing class."""
    assert vlmtrain.Trainer.parts.default_collator is DefaultCollator
    args = vlmtrain.TrainingArguments(output_dir=str(tmp_path), report_to="none")
    trainer = vlmtrain.Trainer(tiny_llama(), args, processing_class=SimpleNamespace(pad_token_id=5))
    assert type(trainer.data_collator) is DefaultCollator and trainer.data_collator.pad_token_id == 5
    batch = trainer.data_collator(token_samples(4, seed=1))
    assert (batch["input_ids"] == 5).any() and (batch["labels"] == -100).any()  # samples of different lengths


def _imports(path: Path) -> set[str]:
    """The modules of vlmtrain.trainer that ``path`` imports (relative imports, any depth)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def test_the_checkpoint_modules_import_each_other_in_one_direction_and_nothing_above():
    order = ["model_files", "sharding", "distributed", "checkpoint"]
    for i, name in enumerate(order):
        path = SRC / "trainer" / f"{name}.py"
        inside = _imports(path) & set(order)
        assert inside <= set(order[:i]), (name, inside)
        tree = ast.parse(path.read_text())
        above = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 2
                 and n.module not in ("errors",)]
        assert not above, (name, above)


def test_no_model_module_imports_the_trainer():
    for path in sorted((SRC / "models").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith("vlmtrain.trainer") or n.startswith("trainer") and node.level
                           for n in names), (path, names)
