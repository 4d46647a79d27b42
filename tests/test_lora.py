"""LoRA through peft on a tiny Qwen3-VL: default targets, heads, merging, bf16, and module-group aliases."""

from __future__ import annotations

import pytest
import torch
from optional_extras import requires
from torch import nn
from transformers import AutoModelForImageTextToText

from vlmtrain import TrainingArguments
from vlmtrain.errors import ConfigError
from vlmtrain.models.families.qwen3_vl import FAMILY
from vlmtrain.models.hub.lora import apply_lora, is_lora, merge_lora
from vlmtrain.models.objectives.heads import WithHeads
from vlmtrain.trainer.optim import build_param_groups

pytestmark = [requires("peft", "lora"), pytest.mark.usefixtures("one_thread")]

HEADS = {"score": {"type": "regression"}, "kind": {"type": "classification", "num_outputs": 3}}
IMAGE_TOKENS = 4  # a 32 px image: 4x4 patches of 8 px, merged 2x2


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """A tiny random-init Qwen3-VL written by save_pretrained (the family's offline builder)."""
    return FAMILY.build_tiny(str(tmp_path_factory.mktemp("qwen3vl") / "tiny"), seed=0)


def load_tiny(path: str, groups: bool = True, **kwargs) -> nn.Module:
    """The tiny model as the hub_vlm kind gives it: from_pretrained, with the family's module-group aliases."""
    model = AutoModelForImageTextToText.from_pretrained(path, **kwargs)
    if groups:
        model.vlmtrain_module_groups = dict(FAMILY.module_groups)
    return model


def vlm_samples(config, n: int, seed: int = 0, text_len: int = 8) -> list[dict]:
    """Samples of one 32 px image (random patches) and text; the first 6 positions are not targets; head labels
    for HEADS. All the same length, so batches need no padding."""
    g = torch.Generator().manual_seed(seed)
    vis = config.vision_config
    patch_dim = vis.in_channels * vis.temporal_patch_size * vis.patch_size ** 2
    out = []
    for _ in range(n):
        text = torch.randint(0, 250, (text_len,), generator=g).tolist()
        ids = [config.vision_start_token_id] + [config.image_token_id] * IMAGE_TOKENS + [config.vision_end_token_id]
        ids += text
        out.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": [-100] * 6 + text,
                    "mm_token_type_ids": [0] + [1] * IMAGE_TOKENS + [0] * (1 + text_len),
                    "pixel_values": torch.randn(16, patch_dim, generator=g),
                    "image_grid_thw": torch.tensor([[1, 4, 4]]),
                    "labels_score": float(torch.rand((), generator=g)),
                    "labels_kind": int(torch.randint(0, 3, (), generator=g))})
    return out


def collate(samples: list[dict], heads: bool = False) -> dict[str, torch.Tensor]:
    """Qwen's layout: token keys stacked, pixel_values / image_grid_thw concatenated in sample order."""
    batch = {k: torch.tensor([s[k] for s in samples]) for k in ("input_ids", "attention_mask", "labels",
                                                                  "mm_token_type_ids")}
    batch["pixel_values"] = torch.cat([s["pixel_values"] for s in samples])
    batch["image_grid_thw"] = torch.cat([s["image_grid_thw"] for s in samples])
    if heads:
        batch["labels_score"] = torch.tensor([s["labels_score"] for s in samples])
        batch["labels_kind"] = torch.tensor([s["labels_kind"] for s in samples])
    return batch


def collate_heads(samples: list[dict]) -> dict[str, torch.Tensor]:
    return collate(samples, heads=True)


