"""model.attn_implementation: varlen_torch, the vision half (models/vision/vision_attention.py): a Qwen-VL vision tower
attends over all of a batch's images in one call and computes what transformers' one-call-per-image path does.

The function against dense non-causal attention with a block-diagonal mask; on tiny Qwen3-VL and Qwen2.5-VL
(fp32; several images of different sizes, a text-only sample among them) the logits, loss and every gradient
with the one-call vision attention equal the per-image path's (1e-5), with one call per vision block (Qwen2.5-VL:
its windowed blocks get the windows' boundaries); load_model with varlen_torch sets it on Qwen towers only.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_hub_packing import _collators, _forward, _parts, _sample, _tiny
from vlmtrain.models.vision import vision_attention
from vlmtrain.models.vision.vision_attention import NAME, use_varlen_vision_attention


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("vision_varlen"))


class _Vision(torch.nn.Module):
    is_causal = False


def test_images_attend_within_themselves_only():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 13, 8), torch.randn(1, 4, 13, 8), torch.randn(1, 4, 13, 8)
    cu = torch.tensor([0, 4, 9, 13], dtype=torch.int32)  # images of 4, 5 and 4 patches
    image = torch.repeat_interleave(torch.arange(3), torch.tensor([4, 5, 4]))
    allowed = image[:, None] == image[None, :]
    scores = (q @ k.transpose(-1, -2)) * 0.3
    ref = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v).transpose(1, 2)
    out, _ = vision_attention.vision_varlen_attention(_Vision(), q, k, v, None, scaling=0.3, cu_seq_lens_q=cu,
                                                      cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="serves a Qwen-VL vision tower only"):
        vision_attention.vision_varlen_attention(_Vision(), q, k, v, None)  # no boundaries
    with pytest.raises(ValueError, match="serves a Qwen-VL vision tower only"):
        vision_attention.vision_varlen_attention(_Vision(), q, k, v, None, cu_seq_lens_q=cu, is_causal=True)


def _vision_calls(monkeypatch) -> list[list[int]]:
    """Each call of the vision attention function: the image (or window) lengths it got."""
    calls: list[list[int]] = []
    inner = vision_attention.vision_varlen_attention

    def spy(module, *args, cu_seq_lens_q=None, **kwargs):
        calls.append(torch.diff(cu_seq_lens_q).tolist())
        return inner(module, *args, cu_seq_lens_q=cu_seq_lens_q, **kwargs)

    monkeypatch.setattr(vision_attention, "vision_varlen_attention", spy)
    return calls


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen2_5_vl"])
def test_one_call_vision_attention_equals_the_per_image_path(root, name, monkeypatch, one_thread):
    family, processor, model = _parts(name, root)
    model.eval()  # no dropout; gradients still flow
    _, pad = _collators(family, processor, model, pack_length=400)
    samples = [_sample(n, seed=i) for i, n in enumerate((2, 0, 3, 1))]  # images of 40x30, 24x48, 32x32 px
    batch = pad(samples)
    assert len(set(batch["image_grid_thw"].prod(-1).tolist())) > 1  # images of different sizes
    ref_logits, ref_loss, ref_grads = _forward(model, batch)  # sdpa: one call per image
    calls = _vision_calls(monkeypatch)
    assert use_varlen_vision_attention(model) and model.config.vision_config._attn_implementation == NAME
    assert model.config.get_text_config(decoder=True)._attn_implementation == "sdpa"  # (the text model keeps its)
    logits, loss, grads = _forward(model, batch)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    assert any(n.startswith(family.module_groups["vision"]) for n in grads)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-5, msg=n)
    patches = batch["image_grid_thw"].prod(-1).tolist()
    blocks = model.config.vision_config.depth
    assert len(calls) == blocks  # one call per block for all 6 images (not one per image)
    full = [c for c in calls if c == patches]
    if name == "qwen3_vl":
        assert len(full) == blocks
    else:  # Qwen2.5-VL: full attention in fullatt_block_indexes, the others over windows of each image
        assert len(full) == len(model.config.vision_config.fullatt_block_indexes)
        assert all(sum(c) == sum(patches) and len(c) >= len(patches) for c in calls)


def test_load_model_with_varlen_torch_sets_it_on_qwen_vision_towers_only(root):
    from vlmtrain.models.hub.hub_loading import load_model
    from vlmtrain.models.speed.varlen_attention import NAME as TEXT_NAME

    model = load_model(_tiny("qwen2_5_vl", root), attn_implementation="varlen_torch")
    assert model.config.vision_config._attn_implementation == NAME
    assert model.config.get_text_config(decoder=True)._attn_implementation == TEXT_NAME
    model = load_model(_tiny("idefics3", root), attn_implementation="varlen_torch")  # SigLIP crops: unchanged
    assert model.config.vision_config._attn_implementation == "sdpa"
    assert model.config.get_text_config(decoder=True)._attn_implementation == TEXT_NAME


@pytest.mark.gpu
def test_cuda_vision_varlen_kernel_equals_the_per_image_path():
    """On CUDA all images go to torch.nn.attention.varlen.varlen_attn in one call (bf16, not causal): outputs
    and input gradients match the CPU path's (bf16 tolerance)."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 16, 300, 64).bfloat16().float() for _ in range(3))
    cu = torch.tensor([0, 64, 100, 300], dtype=torch.int32)

    def run(device, dtype):
        leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
        out, _ = vision_attention.vision_varlen_attention(_Vision(), *leaves, None, cu_seq_lens_q=cu.to(device),
                                                          cu_seq_lens_k=cu.to(device), max_length_q=200,
                                                          max_length_k=200)
        out.float().square().sum().backward()
        return [out.float().cpu()] + [t.grad.float().cpu() for t in leaves]

    for a, b in zip(run("cuda", torch.bfloat16), run("cpu", torch.float32)):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
