"""model.attn_implementation: varlen_torch (models/speed/varlen_attention.py): a Hub VLM's text attention per document
with no dense mask computes what sdpa with transformers' block-diagonal mask does.

The function against dense attention with an explicit mask (documents from restarting positions across rows,
grouped-query heads, a padded batch, a KV-cache step); per packing family (tiny checkpoints, fp32) a packed
batch's logits, loss and every gradient with varlen_torch equal those of sdpa on the same packed batch and the
unpacked samples', with the boundaries taken from the positions and no mask reaching it; padded batches and
generation (evaluation) too; and the settings where it cannot run are ConfigErrors before any work.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_hub_packing import (
    PACKING,
    _collators,
    _config,
    _forward,
    _parts,
    _sample,
    _samples,
    _tiny,
    assert_documents_match,
)
from vlmtrain.config import ConfigError, load_run_config
from vlmtrain.models.families import get_family
from vlmtrain.models.speed import varlen_attention
from vlmtrain.models.vision.vision_attention import NAME as VISION_NAME
from vlmtrain.models.vision.vision_attention import VISION_MODEL_TYPES


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("varlen"))


def _dense(q, k, v, allowed):
    """Reference: q [B, H, T, D], k / v [B, Hkv, T, D] (kv head j serves query heads j*g..), allowed [B, T, T]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(-1).nan_to_num() @ v).transpose(1, 2)  # [B, T, H, D]


class _Causal(torch.nn.Module):
    is_causal = True


def test_documents_from_positions_attend_causally_within_themselves_only():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    # row 0: documents of 4, 3, 2 tokens; row 1: 5 then 4 (the second starts at position 0 of a new sample)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 0, 1, 2, 3]])
    doc = torch.stack([(torch.diff(p, prepend=p[:1] - 1) != 1).cumsum(0) for p in pos])
    allowed = (doc[:, :, None] == doc[:, None, :]) & torch.ones(9, 9, dtype=torch.bool).tril()
    out, _ = varlen_attention.varlen_attention(_Causal(), q, k, v, None, position_ids=pos)
    torch.testing.assert_close(out, _dense(q, k, v, allowed), rtol=1e-5, atol=1e-6)
    # no positions: each row is one causal document
    out, _ = varlen_attention.varlen_attention(_Causal(), q, k, v, None)
    torch.testing.assert_close(out, _dense(q, k, v, torch.ones(2, 9, 9, dtype=torch.bool).tril().expand(2, 9, 9)),
                               rtol=1e-5, atol=1e-6)


def test_padded_batches_and_cache_steps_match_masked_attention():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])  # row 1 left-padded
    real = mask.bool()
    allowed = real[:, None, :] & real[:, :, None] & torch.ones(6, 6, dtype=torch.bool).tril()
    out, _ = varlen_attention.varlen_attention(_Causal(), q, k, v, mask)
    ref = _dense(q, k, v, allowed)
    torch.testing.assert_close(out[real], ref[real], rtol=1e-5, atol=1e-6)
    assert out[~real].abs().max() == 0  # padding attends to nothing
    # a KV-cache step: the last 2 queries against all 6 keys
    out, _ = varlen_attention.varlen_attention(_Causal(), q[:, :, 4:], k, v, mask)
    torch.testing.assert_close(out, ref[:, 4:], rtol=1e-5, atol=1e-6)


def test_what_it_cannot_compute_is_an_error():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="has no attention dropout"):
        varlen_attention.varlen_attention(_Causal(), q, q, q, None, dropout=0.1)
    with pytest.raises(ValueError, match="sliding window"):
        varlen_attention.varlen_attention(_Causal(), q, q, q, None, sliding_window=2)


def _varlen_model(path: str):
    from vlmtrain.models.kinds.hub_vlm import load_model

    return load_model(path, attn_implementation="varlen_torch")


def _recording(monkeypatch) -> list[str]:
    """Which way each call found its documents: 'positions' (a packed or unpadded batch) or 'mask' (padded)."""
    seen = []
    documents, unpadded = varlen_attention._documents, varlen_attention._unpadded

    def from_positions(position_ids, *args):
        seen.append("none" if position_ids is None else "positions")
        return documents(position_ids, *args)

    def from_mask(mask):
        seen.append("mask")
        return unpadded(mask)

    monkeypatch.setattr(varlen_attention, "_documents", from_positions)
    monkeypatch.setattr(varlen_attention, "_unpadded", from_mask)
    return seen


@pytest.mark.parametrize("name", list(PACKING))
def test_packed_rows_with_varlen_torch_equal_sdpa_block_mask_and_unpacked(root, name, monkeypatch, one_thread):
    family, processor, sdpa = _parts(name, root, "sdpa")
    model = _varlen_model(_tiny(name, root))
    assert model.config.get_text_config(decoder=True)._attn_implementation == "varlen_torch"
    vision = getattr(model.config, "vision_config", None)
    qwen_tower = getattr(vision, "model_type", None) in VISION_MODEL_TYPES  # (all images in one call)
    assert vision is None or vision._attn_implementation == (VISION_NAME if qwen_tower else "sdpa")
    sdpa.eval()
    model.eval()
    pack, pad = _collators(family, processor, sdpa, pack_length=400)
    samples = _samples()
    packed, padded = pack(samples), pad(samples)
    seen = _recording(monkeypatch)
    logits, loss, grads = _forward(model, packed)
    assert seen and set(seen) == {"positions"}  # no mask reached it: the boundaries came from the positions
    ref_logits, ref_loss, ref_grads = _forward(sdpa, packed)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-5, msg=n)
    pad_logits, pad_loss, _ = _forward(sdpa, padded)
    torch.testing.assert_close(loss, pad_loss, rtol=1e-5, atol=1e-5)
    assert_documents_match(logits, packed, pad_logits, padded, len(samples))


