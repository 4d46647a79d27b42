"""train.use_liger_kernel (models/speed/liger.py): Liger's kernels in a Hub VLM, vlmtrain's own LM loss kept.

On CPU (liger-kernel is not a dev dependency: it needs Triton and CUDA): every setting that cannot apply is a
ConfigError before training that names it (liger-kernel missing, no CUDA device, a model of a family Liger does
not cover, a loss kernel or an unknown option in liger_kernel_config, a kernel that finds no module or does not
import), from the Trainer and from a run config before the weights load; with recording stand-ins for Liger's
building blocks (its RMSNorm, SwiGLU, GeGLU, LayerNorm and rotary modules, computing what the kernels compute),
per family which modules get which kernel, the same loss and gradients as the plain model, and that no other
liger_kernel module (its per-model patches) is imported. On a GPU with liger-kernel (``-m gpu``): per covered
family, the model with Liger's kernels gives the plain model's loss and gradients within bf16 tolerance, and a
short run trains as it does without Liger.
"""

from __future__ import annotations

import json
import math
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
    # refused where the kernels are applied, before the first step (transformers' arguments do not check it either)
    args = vlmtrain.TrainingArguments(output_dir=str(tmp_path), report_to="none", **kw)
    with pytest.raises(ConfigError, match=r"liger_kernel_config") as e:
        vlmtrain.Trainer(tiny_llama(), args)
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


# -- Liger's building blocks, bound by vlmtrain: with recording stand-ins ------------------------------------------
def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _NoOtherLiger:
    """A meta path finder that refuses (and records) any liger_kernel module but the stand-ins: Liger's per-model
    patches (monkey_patch, model.*) must never be imported."""

    def __init__(self):
        self.asked = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "liger_kernel":
            self.asked.append(name)
            raise ImportError(f"{name} is not a stand-in")
        return None


@pytest.fixture
def fake_liger(monkeypatch):
    """liger_kernel's building blocks (KERNEL_MODULES) as stand-ins that count their calls and compute what
    Liger's kernels compute (its RMSNorm with offset and casting mode, SwiGLU, tanh GeGLU, LayerNorm, rotary), in
    torch; the rest of liger_kernel cannot be imported."""
    import collections

    import torch.nn.functional as F

    calls = collections.Counter()

    class LigerRMSNorm(torch.nn.Module):
        def forward(self, x):
            calls["rms_norm"] += 1
            y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            if self.casting_mode == "gemma":
                return (y * (self.offset + self.weight.float())).to(x.dtype)
            return (self.offset + self.weight) * y.to(x.dtype)

    class LigerSwiGLUMLP(torch.nn.Module):
        def forward(self, x):
            calls["swiglu"] += 1
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class LigerGEGLUMLP(torch.nn.Module):
        def forward(self, x):
            calls["geglu"] += 1
            return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))

    class LigerLayerNorm(torch.nn.Module):
        def forward(self, x):
            calls["layer_norm"] += 1
            return F.layer_norm(x, self.hidden_size, self.weight, self.bias, self.variance_epsilon)

    def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        calls["rope"] += 1
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def liger_rotary_pos_emb_vision(q, k, cos, sin):
        calls["rope_vision"] += 1
        cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
        return ((q.float() * cos + _rotate_half(q.float()) * sin).to(q.dtype),
                (k.float() * cos + _rotate_half(k.float()) * sin).to(k.dtype))

    contents = {"rms_norm": {"LigerRMSNorm": LigerRMSNorm}, "swiglu": {"LigerSwiGLUMLP": LigerSwiGLUMLP},
                "geglu": {"LigerGEGLUMLP": LigerGEGLUMLP}, "layer_norm": {"LigerLayerNorm": LigerLayerNorm},
                "rope": {"liger_rotary_pos_emb": liger_rotary_pos_emb,
                         "liger_rotary_pos_emb_vision": liger_rotary_pos_emb_vision}}
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for kernel, attrs in contents.items():
        module = types.ModuleType(f"liger_kernel.transformers.{kernel}")
        vars(module).update(attrs)
        monkeypatch.setitem(sys.modules, module.__name__, module)
    finder = _NoOtherLiger()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    monkeypatch.setattr(liger, "liger_version", lambda: "0.8.5")
    monkeypatch.setattr(liger, "cuda_available", lambda: True)
    monkeypatch.setattr(liger, "devices_off_cuda", lambda model: [])
    return types.SimpleNamespace(calls=calls, finder=finder)


LIGER_FAMILIES = {  # family -> (tiny build options, the plan's module count per kernel)
    "qwen3_vl": ({}, {"rms_norm": 9, "swiglu": 2, "rope": 4}),  # text: 2 x (2 + q/k) + final; 2 text + 2 vision
    "qwen2_5_vl": ({}, {"rms_norm": 10, "swiglu": 2, "rope": 4}),  # + 2 vision blocks x 2 norms (RMSNorm)
    "gemma3": ({}, {"rms_norm": 14, "geglu": 2, "layer_norm": 3, "rope": 2}),  # 2 x (4 + q/k) + final + projector;
    # (gemma3, smolvlm: one vision layer x 2 LayerNorms + the post-LayerNorm)
    "smolvlm": ({"model_type": "smolvlm"}, {"rms_norm": 5, "swiglu": 2, "layer_norm": 3, "rope": 2}),
}


