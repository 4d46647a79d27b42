"""train.use_liger_kernel (models/speed/liger.py): Liger's kernels in a Hub VLM, vlmtrain's own LM loss kept.

On CPU (liger-kernel is not a dev dependency: it needs Triton and CUDA): every setting that cannot apply is a
ConfigError before training that names it (liger-kernel missing, no CUDA device, a model of a family Liger does
not cover, a loss kernel or an unknown option in liger_kernel_config), from the Trainer and from a run config
before the weights load; with a stand-in for Liger's patch table, what vlmtrain hands Liger (the transformers
model inside the wrappers, the options with the loss kernels off) and what it puts back (Liger's class swaps in
transformers' modeling module; the rotary function stays). On a GPU with liger-kernel (``-m gpu``): per
covered family, the patched model's loss and gradients equal the unpatched model's within bf16 tolerance, and a
short run trains as it does without Liger.
"""

from __future__ import annotations

import json
import math
import re
import sys
import types

import pytest
import torch
import yaml

import vlmtrain
from tests.tiny import tiny_llama
from vlmtrain.errors import ConfigError
from vlmtrain.models.families import qwen3_vl
from vlmtrain.models.speed import liger


def _tiny_qwen3_vl() -> torch.nn.Module:
    import transformers

    from vlmtrain.models.speed.lm_loss import enable_lm_loss

    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(qwen3_vl.tiny_config())
    enable_lm_loss(model)  # (as models/hub/hub_loading.py loads a Hub VLM)
    return model


def _args(tmp_path, **kw):
    return vlmtrain.TrainingArguments(output_dir=str(tmp_path / "out"), use_liger_kernel=True, report_to="none", **kw)


# -- the arguments ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    ({"liger_kernel_config": {"rope": False}}, "but use_liger_kernel is false"),
    ({"use_liger_kernel": True, "liger_kernel_config": {"fused_linear_cross_entropy": True}},
     "liger_kernel_config['fused_linear_cross_entropy']=true: vlmtrain computes the LM loss itself"),
    ({"use_liger_kernel": True, "liger_kernel_config": {"cross_entropy": True}}, "['cross_entropy']=true"),
    ({"use_liger_kernel": True, "liger_kernel_config": {"rope": "no"}}, "must map Liger's options to true/false"),
])
def test_liger_kernel_config_that_cannot_apply_is_an_error(tmp_path, kw, message):
    with pytest.raises(ConfigError, match=r"liger_kernel_config") as e:
        vlmtrain.TrainingArguments(output_dir=str(tmp_path), **kw)
    assert message in str(e.value)


def test_the_options_keep_transformers_names_and_defaults():
    import transformers

    ours, theirs = vlmtrain.TrainingArguments(output_dir="x"), transformers.TrainingArguments(output_dir="x")
    for name in ("use_liger_kernel", "liger_kernel_config"):
        assert getattr(ours, name) == getattr(theirs, name)
    args = vlmtrain.TrainingArguments(output_dir="x", use_liger_kernel=True, liger_kernel_config={"rope": False})
    assert args.to_dict()["liger_kernel_config"] == {"rope": False} and args.use_liger_kernel


# -- errors before training, from the Trainer --------------------------------------------------------------------
def test_without_liger_installed_the_error_names_the_extra(tmp_path, monkeypatch):
    if liger.liger_version() is not None:  # (a machine with liger-kernel: as if it were missing)
        monkeypatch.setattr(liger, "liger_version", lambda: None)
    with pytest.raises(ConfigError) as e:
        vlmtrain.Trainer(model=_tiny_qwen3_vl(), args=_args(tmp_path))
    assert "use_liger_kernel=true needs liger-kernel, which is not installed: pip install 'vlmtrain[liger]'" in str(
        e.value)