def test_padded_batches_and_generation_with_varlen_torch_equal_sdpa(root, monkeypatch, one_thread):
    """What evaluation runs: padded batches (the unpadded tokens of each row) and generation (a KV cache)."""
    family, processor, sdpa = _parts("qwen3_vl", root, "sdpa")
    model = _varlen_model(_tiny("qwen3_vl", root))
    sdpa.eval()
    model.eval()
    _, pad = _collators(family, processor, sdpa, pack_length=400)
    padded = pad(_samples()[:3])
    seen = _recording(monkeypatch)
    logits, loss, grads = _forward(model, padded)
    assert "mask" in seen
    ref_logits, ref_loss, ref_grads = _forward(sdpa, padded)
    real = padded["attention_mask"].bool()
    torch.testing.assert_close(logits[real], ref_logits[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-5, msg=n)
    inputs = {k: v for k, v in pad([_sample(1, 3)]).items()
              if isinstance(v, torch.Tensor) and k not in ("labels", "position_ids")}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        ref = sdpa.generate(**inputs, max_new_tokens=4, do_sample=False, output_logits=True,
                            return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_varlen_torch_settings_that_cannot_run_fail_before_any_work(root, tmp_path, monkeypatch):
    from vlmtrain.models.kinds import get_kind
    from vlmtrain.models.kinds.hub_vlm import check_varlen_torch

    kind = get_kind("hub_vlm")
    config = _config(tmp_path, _tiny("qwen3_vl", root))
    cfg = load_run_config(config, {"model.attn_implementation": "varlen_torch"})  # packed: fine
    kind.validate(cfg)  # (CPU: one sdpa call per document, any dtype)
    kind.validate(load_run_config(config, {"model.attn_implementation": "varlen_torch", "data.packing": False}))
    with pytest.raises(ConfigError, match="model.torch_dtype is float32 and train.bf16 is off"):
        check_varlen_torch(cfg, cuda=True)
    check_varlen_torch(load_run_config(config, {"model.attn_implementation": "varlen_torch",
                                                "model.torch_dtype": "bfloat16"}), cuda=True)
    check_varlen_torch(load_run_config(config, {"model.attn_implementation": "varlen_torch",
                                                "train.bf16": True}), cuda=True)
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch.nn.attention.varlen" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"needs torch.nn.attention.varlen \(torch >= 2.10"):
        check_varlen_torch(cfg, cuda=True)
    monkeypatch.undo()
    # Gemma 3 (unpacked: it cannot pack at all) has sliding-window layers
    gemma = get_family("gemma3").build_tiny(str(tmp_path / "gemma3"), seed=0)
    cfg = load_run_config(_config(tmp_path, gemma), {"model.attn_implementation": "varlen_torch",
                                                     "data.packing": False})
    with pytest.raises(ConfigError, match="model.attn_implementation='varlen_torch' computes full causal "
                                          "attention without dropout per document, but .* sliding_attention"):
        kind.validate(cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True])
def test_cuda_varlen_kernel_equals_the_per_document_path(autocast):
    """On CUDA the documents go to torch.nn.attention.varlen.varlen_attn (bf16, grouped-query heads, causal):
    outputs and input gradients match the CPU path's on the same values (bf16 tolerance). ``autocast``: fp32
    q/k/v under bf16 autocast (train.bf16 with fp32 weights) are cast for the kernel."""
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 8, 40, 64), torch.randn(2, 2, 40, 64), torch.randn(2, 2, 40, 64)
    q, k, v = (t.bfloat16().float() for t in (q, k, v))  # (values exact in bf16)
    pos = torch.cat([torch.arange(17), torch.arange(23), torch.arange(40)]).reshape(2, 40)

    def run(device, dtype):
        leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda" and autocast):
            out, _ = varlen_attention.varlen_attention(_Causal(), *leaves, None, position_ids=pos.to(device))
        out.float().square().sum().backward()
        return [out.float().cpu()] + [t.grad.float().cpu() for t in leaves]

    got = run("cuda", torch.float32 if autocast else torch.bfloat16)
    ref = run("cpu", torch.float32)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)


@pytest.mark.slow
def test_a_packed_run_with_varlen_torch_logs_the_losses_of_sdpa(root, tmp_path, one_thread):
    """Through run.train (packed training rows, padded evaluation): the same losses as with sdpa."""
    import json

    from vlmtrain import run

    def losses(attn: str) -> list[float]:
        out = tmp_path / attn
        config = _config(tmp_path, _tiny("qwen3_vl", root))
        run.train(load_run_config(config, {"model.attn_implementation": attn, "train.output_dir": str(out),
                                           "data.eval_file": str(tmp_path / "data.jsonl"), "train.eval_strategy": "steps",
                                           "train.eval_steps": 2}))
        rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
        return [r[k] for r in rows for k in ("loss", "eval_loss") if k in r and "train_runtime" not in r]

    varlen, sdpa = losses("varlen_torch"), losses("sdpa")
    assert len(varlen) >= 3, varlen
    assert varlen == pytest.approx(sdpa, rel=1e-5)
