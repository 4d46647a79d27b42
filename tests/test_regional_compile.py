"""train.torch_compile on a Hub VLM: every transformer layer (decoder layers and vision blocks) compiled on its own,
in place; the training losses equal eager's (the whole-model compile of other models: tests/test_logging.py)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers.modeling_layers import GradientCheckpointingLayer

from vlmtrain import Trainer, TrainingArguments
from vlmtrain.data.hub_collate import HubVLMCollator
from vlmtrain.data.hub_processing import HubVLMProcessor
from vlmtrain.models.families import get_family
from vlmtrain.models.kinds.hub_vlm import load_model
from vlmtrain.models.speed.training_prep import COMPILED_INSIDE
from vlmtrain.models.speed.varlen_attention import use_varlen_text_attention


class _StepModels(Trainer):
    """Records the type of the module each training step runs."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.step_models.append(type(model))
        return super().training_step(model, inputs, num_items_in_batch)


def _samples():
    return [{"images": [Image.new("RGB", size, (50 * i, 120, 30))],
             "texts": [{"user": "What colour is it?", "assistant": "Green" + "!" * i}]}
            for i, size in enumerate([(32, 48), (64, 32), (32, 32), (48, 48)])]


def _train(path, family, out, **args):
    torch.manual_seed(0)
    collator = HubVLMCollator(HubVLMProcessor(family.load_processor(path), family))
    trainer = _StepModels(load_model(path), TrainingArguments(
        output_dir=str(out), max_steps=3, per_device_train_batch_size=2, logging_steps=1, save_strategy="no",
        learning_rate=1e-2, disable_tqdm=True, report_to="none", seed=0, **args),
        train_dataset=_samples(), data_collator=collator)
    trainer.step_models = []
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    return trainer, losses


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True, "selective"])
def test_hub_vlm_compiles_each_layer_and_trains_as_eager(tmp_path, checkpointing):
    """Qwen3-VL with torch_compile (torch_compile_backend turns it on): each decoder layer and vision block is compiled in place (its forward goes
    through torch.compile; dynamo captured graphs), the model itself is not wrapped (its state dict keys stay the
    checkpoint's), and three steps give eager's losses (forward and, through the updates, backward), with and
    without activation checkpointing (full and selective)."""
    family = get_family("qwen3_vl")
    path = family.build_tiny(str(tmp_path / "tiny"), seed=0)
    if checkpointing == "selective":
        args = {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"mode": "selective"}}
    else:
        args = {"activation_checkpointing": checkpointing}
    _, eager = _train(path, family, tmp_path / "eager", **args)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    # aot_eager: dynamo's graphs and AOT autograd's joint forward/backward, without inductor's C++ build (minutes
    # on 2 CPU cores; the whole-model test in test_logging.py runs inductor)
    trainer, compiled = _train(path, family, tmp_path / "compiled", torch_compile_backend="aot_eager", **args)
    layers = [m for m in trainer.model.modules() if isinstance(m, GradientCheckpointingLayer)]
    names = [n for n, m in trainer.model.named_modules() if isinstance(m, GradientCheckpointingLayer)]
    assert len(layers) == 4 and any(".visual.blocks." in n for n in names)  # 2 vision blocks, 2 decoder layers
    assert all(m._compiled_call_impl is not None or getattr(m, COMPILED_INSIDE, False) for m in layers)
    assert not any(m._compiled_call_impl is not None for m in trainer.model.modules()
                   if not isinstance(m, GradientCheckpointingLayer))
    assert trainer.step_models == [type(trainer.model)] * 3  # not an OptimizedModule around the whole model
    assert not any("_orig_mod" in k for k in trainer.model.state_dict())
    assert counters["stats"]["unique_graphs"] > 0
    print(f"eager {eager}\ncompiled {compiled}")
    assert compiled == pytest.approx(eager, rel=1e-6) and eager[0] != eager[-1]
    torch._dynamo.reset()


class _CompileCounter:
    """A dynamo backend (aot_eager underneath) that records every compilation: its frame (the code dynamo compiled:
    a layer's forward, or the rest of it after a graph break) and the region (layer type) its parameters belong
    to; a recompilation of a frame has the same frame id and a new frame compile id."""

    def __init__(self):
        self.compiles: dict[int, set[int]] = {}  # frame id -> its compile ids
        self.regions: dict[frozenset, set[tuple[int, int]]] = {}  # parameter names -> (frame, compile) ids

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
        self.compiles.setdefault(cid.frame_id, set()).add(cid.frame_compile_id)
        names = frozenset(gm.meta.get("dynamo_flat_name_to_original_fqn", {}).values())
        self.regions.setdefault(names, set()).add((cid.frame_id, cid.frame_compile_id))
        return aot_eager(gm, example_inputs)