def test_installed_but_no_cuda_is_an_error(tmp_path, monkeypatch):
    assert not torch.cuda.is_available()  # (tests/conftest.py hides GPUs)
    monkeypatch.setattr(liger, "liger_version", lambda: "0.8.5")
    with pytest.raises(ConfigError, match=r"use_liger_kernel=true: Liger's kernels are Triton kernels and run on a "
                                          r"CUDA GPU, and none is visible here"):
        vlmtrain.Trainer(model=_tiny_qwen3_vl(), args=_args(tmp_path))


def test_a_model_left_on_the_cpu_is_an_error(tmp_path, monkeypatch):
    """A CUDA machine, but the Trainer's device is the CPU (use_cpu): never Liger's Triton kernels on CPU tensors."""
    monkeypatch.setattr(liger, "liger_version", lambda: "0.8.5")
    monkeypatch.setattr(liger, "cuda_available", lambda: True)
    with pytest.raises(ConfigError, match=r"use_liger_kernel=true: the model is on cpu, but Liger's kernels run on "
                                          r"CUDA"):
        vlmtrain.Trainer(model=_tiny_qwen3_vl(), args=_args(tmp_path, use_cpu=True))


def test_a_family_liger_does_not_cover_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(liger, "liger_version", lambda: "0.8.5")
    with pytest.raises(ConfigError) as e:
        vlmtrain.Trainer(model=tiny_llama(), args=_args(tmp_path))
    assert ("use_liger_kernel=true: vlmtrain applies Liger's kernels to the Hub VLM families Liger covers (qwen3_vl, "
            "qwen2_5_vl, gemma3, smolvlm); this model's family, 'llama', is not one of them") in str(e.value)
    with pytest.raises(ConfigError, match=r"use_liger_kernel=true patches a transformers Hub VLM .* Linear is not "
                                          r"one and holds none"):
        vlmtrain.Trainer(model=torch.nn.Linear(2, 2), args=_args(tmp_path))


