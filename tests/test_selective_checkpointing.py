"""activation_checkpointing_kwargs mode 'selective': matrix products and attention are kept, the rest recomputed;
loss and every gradient equal full checkpointing's and no checkpointing's (a tiny Hub VLM and the own VLM, fp32),
the backward recomputes no matrix product or attention, and an invalid mode fails before training."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

from vlmtrain import TrainingArguments
from vlmtrain.data.hub_collate import HubVLMCollator
from vlmtrain.data.hub_processing import HubVLMProcessor
from vlmtrain.errors import ConfigError
from vlmtrain.models.build import build_vlm
from vlmtrain.models.families import get_family
from vlmtrain.models.kinds.hub_vlm import load_model
from vlmtrain.models.training_prep import enable_activation_checkpointing

MODES = {"none": None, "full": {}, "selective": {"mode": "selective"}}


class _OpCounts(TorchDispatchMode):
    """Counts the aten operators that run."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _hub_vlm(tmp_path_factory):
    family = get_family("qwen3_vl")
    path = family.build_tiny(str(tmp_path_factory.mktemp("qwen3_vl")), seed=0)
    samples = [{"images": [Image.new("RGB", size, (50 * i, 120, 30))] * (i + 1),
                "texts": [{"user": "What colour is it?", "assistant": "Green" + "!" * i}]}
               for i, size in enumerate([(32, 48), (64, 32)])]
    batch = HubVLMCollator(HubVLMProcessor(family.load_processor(path), family))(samples)
    batch = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "mm_token_type_ids",
                                                      "pixel_values", "image_grid_thw", "labels")}
    return lambda: load_model(path), batch


def _own_vlm(tmp_path_factory):
    vision = dict(model_type="siglip_vision_model", image_size=32, patch_size=8, hidden_size=32,
                  intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    text = dict(model_type="llama", vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)

    def build():
        model = build_vlm(vision, text, pixel_shuffle_factor=2)
        model.config.image_token_id = 5
        return model

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(6, 40, (2, 24), generator=g)
    ids[:, 1:5] = 5  # one image (4 tokens after pixel shuffle) per sample
    return build, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
                   "pixel_values": torch.randn(2, 3, 32, 32, generator=g)}


@pytest.fixture(scope="module", params=["hub_vlm", "own_vlm"])
def model_and_batch(request, tmp_path_factory):
    return (_hub_vlm if request.param == "hub_vlm" else _own_vlm)(tmp_path_factory)


def _loss_grads_ops(build, batch, kwargs):
    """Loss, every parameter's gradient and the operators the backward ran, for one mode."""
    torch.manual_seed(0)
    model = build().float().train()
    if kwargs is not None:
        enable_activation_checkpointing(model, kwargs)
    loss = model(**batch)["loss"]
    with _OpCounts() as ops:
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    return loss.detach(), grads, ops.counts


def test_selective_equals_full_and_none_and_recomputes_only_cheap_ops(model_and_batch):
    build, batch = model_and_batch
    runs = {mode: _loss_grads_ops(build, batch, kwargs) for mode, kwargs in MODES.items()}
    loss, grads, _ = runs["none"]
    for mode in ("full", "selective"):
        assert torch.allclose(runs[mode][0], loss, rtol=1e-6, atol=1e-7), mode
        assert runs[mode][1].keys() == grads.keys()
        for name, g in grads.items():
            assert torch.allclose(runs[mode][1][name], g, rtol=1e-5, atol=1e-7), (mode, name)
    plain, full, selective = (runs[m][2] for m in MODES)
    attention = [op for op in full if op.startswith("_scaled_dot_product") and not op.endswith("backward")]
    assert attention and not any(op in plain for op in attention)  # (the forward attention: recomputed by full)
    assert not any(op in selective for op in attention)  # selective kept it
    for op in ("mm", "addmm"):  # full recomputes the layers' products; selective only runs the backward's
        assert full[op] > plain[op] and selective[op] == plain[op], op
    assert sum(selective.values()) > sum(plain.values())  # ... and recomputes the cheap rest (norms, activations)


def test_invalid_mode_is_an_error_before_training(tmp_path):
    with pytest.raises(ConfigError, match=r"activation_checkpointing_kwargs\.mode.*'partial'.*'full', 'selective'"):
        TrainingArguments(output_dir=str(tmp_path), activation_checkpointing=True,
                          activation_checkpointing_kwargs={"mode": "partial"})
    with pytest.raises(ConfigError, match="gradient_checkpointing_kwargs.mode"):
        TrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=True,
                          gradient_checkpointing_kwargs='{"mode": "everything"}')
    with pytest.raises(ConfigError, match="non-reentrant"):
        TrainingArguments(output_dir=str(tmp_path), activation_checkpointing=True,
                          activation_checkpointing_kwargs={"mode": "selective", "use_reentrant": True})
    args = TrainingArguments(output_dir=str(tmp_path), activation_checkpointing=True,
                             activation_checkpointing_kwargs={"mode": "selective"})
    assert args.activation_checkpointing_kwargs == {"mode": "selective"}
