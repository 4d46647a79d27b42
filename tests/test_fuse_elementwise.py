"""train.fuse_elementwise: compile (models/speed/fused_elementwise.py): a model's RMSNorms, gated MLPs and rotary
embeddings compiled region by region with inductor (on the CPU: C++), trained through vlmtrain.Trainer.

Per model (a tiny Llama causal LM, a tiny Qwen3-VL with and without activation checkpointing): which modules are
fused; the gradients of the first step and the losses of 4 AdamW steps (weight decay on) equal the plain model's
(fp32, 1e-5), and so do the weights (1e-3: a tenth of one step); over batches of other lengths (and image sizes)
no graph compiles after the first step. Settings that cannot apply are one ConfigError before training.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from PIL import Image

import vlmtrain
from tests.tiny import tiny_llama, token_samples
from vlmtrain.errors import ConfigError
from vlmtrain.models.speed.fused_elementwise import FUSED


class _Record(vlmtrain.TrainerCallback):
    """The gradients of the first step, and dynamo's count of compiled graphs at each step's end."""

    def __init__(self):
        self.grads, self.graphs = None, []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def on_step_end(self, args, state, control, **kwargs):
        self.graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _llama():
    return tiny_llama(), token_samples(8, seed=1, min_len=5, max_len=20), None


def _qwen3_vl(tiny_hub):
    from vlmtrain.data.hub_collate import HubVLMCollator
    from vlmtrain.data.hub_processing import HubVLMProcessor
    from vlmtrain.models.kinds.hub_vlm import load_model

    family, path, processor = tiny_hub("qwen3_vl")
    sizes = [(32, 48), (64, 32), (32, 32), (48, 48), (96, 32), (32, 64), (48, 32), (64, 64)]
    samples = [{"images": [Image.new("RGB", size, (30 * i, 120, 30))],
                "texts": [{"user": "What colour? " + "x " * (3 * i), "assistant": "Green" + "!" * (2 * i)}]}
               for i, size in enumerate(sizes)]
    torch.manual_seed(0)
    return load_model(path), samples, HubVLMCollator(HubVLMProcessor(processor, family))


def _train(tmp_path, make, **args):
    torch.manual_seed(0)
    model, samples, collator = make()
    record = _Record()
    trainer = vlmtrain.Trainer(model, vlmtrain.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, logging_steps=1, save_strategy="no",
        learning_rate=1e-2, weight_decay=0.1, optim="adamw_torch", train_sampling_strategy="sequential",
        disable_tqdm=True, report_to="none", seed=0, **args),
        train_dataset=samples, data_collator=collator, callbacks=[record])
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    return trainer.model, losses, record


FUSED_MODULES = {  # model -> (norms, gated MLPs, attention modules whose rotary embedding is compiled)
    "llama": (5, 2, 2),  # 2 layers x 2 norms + the final norm
    "qwen3_vl": (9, 2, 4),  # text: 2 x (2 + q/k norms) + final; 2 text + 2 vision attentions (the vision MLPs: GELU)
}
GRAPHS = {"llama": 3, "qwen3_vl": 5}
"""Graphs dynamo compiles in the first step: one per region (norm, MLP, rotary), Qwen3-VL's q/k norms (4-D inputs)
and vision rotary function one more each."""


@pytest.mark.slow  # (inductor builds C++ on the CPU: 60-290 s each with a cold cache on 2 loaded cores)
@pytest.mark.parametrize("name, checkpointing", [("llama", False), ("qwen3_vl", False), ("qwen3_vl", True)])
def test_fused_regions_train_as_the_plain_model_without_recompiling(tmp_path, tiny_hub, name, checkpointing):
    make = _llama if name == "llama" else lambda: _qwen3_vl(tiny_hub)
    plain_model, plain, plain_record = _train(tmp_path / "plain", make, activation_checkpointing=checkpointing)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, fused, record = _train(tmp_path / "fused", make, activation_checkpointing=checkpointing,
                                  fuse_elementwise="compile")
    torch._dynamo.reset()
    kinds = [m for m in model.modules() if getattr(m, FUSED, False)]
    norms = sum(type(m).__name__.endswith("RMSNorm") for m in kinds)
    mlps = sum(hasattr(m, "gate_proj") for m in kinds)
    assert (norms, mlps, len(kinds) - norms - mlps) == FUSED_MODULES[name]
    print(f"plain {plain}\nfused {fused}\ngraphs per step {record.graphs}")
    assert record.graphs == [GRAPHS[name]] * 4  # (no graph after the first step)
    assert fused == pytest.approx(plain, rel=1e-5) and plain[0] != plain[-1]
    assert record.grads.keys() == plain_record.grads.keys()
    for n, grad in plain_record.grads.items():
        torch.testing.assert_close(record.grads[n], grad, rtol=1e-5, atol=1e-5, msg=n)
    # The weights after 4 AdamW steps: within a tenth of one step (lr 1e-2). AdamW divides each gradient by its own
    # running size, so an element whose gradient is ~0 moves by up to lr whatever its rounding (seen: 2.5e-4 for
    # one element of Qwen3-VL's deepstack merger; the rest below 3e-5).
    weights = dict(model.named_parameters())
    worst = max(((weights[n] - p).abs().max().item(), n) for n, p in plain_model.named_parameters())
    print(f"largest weight difference {worst}")
    assert worst[0] <= 1e-3


@pytest.mark.parametrize("kw, message", [
    ({"fuse_elementwise": "liger"}, "fuse_elementwise='liger'"),
    ({"fuse_elementwise": "compile", "torch_compile": True}, "fuse_elementwise='compile' with torch_compile"),
    ({"fuse_elementwise": "compile", "torch_compile_backend": "aot_eager"}, "with torch_compile"),
    ({"fuse_elementwise": "compile", "use_liger_kernel": True}, "with use_liger_kernel: Liger's kernels already"),
])
def test_settings_that_cannot_apply_are_an_error(tmp_path, kw, message):
    # refused where the model is fused, before the first step (as use_liger_kernel: not by the arguments)
    args = vlmtrain.TrainingArguments(output_dir=str(tmp_path), report_to="none", **kw)
    with pytest.raises(ConfigError) as e:
        vlmtrain.Trainer(tiny_llama(), args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_model_with_nothing_to_fuse_is_refused_before_training(tmp_path):
    with pytest.raises(ConfigError, match=r"fuse_elementwise='compile' compiles a transformers model's RMSNorms, "
                                          r"gated MLPs .* Sequential has none"):
        vlmtrain.Trainer(torch.nn.Sequential(torch.nn.Linear(2, 2)), vlmtrain.TrainingArguments(
            output_dir=str(tmp_path), fuse_elementwise="compile", report_to="none"))


def test_the_config_key(tmp_path):
    from vlmtrain.config import load_run_config

    path = tmp_path / "run.yaml"
    path.write_text("model: {kind: causal_lm}\ndata: {source: addition}\ntrain: {fuse_elementwise: compile}\n")
    assert load_run_config(str(path)).train.fuse_elementwise == "compile"
    assert load_run_config(str(path), {"train.fuse_elementwise": None}).train.fuse_elementwise is None


@pytest.mark.parametrize("train, message", [
    ({"fuse_elementwise": "compile", "torch_compile": True}, "fuse_elementwise='compile' with torch_compile"),
    ({"fuse_elementwise": "compile", "use_liger_kernel": True}, "with use_liger_kernel: Liger's kernels already"),
    ({"liger_kernel_config": {"rope": False}}, "but use_liger_kernel is false"),
])
def test_a_run_config_s_speed_settings_are_checked_before_data_or_weights(tmp_path, monkeypatch, train, message):
    from vlmtrain import compose
    from vlmtrain.config import load_run_config
    from vlmtrain.data import registry

    path = tmp_path / "run.yaml"
    model = {"kind": "causal_lm", "config": {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1}}
    path.write_text(yaml.safe_dump({"model": model, "data": {"source": "addition"},
                                    "train": {"output_dir": str(tmp_path / "run"), **train}}))
    cfg = load_run_config(str(path))
    monkeypatch.setattr(registry, "get_source", lambda *a, **k: pytest.fail("the data were built"))
    with pytest.raises(ConfigError) as e:
        compose.build(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)