@pytest.mark.parametrize("model_type, message", [
    ("idefics3", "this model's family, 'idefics3', is not one of them"),
    ("llava_onevision", "this model's family, 'llava_onevision', is not one of them"),
    ("qwen3_vl", "pip install 'vlmtrain[liger]'"),
])
def test_a_run_config_is_checked_before_the_model_loads(tmp_path, monkeypatch, model_type, message):
    """vlmtrain train: the family (from config.json alone), liger-kernel and the device are checked before any
    data or weights are read."""
    from vlmtrain import compose
    from vlmtrain.config import load_run_config
    from vlmtrain.models.kinds import hub_vlm

    monkeypatch.setattr(liger, "liger_version", lambda: None)
    monkeypatch.setattr(hub_vlm, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": model_type}))
    cfg = {"model": {"kind": "hub_vlm", "pretrained": str(tmp_path / "model")},
           "data": {"source": "jsonl", "train_file": str(tmp_path / "missing.jsonl")},
           "train": {"output_dir": str(tmp_path / "run"), "use_liger_kernel": True}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError) as e:
        compose.build(load_run_config(str(tmp_path / "cfg.yaml")))
    assert message in str(e.value)


# -- what vlmtrain hands Liger, with a stand-in for Liger's patch table -----------------------------------------
@pytest.fixture
def fake_liger(monkeypatch):
    """liger_kernel.transformers.monkey_patch with a qwen3_vl patch that records its call and changes what Liger
    changes: a class and the rotary function in transformers' modeling module, the norms' forward on the instance."""
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    calls = []

    def patch(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=False,
              model=None):
        calls.append({"model": model, "rope": rope, "cross_entropy": cross_entropy, "rms_norm": rms_norm,
                      "fused_linear_cross_entropy": fused_linear_cross_entropy, "swiglu": swiglu})
        modeling_qwen3_vl.Qwen3VLTextRMSNorm = type("LigerRMSNorm", (torch.nn.Module,), {})
        if rope:
            modeling_qwen3_vl.apply_rotary_pos_emb = liger_rope
        if fused_linear_cross_entropy:
            model.forward = types.MethodType(lambda self, **kw: None, model)
        model.model.language_model.norm.forward = types.MethodType(lambda self, x: x, model.model.language_model.norm)

    def liger_rope(q, k, cos, sin, unsqueeze_dim=1):
        raise AssertionError("not called")

    class LigerSwiGLUMLP(torch.nn.Module):
        def forward(self, x):
            return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    modules = {"liger_kernel": types.ModuleType("liger_kernel"),
               "liger_kernel.transformers": types.ModuleType("liger_kernel.transformers"),
               "liger_kernel.transformers.monkey_patch": types.ModuleType("liger_kernel.transformers.monkey_patch"),
               "liger_kernel.transformers.swiglu": types.ModuleType("liger_kernel.transformers.swiglu")}
    modules["liger_kernel.transformers.monkey_patch"].MODEL_TYPE_TO_APPLY_LIGER_FN = {"qwen3_vl": patch}
    modules["liger_kernel.transformers.swiglu"].LigerSwiGLUMLP = LigerSwiGLUMLP
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(liger, "liger_version", lambda: "0.8.5")
    monkeypatch.setattr(liger, "cuda_available", lambda: True)
    monkeypatch.setattr(liger, "devices_off_cuda", lambda model: [])
    # (what the patch changes in transformers' module is put back after the test, the kept rotary function too)
    monkeypatch.setattr(modeling_qwen3_vl, "apply_rotary_pos_emb", modeling_qwen3_vl.apply_rotary_pos_emb)
    monkeypatch.setattr(modeling_qwen3_vl, "Qwen3VLTextRMSNorm", modeling_qwen3_vl.Qwen3VLTextRMSNorm)
    return types.SimpleNamespace(calls=calls, rope=liger_rope, swiglu=LigerSwiGLUMLP, module=modeling_qwen3_vl)


def test_liger_patches_the_instance_and_keeps_vlmtrains_loss(tmp_path, fake_liger):
    model = _tiny_qwen3_vl()
    own_forward, norm_class = model.forward, fake_liger.module.Qwen3VLTextRMSNorm
    trainer = vlmtrain.Trainer(model=model, args=_args(tmp_path, liger_kernel_config={"rope": True}))
    assert fake_liger.calls == [{"model": model, "rope": True, "rms_norm": True, "swiglu": False,
                                 "cross_entropy": False, "fused_linear_cross_entropy": False}]
    assert trainer.model.forward == own_forward and model.vlmtrain_accepts_loss_only  # vlmtrain's chunked loss
    assert fake_liger.module.Qwen3VLTextRMSNorm is norm_class  # Liger's class swap undone: later models unchanged
    assert fake_liger.module.apply_rotary_pos_emb is fake_liger.rope  # the rotary function stays Liger's
    x = torch.randn(3, 64)
    assert torch.equal(model.model.language_model.norm(x), x)  # the instance's norms are Liger's
    for layer in model.model.language_model.layers:  # Qwen3-VL's text MLPs: Liger's SwiGLU forward
        assert layer.mlp.forward.__func__ is fake_liger.swiglu.forward


def test_options_are_liger_s_with_the_loss_kernels_off(tmp_path, fake_liger):
    model = _tiny_qwen3_vl()
    vlmtrain.Trainer(model=model, args=_args(tmp_path, liger_kernel_config={"rope": False, "swiglu": False}))
    assert fake_liger.calls[0]["rope"] is False and fake_liger.calls[0]["fused_linear_cross_entropy"] is False
    assert fake_liger.module.apply_rotary_pos_emb is not fake_liger.rope
    assert all("forward" not in vars(layer.mlp) for layer in model.model.language_model.layers)  # swiglu: false
    with pytest.raises(ConfigError, match=r"liger_kernel_config: Liger's qwen3_vl patch has no option geglu; its "
                                          r"options: rms_norm, rope, swiglu"):
        vlmtrain.Trainer(model=_tiny_qwen3_vl(), args=_args(tmp_path, liger_kernel_config={"geglu": True}))


def test_a_liger_patch_that_cannot_import_names_both_versions(monkeypatch, fake_liger):
    """liger-kernel 0.8.5's Qwen-VL patches import an output class that transformers >= 5.23 removed: the run stops
    with a config error naming liger-kernel's and transformers' versions and what to do, not an ImportError."""
    import transformers

    table = sys.modules["liger_kernel.transformers.monkey_patch"].MODEL_TYPE_TO_APPLY_LIGER_FN

    def patch(model=None, rope=True, rms_norm=True, swiglu=False, fused_linear_cross_entropy=True,
              cross_entropy=False):
        raise ImportError("cannot import name 'LigerQwen3VLCausalLMOutputWithPast'")

    monkeypatch.setitem(table, "qwen3_vl", patch)
    with pytest.raises(ConfigError, match=rf"qwen3_vl patch does not work with transformers "
                                          rf"{re.escape(transformers.__version__)} \(cannot import name "
                                          r"'LigerQwen3VLCausalLMOutputWithPast'\).*use_liger_kernel: false"):
        liger.apply_liger_kernel(_tiny_qwen3_vl())


def test_a_liger_that_replaces_the_forward_is_refused(monkeypatch, fake_liger):
    """Should a Liger release replace the model's forward although its loss kernels are off, the run stops."""
    table = sys.modules["liger_kernel.transformers.monkey_patch"].MODEL_TYPE_TO_APPLY_LIGER_FN
    patch = table["qwen3_vl"]
    monkeypatch.setitem(table, "qwen3_vl", lambda model=None, **kw: patch(model=model, **{
        **kw, "fused_linear_cross_entropy": True}))
    with pytest.raises(RuntimeError, match=r"replaced Qwen3VLForConditionalGeneration.forward"):
        liger.apply_liger_kernel(_tiny_qwen3_vl())


def test_the_patched_model_is_found_inside_heads_and_lora():
    peft = pytest.importorskip("peft")  # (the dev extra has it)
    model = _tiny_qwen3_vl()
    assert liger.liger_target(torch.nn.ModuleDict({"base": model})) is model
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert liger.liger_target(wrapped) is model


def test_modeling_globals_are_put_back():
    from transformers.models.qwen3_vl import modeling_qwen3_vl as m

    rope, norm = m.apply_rotary_pos_emb, m.Qwen3VLTextRMSNorm
    with liger.modeling_globals_restored():
        m.apply_rotary_pos_emb, m.Qwen3VLTextRMSNorm, m.added_by_a_patch = None, None, 1
    assert (m.apply_rotary_pos_emb, m.Qwen3VLTextRMSNorm) == (rope, norm) and not hasattr(m, "added_by_a_patch")
    try:
        with liger.modeling_globals_restored(keep="rotary_pos_emb"):
            m.apply_rotary_pos_emb = m.Qwen3VLTextRMSNorm = m.apply_multimodal_rotary_pos_emb = None
        assert m.apply_rotary_pos_emb is None and m.Qwen3VLTextRMSNorm is norm
        assert not hasattr(m, "apply_multimodal_rotary_pos_emb")  # (added: nothing in transformers calls it)
    finally:
        m.apply_rotary_pos_emb = rope


# -- on a GPU with liger-kernel ------------------------------------------------------------------------------
needs_liger = pytest.mark.skipif(liger.liger_version() is None,
                                 reason="liger-kernel absent: pip install 'vlmtrain[liger]' (GPU machines only)")
GPU_FAMILIES = {"qwen3_vl": {}, "qwen2_5_vl": {}, "gemma3": {}, "smolvlm": {"model_type": "smolvlm"}}


@pytest.fixture
def restored_modeling():
    """Liger's rotary function stays in transformers' module; later tests get transformers' own back."""
    with liger.modeling_globals_restored():
        yield


def _loss_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs, loss_only=True)["loss"]
    loss.backward()
    return loss.detach().float(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
                                   if p.grad is not None}