@pytest.fixture(scope="module")
def liger_batches(tmp_path_factory):
    """family -> (tiny checkpoint dir, a float32 batch with images), built once for the module."""
    from tests.test_hub_packing import _samples
    from vlmtrain.data.hub_collate import HubVLMCollator
    from vlmtrain.data.hub_processing import HubVLMProcessor
    from vlmtrain.models.families import get_family

    built = {}
    for name, (options, _) in LIGER_FAMILIES.items():
        family = get_family("idefics3" if name == "smolvlm" else name)
        path = family.build_tiny(str(tmp_path_factory.mktemp(name)), seed=0, **options)
        batch = HubVLMCollator(HubVLMProcessor(family.load_processor(path), family, max_length=400,
                                               prompts=False))(_samples())
        built[name] = (path, {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)})
    return built


@pytest.mark.parametrize("name", list(LIGER_FAMILIES))
def test_liger_s_kernels_go_to_each_family_s_modules(fake_liger, liger_batches, name):
    """Per family: the plan (which modules get which kernel) and, through vlmtrain.Trainer, the model with the
    stand-ins bound gives the plain model's loss and gradients (fp32 1e-5: Gemma's (1 + weight) RMSNorm offset
    and casting, the tanh GeGLU, the text and vision rotary functions wired as Liger's own patch wires them), each
    kernel ran, and no liger_kernel module but the building blocks was imported (no per-model patch)."""
    from vlmtrain.models.hub.hub_loading import load_model

    path, inputs = liger_batches[name]
    model = load_model(path).train()
    plain, plain_grads = _loss_and_grads(model, inputs)
    own_forward = model.forward
    plan = liger.apply_liger_kernel(model)
    assert {k: len(v) for k, v in plan.items()} == LIGER_FAMILIES[name][1]
    assert all(type(m).__name__.endswith("RMSNorm") for n, m in model.named_modules() if n in plan["rms_norm"])
    assert model.forward == own_forward  # vlmtrain's chunked loss stays
    assert {m._get_name() for n, m in model.named_modules() if n in plan["rms_norm"]} == {"LigerRMSNorm"}
    loss, grads = _loss_and_grads(model, inputs)
    assert loss.item() == pytest.approx(plain.item(), rel=1e-5)
    for n, g in plain_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6)
    ran = {"rope" if k == "rope_vision" else k for k in fake_liger.calls}
    assert ran == set(plan), fake_liger.calls
    assert fake_liger.finder.asked == []
    assert not any(m.startswith("liger_kernel.transformers.model") or m.endswith("monkey_patch") for m in sys.modules)


def test_options_turn_kernels_off_and_others_are_named(tmp_path, fake_liger, liger_batches):
    """liger_kernel_config through the Trainer: {rope: false, swiglu: false} leaves those modules transformers';
    an option the family's kernels lack is an error naming the family's options; the rotary functions of
    transformers' modeling module are never changed (only the instance's attention forwards)."""
    from transformers.models.qwen3_vl import modeling_qwen3_vl as modeling

    from vlmtrain.models.hub.hub_loading import load_model

    rope = modeling.apply_rotary_pos_emb
    model = _tiny_qwen3_vl()
    vlmtrain.Trainer(model=model, args=_args(tmp_path, liger_kernel_config={"rope": False, "swiglu": False}))
    assert all("forward" not in vars(layer.mlp) and "forward" not in vars(layer.self_attn)
               for layer in model.model.language_model.layers)
    assert "forward" in vars(model.model.language_model.norm)
    with pytest.raises(ConfigError, match=r"liger_kernel_config: Liger's qwen3_vl patch has no option geglu; its "
                                          r"options: rms_norm, rope, swiglu"):
        vlmtrain.Trainer(model=_tiny_qwen3_vl(), args=_args(tmp_path, liger_kernel_config={"geglu": True}))
    liger.apply_liger_kernel(load_model(liger_batches["qwen3_vl"][0]))
    assert modeling.apply_rotary_pos_emb is rope


def test_a_kernel_that_finds_no_module_or_does_not_import_is_named(monkeypatch, fake_liger):
    """A model whose modules do not match what vlmtrain expects of its family (e.g. a changed transformers), and a
    liger-kernel whose building block fails to import: a ConfigError naming the kernel and the option to turn off."""
    model = _tiny_qwen3_vl()
    for layer in model.model.language_model.layers:
        del layer.mlp.gate_proj  # (no longer a gated MLP)
    with pytest.raises(ConfigError, match=r"this qwen3_vl model has no module for Liger's swiglu kernel .* Set "
                                          r"liger_kernel_config: \{swiglu: false\}"):
        liger.apply_liger_kernel(model)
    monkeypatch.delitem(sys.modules, "liger_kernel.transformers.rope")
    with pytest.raises(ConfigError, match=r"liger-kernel 0.8.5's liger_kernel.transformers.rope does not import .* "
                                          r"liger_kernel_config: \{rope: false\}"):
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
