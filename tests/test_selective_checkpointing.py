"""activation_checkpointing_kwargs' policies: 'selective' keeps matrix products and attention and recomputes the
rest, 'selective' with selective_every_n_layers k does so on every k-th checkpointed layer and recomputes the others
whole, 'attention' keeps only the attention's output. For each, loss and every gradient equal no checkpointing's (a
tiny Hub VLM, the own VLM and a causal LM, fp32) and an operator count of the backward shows what it recomputed;
an invalid mode fails before training; choose_policy picks the policy that recomputes least within a budget."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from PIL import Image
from tiny import VOCAB, tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode

from vlmtrain import TrainingArguments
from vlmtrain.data.hub_collate import HubVLMCollator
from vlmtrain.data.hub_processing import HubVLMProcessor
from vlmtrain.errors import ConfigError
from vlmtrain.models.families import get_family
from vlmtrain.models.kinds.hub_vlm import load_model
from vlmtrain.models.own_vlm.build import build_vlm
from vlmtrain.models.speed.checkpointing_policies import choose_policy
from vlmtrain.models.speed.training_prep import enable_activation_checkpointing

MODES = {"none": None, "full": {}, "selective": {"mode": "selective"},
         "selective_every_2": {"mode": "selective", "selective_every_n_layers": 2}, "attention": {"mode": "attention"}}


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


def _causal_lm(tmp_path_factory):
    ids = torch.randint(1, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    return lambda: tiny_llama(num_hidden_layers=4), {"input_ids": ids, "labels": ids.clone()}


_MODELS = {"hub_vlm": _hub_vlm, "own_vlm": _own_vlm, "causal_lm": _causal_lm}


@pytest.fixture(scope="module", params=list(_MODELS))
def runs(request, tmp_path_factory):
    """Loss, gradients and the backward's operator counts of every mode in MODES, for one model."""
    build, batch = _MODELS[request.param](tmp_path_factory)
    return {mode: _loss_grads_ops(build, batch, kwargs) for mode, kwargs in MODES.items()}


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


@pytest.mark.parametrize("mode", [m for m in MODES if m != "none"])
def test_each_policy_gives_the_loss_and_gradients_of_no_checkpointing(runs, mode):
    loss, grads, _ = runs["none"]
    assert torch.allclose(runs[mode][0], loss, rtol=1e-6, atol=1e-7), mode
    assert runs[mode][1].keys() == grads.keys()
    for name, g in grads.items():
        assert torch.allclose(runs[mode][1][name], g, rtol=1e-6, atol=1e-7), (mode, name)


def _attention_forwards(counts):
    return sum(n for op, n in counts.items() if op.startswith("_scaled_dot_product") and not op.endswith("backward"))


def test_each_policy_recomputes_what_it_says(runs):
    plain, full, selective, every_2, attention = (runs[m][2] for m in MODES)
    assert _attention_forwards(full) > 0 and _attention_forwards(plain) == 0  # (full recomputes the attention)
    assert _attention_forwards(selective) == 0  # selective kept it
    products = [op for op in ("mm", "addmm") if op in full]  # (addmm: linear layers with a bias)
    for op in products:  # full recomputes the layers' products; selective only runs the backward's
        assert full[op] > plain[op] and selective[op] == plain[op], op
    assert sum(selective.values()) > sum(plain.values())  # ... and recomputes the cheap rest (norms, activations)
    # every second checkpointed layer selective, the others full: about half of full's recomputed products and
    # attention
    assert plain["mm"] < every_2["mm"] < full["mm"]
    assert 0 < _attention_forwards(every_2) < _attention_forwards(full)
    # attention only: every product recomputed as in full, the attention never
    assert _attention_forwards(attention) == 0
    assert "mm" in products and all(attention[op] == full[op] for op in products)


def test_invalid_mode_is_an_error_before_training(tmp_path):
    with pytest.raises(ConfigError,
                       match=r"activation_checkpointing_kwargs\.mode.*'partial'.*'full', 'selective', 'attention'"):
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
    for bad in ({"mode": "full", "selective_every_n_layers": 2}, {"selective_every_n_layers": 2},
                {"mode": "selective", "selective_every_n_layers": 0}, {"mode": "selective", "selective_every_n_layers": "2"}):
        with pytest.raises(ConfigError, match="selective_every_n_layers"):
            TrainingArguments(output_dir=str(tmp_path), activation_checkpointing=True,
                              activation_checkpointing_kwargs=bad)
    for good in ({"mode": "attention"}, {"mode": "selective", "selective_every_n_layers": 3}):
        args = TrainingArguments(output_dir=str(tmp_path), activation_checkpointing=True,
                                 activation_checkpointing_kwargs=good)
        assert args.activation_checkpointing_kwargs == good


def test_choose_policy_picks_the_policy_that_keeps_most_within_the_budget():
    """Per layer, in bytes: the policy with the most saved activations (the least recompute) that fits."""
    per_layer = {"full": 8, "attention": 16, "selective_every_4": 27, "selective_every_2": 47, "selective": 86}
    assert choose_policy(per_layer, 100) == "selective"
    assert choose_policy(per_layer, 86) == "selective"
    assert choose_policy(per_layer, 85) == "selective_every_2"
    assert choose_policy(per_layer, 30) == "selective_every_4"
    assert choose_policy(per_layer, 16) == "attention"
    assert choose_policy(per_layer, 10) == "full"
    assert choose_policy(per_layer, 7) is None  # nothing fits: the caller refuses the budget
    assert choose_policy(dict(reversed(per_layer.items())), 50) == "selective_every_2"  # (order does not matter)