@pytest.mark.gpu
@needs_liger
@pytest.mark.parametrize("name", list(GPU_FAMILIES))
def test_liger_loss_and_gradients_equal_the_unpatched_model(tmp_path, restored_modeling, name):
    """The same weights and multi-image batch, bf16 on CUDA: the model before and after apply_liger_kernel gives
    the same loss (1e-2 relative) and the same gradients: all together within 3e-2 (norm of the difference over
    the norm), each parameter's within 0.1 of its norm plus 1e-3 of the whole gradient's (some are zero in exact
    arithmetic, e.g. SigLIP's key biases). On CPU, bf16 against float32 gives 0.6-1.4e-2 together and at most
    0.086 for one parameter for these models. And Liger's kernels did run (the norms are Liger's)."""
    from tests.test_hub_packing import _samples
    from vlmtrain.data.hub_collate import HubVLMCollator
    from vlmtrain.data.hub_processing import HubVLMProcessor
    from vlmtrain.models.families import get_family
    from vlmtrain.models.hub.hub_loading import load_model

    family = get_family("idefics3" if name == "smolvlm" else name)
    path = family.build_tiny(str(tmp_path / name), seed=0, **GPU_FAMILIES[name])
    model = load_model(path, "bfloat16", "sdpa", device="cuda").train()
    batch = HubVLMCollator(HubVLMProcessor(family.load_processor(path), family, max_length=400, prompts=False))(
        _samples())
    inputs = {k: v.cuda() for k, v in batch.items() if isinstance(v, torch.Tensor)}
    loss, grads = _loss_and_grads(model, inputs)
    liger.apply_liger_kernel(model)
    assert any(m._get_name().startswith("Liger") for m in model.modules())
    liger_loss, liger_grads = _loss_and_grads(model, inputs)
    assert math.isfinite(loss.item()) and liger_loss.item() == pytest.approx(loss.item(), rel=1e-2)
    assert set(liger_grads) == set(grads)
    total = torch.sqrt(sum(g.norm() ** 2 for g in grads.values()))
    differs = torch.sqrt(sum((liger_grads[n] - g).norm() ** 2 for n, g in grads.items()))
    assert differs <= 3e-2 * total, (differs / total).item()
    for n, g in grads.items():
        assert (liger_grads[n] - g).norm() <= 0.1 * g.norm() + 1e-3 * total, n


