"""The Qwen-family patch embedding Conv3d computed as the equal matmul (models/vision/patch_embed.py): same outputs and
gradients as the convolution, same state dict, and checkpoints that transformers' from_pretrained loads."""

from __future__ import annotations

import copy

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from vlmtrain import Trainer, TrainingArguments
from vlmtrain.data.hub_collate import HubVLMCollator
from vlmtrain.data.hub_processing import HubVLMProcessor
from vlmtrain.models.families import get_family
from vlmtrain.models.kinds.hub_vlm import load_model
from vlmtrain.models.vision.patch_embed import LinearPatchConv3d, linear_patch_embeddings

QWEN = ("qwen3_vl", "qwen2_5_vl")
# (input shape, kernel = stride): Qwen's one patch per call (batched and unbatched), and a volume of several
# patches per axis whose sides are not multiples of the kernel (the convolution drops the remainder)
SHAPES = [((300, 3, 2, 16, 16), (2, 16, 16)), ((3, 2, 14, 14), (2, 14, 14)), ((2, 3, 5, 33, 31), (2, 8, 8))]


def _pair(in_channels, kernel, bias, dtype=torch.float32):
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(in_channels, 48, kernel, stride=kernel, bias=bias).to(dtype)
    fast = copy.deepcopy(conv)
    assert linear_patch_embeddings(fast) == 1 and type(fast) is LinearPatchConv3d
    return conv, fast


@pytest.mark.parametrize("shape,kernel", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_patch_conv_equals_the_convolution(shape, kernel, bias):
    """Outputs and every gradient equal the convolution's: to float64 rounding in float64, to float32 rounding
    in float32 (only the order of the sums differs; a gradient sums over every patch, hence its wider bound)."""
    for dtype, tol, grad_tol in ((torch.float64, 1e-12, 1e-12), (torch.float32, 2e-6, 1e-4)):
        conv, fast = _pair(shape[-4], kernel, bias, dtype)
        x = torch.randn(shape, dtype=dtype, requires_grad=True)
        outs, grads = [], []
        for module in (conv, fast):
            out = module(x)
            (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).reshape(out.shape)).sum().backward()
            outs.append(out.detach())
            grads.append([x.grad.clone(), *(p.grad.clone() for p in module.parameters())])
            x.grad = None
        assert outs[0].shape == outs[1].shape
        torch.testing.assert_close(outs[1], outs[0], rtol=tol, atol=tol * outs[0].abs().max().item())
        for g_fast, g_conv in zip(grads[1], grads[0]):
            torch.testing.assert_close(g_fast, g_conv, rtol=grad_tol, atol=grad_tol * g_conv.abs().max().item())


def test_linear_patch_conv_in_bf16_equals_the_convolution_within_bf16_rounding():
    conv, fast = _pair(3, (2, 16, 16), True, torch.bfloat16)
    x = torch.randn(400, 3, 2, 16, 16, dtype=torch.bfloat16)
    reference = torch.nn.functional.conv3d(x.double(), conv.weight.double(), conv.bias.double(), stride=(2, 16, 16))
    a, b = conv(x), fast(x)
    torch.testing.assert_close(b, a)  # bf16's tolerance (rtol 1.6e-2)
    # and no further from the exact result than the convolution is (both round the same sum once to bf16)
    assert (b.double() - reference).abs().max() <= 2 * (a.double() - reference).abs().max() + 1e-2


def test_only_convolutions_over_non_overlapping_patches_change():
    model = torch.nn.Sequential(torch.nn.Conv3d(3, 8, 2, stride=1), torch.nn.Conv3d(3, 8, 2, stride=2, padding=1),
                                torch.nn.Conv2d(3, 8, 2, stride=2), torch.nn.Conv3d(3, 8, (1, 2, 2), stride=(1, 2, 2)))
    assert linear_patch_embeddings(model) == 1
    assert [type(m).__name__ for m in model] == ["Conv3d", "Conv3d", "Conv2d", "LinearPatchConv3d"]


def _samples():
    return [{"images": [Image.new("RGB", size, (60 * i, 90, 20))],
             "texts": [{"user": "What colour?", "assistant": "Green."}]} for i, size in enumerate([(32, 48), (64, 32)])]


@pytest.mark.parametrize("name", QWEN)
def test_hub_qwen_trains_with_the_matmul_and_saves_what_from_pretrained_loads(tmp_path, name):
    """load_model swaps the Qwen patch embedding; the model's loss and gradients equal the convolution's (a plain
    transformers load); the trained checkpoint loads with from_pretrained with no missing or unexpected key."""
    family = get_family(name)
    path = family.build_tiny(str(tmp_path / "tiny"), seed=0)
    model = load_model(path)
    proj = model.model.visual.patch_embed.proj
    assert type(proj) is LinearPatchConv3d
    plain = AutoModelForImageTextToText.from_pretrained(path)
    assert type(plain.model.visual.patch_embed.proj) is torch.nn.Conv3d
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}

    collator = HubVLMCollator(HubVLMProcessor(family.load_processor(path), family))
    batch = {k: v for k, v in collator(_samples()).items() if isinstance(v, torch.Tensor)
             and not k.startswith("prompt_")}
    losses, grads = [], []
    for m in (plain, model):
        m.train()
        loss = m(**batch).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(m.model.visual.patch_embed.proj.weight.grad.clone())
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)

    out = tmp_path / "out"
    trainer = Trainer(load_model(path), TrainingArguments(
        output_dir=str(out), max_steps=1, per_device_train_batch_size=2, save_strategy="steps", save_steps=1,
        learning_rate=1e-2, disable_tqdm=True, report_to="none"), train_dataset=_samples(), data_collator=collator)
    trainer.train()
    loaded, info = AutoModelForImageTextToText.from_pretrained(str(out / "checkpoint-1"), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    trained = trainer.model.state_dict()
    assert not torch.equal(trained["model.visual.patch_embed.proj.weight"], proj.weight)  # it did train
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=key)