def _random_samples(n, seed):
    """Samples of random lengths with 1-3 images of random sizes each."""
    import random

    rng = random.Random(seed)
    sizes = [(32, 32), (32, 48), (64, 32), (48, 48), (64, 64), (96, 32)]
    return [{"images": [Image.new("RGB", rng.choice(sizes), (rng.randrange(256), 120, 30))
                        for _ in range(rng.randint(1, 3))],
             "texts": [{"user": "What colour? " + "x " * rng.randint(0, 30),
                        "assistant": "Green" + "!" * rng.randint(0, 40)}]} for _ in range(n)]


@pytest.mark.slow
def test_regional_compile_compiles_each_region_at_most_twice_over_random_lengths(tmp_path):
    """50 steps of batches with random text lengths, image counts and image sizes through the Trainer with
    torch_compile: dynamo compiles each frame (a layer's forward, or its part after the vision attention, which runs
    eagerly) at most twice and each region (decoder layer, vision block) at most twice in all, instead of once per
    new length (the loss still falls: training happened)."""
    from torch._dynamo import register_backend

    family = get_family("qwen3_vl")
    path = family.build_tiny(str(tmp_path / "tiny"), seed=0)
    counter = _CompileCounter()
    register_backend(counter, name="vlmtrain_test_counting")
    torch._dynamo.reset()
    torch.manual_seed(0)
    collator = HubVLMCollator(HubVLMProcessor(family.load_processor(path), family))
    trainer = Trainer(load_model(path), TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=50, per_device_train_batch_size=2, logging_steps=10,
        save_strategy="no", learning_rate=1e-3, disable_tqdm=True, report_to="none", seed=0,
        torch_compile_backend="vlmtrain_test_counting"), train_dataset=_random_samples(100, seed=0),
        data_collator=collator)
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    print(f"compiles per frame {counter.compiles}\nper region "
          f"{ {sorted(k)[0]: len(v) for k, v in counter.regions.items()} }\nlosses {losses}")
    torch._dynamo.reset()
    assert any(any(n.startswith("norm1.") for n in r) for r in counter.regions)  # the vision blocks compiled
    assert any(any(n.startswith("self_attn.") for n in r) for r in counter.regions)  # the decoder layers too
    assert all(len(ids) <= 2 for ids in counter.compiles.values()), counter.compiles
    assert all(len(ids) <= 2 for ids in counter.regions.values()), counter.regions
    assert losses[-1] < losses[0]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "attention"), [("full", "varlen_torch"), ("selective", "sdpa")])
def test_regional_compile_compiles_checkpointed_layers_whose_attention_runs_eagerly(tmp_path, mode, attention):
    """With activation checkpointing, the layers whose attention runs eagerly (the vision blocks; the decoder layers
    under varlen_torch) are compiled too, inside their checkpoint: dynamo compiles each frame (a layer's forward,
    or its part after the eager attention) once over 6 steps of random lengths and image counts (no recompile
    after the first), each region (vision block, decoder layer) in at most its two frames, and the losses equal
    eager's."""
    from torch._dynamo import register_backend

    family = get_family("qwen3_vl")
    path = family.build_tiny(str(tmp_path / "tiny"), seed=0)
    counter = _CompileCounter()
    register_backend(counter, name=f"vlmtrain_test_counting_{mode}")
    collator = HubVLMCollator(HubVLMProcessor(family.load_processor(path), family))

    def train(out, **compile_args):
        torch.manual_seed(0)
        model = load_model(path)
        if attention == "varlen_torch":
            use_varlen_text_attention(model)
        trainer = Trainer(model, TrainingArguments(
            output_dir=str(tmp_path / out), max_steps=6, per_device_train_batch_size=2, logging_steps=1,
            save_strategy="no", learning_rate=1e-3, disable_tqdm=True, report_to="none", seed=0,
            activation_checkpointing=True, activation_checkpointing_kwargs={"mode": mode}, **compile_args),
            train_dataset=_random_samples(12, seed=0), data_collator=collator)
        trainer.train()
        return [r["loss"] for r in trainer.state.log_history if "loss" in r]

    eager = train("eager")
    torch._dynamo.reset()
    compiled = train("compiled", torch_compile_backend=f"vlmtrain_test_counting_{mode}")
    torch._dynamo.reset()
    print(f"compiles per frame {counter.compiles}\nregions {list(counter.regions.values())}\n{eager}\n{compiled}")
    assert any(any(n.startswith("norm1.") for n in r) for r in counter.regions)  # the vision blocks compiled
    assert any(any(n.startswith("mlp.") for n in r) and not any(n.startswith("norm1.") for n in r)
               for r in counter.regions)  # ... and the decoder layers
    assert all(len(ids) == 1 for ids in counter.compiles.values()), counter.compiles
    assert all(len(ids) <= 2 for ids in counter.regions.values()), counter.regions  # (split at the attention)
    assert compiled == pytest.approx(eager, rel=1e-6) and eager[0] != eager[-1]