@pytest.mark.gpu
@needs_liger
def test_a_run_with_use_liger_kernel_trains_as_without(tmp_path, restored_modeling):
    """vlmtrain train on a tiny Qwen3-VL (bf16, CUDA): the step losses with train.use_liger_kernel equal those
    without it (2e-2 relative)."""
    from tests.test_hub_run import _jsonl
    from vlmtrain import run
    from vlmtrain.config import load_run_config

    path = qwen3_vl.build_tiny(str(tmp_path / "qwen3_vl"))
    data = _jsonl(tmp_path, 8)
    losses = {}
    for use in (False, True):
        out = tmp_path / f"run-{use}"
        cfg = {"model": {"kind": "hub_vlm", "pretrained": path, "torch_dtype": "bfloat16"},
               "data": {"source": "jsonl", "train_file": data, "num_eval": 0, "max_length": 64},
               "train": {"output_dir": str(out), "max_steps": 3, "per_device_train_batch_size": 4, "bf16": True,
                         "logging_steps": 1, "save_strategy": "no", "learning_rate": 1e-3, "disable_tqdm": True,
                         "use_liger_kernel": use}}
        (tmp_path / f"cfg-{use}.yaml").write_text(yaml.safe_dump(cfg))
        with liger.modeling_globals_restored():
            run.train(load_run_config(str(tmp_path / f"cfg-{use}.yaml")))
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[use] = [r["loss"] for r in rows if "loss" in r and "train_runtime" not in r]
    assert len(losses[True]) == 3 and losses[True] == pytest.approx(losses[False], rel=2e-2)