def perturb_adapters(model: nn.Module, seed: int = 1) -> None:
    """lora_B starts at zero (the adapter is a no-op); give it values so merging has something to merge."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def lora_layers(model: nn.Module) -> list[str]:
    return sorted(n.removeprefix("base_model.model.") for n, m in model.named_modules() if hasattr(m, "lora_A"))


# -- targets ----------------------------------------------------------------------------------------------------
def test_default_targets_are_the_language_models_linear_layers_only(tiny_dir):
    plain = load_tiny(tiny_dir)
    text_linears = sorted(n for n, m in plain.named_modules()
                          if isinstance(m, nn.Linear) and n.startswith("model.language_model."))
    vision_linears = [n for n, m in plain.named_modules() if isinstance(m, nn.Linear) and "visual" in n]
    assert len(text_linears) == 2 * 7 and vision_linears  # q,k,v,o,gate,up,down per layer; the tower has some

    model = apply_lora(plain, {"r": 4, "alpha": 8, "dropout": 0.0}, FAMILY.text_module)
    assert is_lora(model)
    assert lora_layers(model) == text_linears  # no vision tower, no merger, no lm_head
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    q = model.get_submodule("base_model.model.model.language_model.layers.0.self_attn.q_proj")
    assert q.lora_A["default"].weight.shape == (4, 64) and q.scaling["default"] == 2.0


def test_target_modules_by_name_stay_in_the_language_model(tiny_dir):
    model = apply_lora(load_tiny(tiny_dir), {"r": 2, "target_modules": ["q_proj", "v_proj"]}, FAMILY.text_module)
    assert lora_layers(model) == sorted(f"model.language_model.layers.{i}.self_attn.{m}"
                                        for i in range(2) for m in ("q_proj", "v_proj"))


@pytest.mark.parametrize("spec, match", [
    ({"r": 4, "rank": 8}, r"model\.lora\.rank"),
    ({"r": 4, "dropuot": 0.1}, r"model\.lora\.dropuot.*dropout"),
    ({"r": 0}, r"model\.lora\.r must be a positive integer"),
    ({"dropout": 1.5}, r"model\.lora\.dropout"),
    ({"target_modules": ["qkv"]}, r"model\.lora\.target_modules \['qkv'\].*q_proj"),
    ({"modules_to_save": ["nowhere"]}, r"model\.lora\.modules_to_save: 'nowhere'"),
])
def test_bad_lora_spec_names_the_key(tiny_dir, spec, match):
    with pytest.raises(ConfigError, match=match):
        apply_lora(load_tiny(tiny_dir), spec, FAMILY.text_module)


def test_modules_to_save_accepts_a_module_group_alias(tiny_dir):
    model = apply_lora(load_tiny(tiny_dir), {"r": 2, "modules_to_save": ["projector"]}, FAMILY.text_module)
    full = {n.split(".modules_to_save.")[0].removeprefix("base_model.model.")
            for n, p in model.named_parameters() if p.requires_grad and ".modules_to_save." in n}
    assert full == {"model.visual.merger", "model.visual.deepstack_merger_list.0"}


# -- heads, merging, bf16 -------------------------------------------------------------------------------------------
def test_lora_under_heads_wraps_the_base_and_keeps_heads_trainable(tiny_dir):
    model = WithHeads(load_tiny(tiny_dir), HEADS)
    same = apply_lora(model, {"r": 4}, FAMILY.text_module)
    assert same is model and is_lora(model) and lora_layers(model.base)
    batch = collate_heads(vlm_samples(model.base.config, 2))
    out = model(**batch)
    assert {"loss_lm", "loss_score", "loss_kind"} <= set(out)
    out["loss"].backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    heads = {n for n, _ in model.heads.named_parameters(prefix="heads")}
    assert with_grad == heads | {n for n, _ in model.named_parameters() if "lora_" in n}  # base stays frozen
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n in heads or "lora_B" in n)


@pytest.mark.parametrize("heads", [False, True])
def test_merge_lora_gives_a_plain_model_with_the_adapters_logits(tiny_dir, heads):
    base = load_tiny(tiny_dir).eval()
    model = WithHeads(base, HEADS).eval() if heads else base
    model = apply_lora(model, {"r": 4, "alpha": 8}, FAMILY.text_module)
    perturb_adapters(model)
    batch = collate(vlm_samples(base.config, 2))
    with torch.no_grad():
        before = model(**batch)
        merged = merge_lora(model)
        after = merged(**batch)
    assert not is_lora(merged) and not any("lora" in n for n, _ in merged.named_parameters())
    plain = merged.base if heads else merged
    assert type(plain).__name__ == "Qwen3VLForConditionalGeneration"
    torch.testing.assert_close(after["logits"], before["logits"], atol=1e-5, rtol=0)
    if heads:
        torch.testing.assert_close(after["logits_kind"], before["logits_kind"], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="no LoRA adapter"):
        merge_lora(merged)


def test_lora_on_a_bfloat16_base_trains_float32_adapters(tiny_dir):
    model = apply_lora(WithHeads(load_tiny(tiny_dir, dtype=torch.bfloat16), HEADS), {"r": 4}, FAMILY.text_module)
    perturb_adapters(model)
    frozen = {p.dtype for n, p in model.base.named_parameters() if not p.requires_grad}
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16} and {p.dtype for p in trainable.values()} == {torch.float32}
    out = model(**collate_heads(vlm_samples(model.base.config, 2)))
    assert torch.isfinite(out["loss"])
    out["loss"].backward()
    grads = {n: p.grad for n, p in trainable.items()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "lora_A" in n or n.startswith("heads."))


def test_trainer_trains_lora_on_a_bfloat16_base_with_gradient_checkpointing(tiny_dir, tmp_path):
    from vlmtrain import Trainer

    model = apply_lora(WithHeads(load_tiny(tiny_dir, dtype=torch.bfloat16), HEADS), {"r": 4}, FAMILY.text_module)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2,
                             logging_steps=1, save_strategy="no", disable_tqdm=True, gradient_checkpointing=True)
    trainer = Trainer(model, args, data_collator=collate_heads, train_dataset=vlm_samples(model.base.config, 4))
    trainer.train()
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in trainer.state.log_history if "loss" in e)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {n for n, p in model.named_parameters() if p.requires_grad}  # adapters, heads: all moved
    assert all(".lora_" in n or n.startswith("heads.") for n in changed)


# -- module-group aliases ----------------------------------------------------------------------------------------
def groups_by_name(model: nn.Module, lrs: dict[str, float], **kw) -> dict[str, tuple[float, set[str]]]:
    args = TrainingArguments(output_dir="unused", learning_rate=1e-4, module_learning_rates=lrs, **kw)
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, tuple[float, set[str]]] = {}
    for group in build_param_groups(model, args):
        lr, params = out.get(group["name"], (group["lr"], set()))
        out[group["name"]] = (lr, params | {names[id(p)] for p in group["params"]})
    return out


def test_aliases_map_to_the_familys_modules(tiny_dir):
    model = load_tiny(tiny_dir)
    groups = groups_by_name(model, {"vision": 0.0, "projector": 1e-3, "text": 2e-5})
    assert set(groups) == {"projector", "text"}
    assert groups["projector"][0] == 1e-3 and groups["text"][0] == 2e-5
    assert groups["projector"][1] == {n for n, _ in model.named_parameters()
                                      if ".merger." in n or ".deepstack_merger_list." in n}
    assert groups["text"][1] == {n for n, _ in model.named_parameters()
                                 if n.startswith(("model.language_model.", "lm_head."))}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and frozen == {n for n, _ in model.named_parameters()
                                 if n.startswith("model.visual.") and "merger" not in n}


def test_an_explicit_module_name_beats_its_alias(tiny_dir):
    groups = groups_by_name(load_tiny(tiny_dir), {"text": 2e-5, "lm_head": 1e-3})
    assert groups["lm_head"][1] == {"lm_head.weight"}
    assert "lm_head.weight" not in groups["text"][1]


def test_aliases_work_through_heads_and_lora(tiny_dir):
    model = apply_lora(WithHeads(load_tiny(tiny_dir), HEADS), {"r": 2, "modules_to_save": ["projector"]},
                       FAMILY.text_module)
    groups = groups_by_name(model, {"vision": 0.0, "projector": 1e-3, "text": 5e-4})
    assert set(groups) == {"default", "projector", "text"}
    assert groups["default"][1] == {n for n, _ in model.heads.named_parameters(prefix="heads")}
    assert groups["text"][1] == {n for n, _ in model.named_parameters() if "lora_" in n}
    assert groups["projector"][1] == {n for n, _ in model.named_parameters() if ".modules_to_save." in n}
    # freezing an alias under peft: the adapters of the language model stop training
    model2 = apply_lora(WithHeads(load_tiny(tiny_dir), HEADS), {"r": 2}, FAMILY.text_module)
    assert set(groups_by_name(model2, {"text": 0.0})) == {"default"}
    assert not any(p.requires_grad for n, p in model2.named_parameters() if "lora_" in n)


def test_unknown_key_lists_the_aliases(tiny_dir):
    with pytest.raises(ConfigError, match=r"\['visoin'\].*aliases: \['projector', 'text', 'vision'\]"):
        groups_by_name(load_tiny(tiny_dir), {"visoin": 0.0})
    with pytest.raises(ConfigError, match=r"\['vision'\] match no parameter"):  # no aliases declared
        groups_by_name(load_tiny(tiny_dir, groups=False), {"vision": 0.0})


def test_own_vlm_accepts_the_same_aliases():
    from vlmtrain.models.own_vlm.build import build_vlm

    vision = dict(model_type="siglip_vision_model", image_size=32, patch_size=8, hidden_size=32,
                  intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    text = dict(model_type="llama", vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = build_vlm(vision, text, pixel_shuffle_factor=2)
    got = groups_by_name(model, {"vision": 0.0, "projector": 1e-3, "text": 1e-5})
    assert got["projector"][1] == {n for n, _ in model.named_parameters() if n.startswith("projector.")}
    assert got["text"][1] == {n for n, _ in model.named_parameters() if n.startswith("decoder.")}
    assert not any(p.requires_grad for p in model.vision_encoder.parameters())
