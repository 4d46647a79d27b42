"""The LM loss applies the output layer only at supervised positions, in chunks (models/speed/lm_loss.py).

For the fused linear + cross-entropy, every Hub VLM family (with and without score heads, LoRA on one), the own
VLM and the causal LM types it knows: the loss and every parameter's gradient equal the full-logits path's
(float32, 1e-5); the LM head sees exactly the supervised rows, at most a chunk at a time, and no tensor larger
than a chunk's logits exists in forward or backward; the Trainer asks for it in training and in evaluation
that keeps no logits, and keeps the full logits where compute_metrics needs them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.optional_extras import requires
from tests.tiny import VOCAB, tiny_llama, token_samples
from vlmtrain.models.speed import lm_loss
from vlmtrain.models.speed.lm_loss import decoder_and_head, enable_lm_loss, linear_cross_entropy, lm_loss_sum

FAMILIES = ("qwen3_vl", "qwen2_5_vl", "idefics3", "llava_onevision", "gemma3")


class _ScaledLinear(nn.Module):
    """An output layer that is not a plain nn.Linear (as a peft wrapper is): the checkpointed path."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.inner = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * self.inner(x)


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _assert_close_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Each parameter's gradient within 1e-5 of the reference, relative to that gradient's norm (float32 sums of
    different order differ in the last bits of their largest entries); one that is zero in exact arithmetic (an
    attention key bias) within 1e-7."""
    assert sorted(got) == sorted(want)
    for name, g in want.items():
        err = float((got[name] - g).norm())
        assert err <= 1e-5 * float(g.norm()) + 1e-7, (name, err, float(g.norm()))


def _row_counter(head: nn.Module) -> list[int]:
    rows: list[int] = []
    head.register_forward_hook(lambda module, inputs, output: rows.append(inputs[0].reshape(-1, inputs[0].shape[-1])
                                                                           .shape[0]))
    return rows


# -- the chunked linear + cross-entropy ------------------------------------------------------------------------
@pytest.mark.parametrize("head_kind", ["linear", "other"])
@pytest.mark.parametrize("chunk_rows", [1, 3, 64])
def test_chunked_loss_and_gradients_equal_the_full_logits(head_kind, chunk_rows):
    torch.manual_seed(0)
    head = nn.Linear(16, 40) if head_kind == "linear" else _ScaledLinear(16, 40)
    rows = torch.randn(11, 16, requires_grad=True)
    targets = torch.randint(0, 40, (11,))
    full = F.cross_entropy(head(rows).float(), targets, reduction="sum")
    (2.5 * full).backward()  # (a scaled loss, as the Trainer's weighting does)
    want = {"rows": rows.grad.clone(), **_grads(head)}
    rows.grad = None
    head.zero_grad(set_to_none=True)
    got = linear_cross_entropy(rows, head, targets, chunk_rows)
    (2.5 * got).backward()
    assert torch.allclose(got, full, rtol=1e-6)
    _assert_close_grads({"rows": rows.grad, **_grads(head)}, want)


def test_bf16_chunked_weight_gradient_is_as_accurate_as_the_full_logits_path():
    """In bf16 the head's weight (and bias) gradient is summed over 128 chunks of 64 rows: accumulated in float32 it
    is as close to a float64 reference as the full-logits bf16 path's (accumulated in bf16 it was 5x further)."""
    torch.manual_seed(0)
    rows, hidden, vocab = 8192, 64, 512
    weight, bias = torch.randn(vocab, hidden) * 0.1, torch.randn(vocab) * 0.1
    x, targets = torch.randn(rows, hidden), torch.randint(0, vocab, (rows,))

    def grads(dtype: torch.dtype, chunk_rows: int | None) -> list[torch.Tensor]:
        head = nn.Linear(hidden, vocab).to(dtype)
        head.weight.data, head.bias.data = weight.to(dtype), bias.to(dtype)
        if chunk_rows is None:
            loss = F.cross_entropy(head(x.to(dtype)).float(), targets, reduction="sum")
        else:
            loss = linear_cross_entropy(x.to(dtype), head, targets, chunk_rows)
        loss.backward()
        return [head.weight.grad.double(), head.bias.grad.double()]

    want = grads(torch.float64, None)
    full, chunked = grads(torch.bfloat16, None), grads(torch.bfloat16, 64)
    for name, w, f, c in zip(("weight", "bias"), want, full, chunked):
        full_err, chunked_err = float((f - w).norm() / w.norm()), float((c - w).norm() / w.norm())
        assert chunked_err <= 1.01 * full_err, (name, chunked_err, full_err)


@pytest.mark.parametrize("head_kind", ["linear", "other"])
def test_no_target_is_zero_loss_with_zero_gradients(head_kind):
    head = nn.Linear(8, 10) if head_kind == "linear" else _ScaledLinear(8, 10)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    total, count = lm_loss_sum(hidden, head, torch.full((2, 5), -100))
    total.backward()
    assert float(total.detach()) == 0.0 and int(count) == 0
    assert all(p.grad is not None and not p.grad.any() for p in head.parameters())  # DDP: every param reached


def test_no_tensor_larger_than_a_chunk_of_logits_in_forward_or_backward():
    """20 targets among 2 x 30 positions, chunks of 4 rows, vocab 1000 (much more than the hidden size): no op
    makes a tensor of more than 4 x 1000 elements, while the full path makes 2 x 30 x 1000."""
    torch.manual_seed(0)
    head = nn.Linear(8, 1000, bias=False)
    hidden = torch.randn(2, 30, 8, requires_grad=True)
    labels = torch.full((2, 30), -100)
    labels[0, 5:15] = torch.randint(0, 1000, (10,))
    labels[1, 20:30] = torch.randint(0, 1000, (10,))
    rows = _row_counter(head)
    with _LargestTensor() as chunked:
        total, count = lm_loss_sum(hidden, head, labels, chunk_rows=4)
        total.backward()
    assert int(count) == 20  # (position t predicts labels[t + 1]: each labelled position is predicted)
    assert sum(rows) == int(count) and max(rows) == 4
    assert chunked.largest == max(4 * 1000, head.weight.numel())  # a chunk's logits, the weight's gradient
    with _LargestTensor() as full:
        F.cross_entropy(head(hidden)[:, :-1].reshape(-1, 1000), labels[:, 1:].reshape(-1)).backward()
    assert full.largest >= 2 * 29 * 1000


# -- Hub VLM families, the own VLM, causal LMs -----------------------------------------------------------------
def _image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (32, 40, 3), dtype=np.uint8), "RGB")


def _hub(tmp_path_factory, name: str, heads: bool = False, lora: bool = False):
    """(model in eval mode: no dropout, float32, eager attention; a 2-sample batch with images)."""
    from vlmtrain.data.hub_collate import HubVLMCollator
    from vlmtrain.data.hub_processing import HubVLMProcessor
    from vlmtrain.models.families import get_family
    from vlmtrain.models.kinds.hub_vlm import load_model
    from vlmtrain.models.objectives.heads import WithHeads, head_label_tensors, parse_heads

    family = get_family(name)
    path = family.build_tiny(str(tmp_path_factory.mktemp(name)), seed=0)
    torch.manual_seed(0)
    model = load_model(path, attn_implementation="eager")
    if heads:
        model = WithHeads(model, {"score": {"type": "regression"}})
    if lora:
        from vlmtrain.models.hub.lora import apply_lora

        if heads:
            model.base = apply_lora(model.base, {"r": 4}, family.text_module, dict(family.module_groups))
        else:
            model = apply_lora(model, {"r": 4}, family.text_module, dict(family.module_groups))
        for n, p in model.named_parameters():  # (LoRA's B starts at zero: give the adapters a gradient path)
            if "lora_B" in n:
                nn.init.normal_(p, std=0.1)
    samples = [{"images": [_image(i)], "texts": [{"user": f"What is {i}?", "assistant": f"It is {i} or {i + 1}."}],
                "labels": {"score": float(i)}} for i in range(2)]
    collate = HubVLMCollator(HubVLMProcessor(family.load_processor(path), family), label_collate=(
        (lambda raw: head_label_tensors(parse_heads({"score": {"type": "regression"}}), raw)) if heads
        else (lambda raw: {})))
    batch = {k: v for k, v in collate(samples).items() if k not in ("pack_stats", "skipped", "skipped_keys")}
    return model.eval(), batch


def _loss_and_grads(model: nn.Module, batch: dict, **kwargs) -> tuple[dict, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kwargs)
    out["loss"].backward()
    values = {k: float(v.detach()) for k, v in out.items() if k.startswith(("loss", "num_items")) and v is not None}
    return values, _grads(model)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("heads", [False, True], ids=["plain", "heads"])
def test_hub_family_loss_and_gradients_equal_the_full_logits(tmp_path_factory, monkeypatch, name, heads):
    monkeypatch.setattr(lm_loss, "CHUNK_ROWS", 3)  # several chunks on a tiny batch
    model, batch = _hub(tmp_path_factory, name, heads=heads)
    inner = model.base if heads else model
    assert decoder_and_head(inner) is not None and inner.vlmtrain_target_logits_module == "lm_head"
    rows = _row_counter(inner.lm_head)
    full, want = _loss_and_grads(model, batch)
    assert len(rows) == 1 and rows[0] == batch["input_ids"].numel()
    rows.clear()
    got, grads = _loss_and_grads(model, batch, loss_only=True)
    targets = int((batch["labels"][:, 1:] != -100).sum())
    assert sum(rows) == targets and max(rows) == 3 and len(rows) == -(-targets // 3)
    assert got["num_items" if not heads else "num_items_lm"] == targets
    assert got.keys() == full.keys() | {"num_items"}  # (transformers' own output has no count)
    for key, value in full.items():
        assert got[key] == pytest.approx(value, rel=1e-5), key
    _assert_close_grads(grads, want)
    assert "logits" not in model(**batch, loss_only=True)


@requires("peft", "lora")
@pytest.mark.parametrize("heads", [False, True], ids=["plain", "heads"])
def test_hub_lora_loss_and_gradients_equal_the_full_logits(tmp_path_factory, monkeypatch, heads):
    monkeypatch.setattr(lm_loss, "CHUNK_ROWS", 3)
    model, batch = _hub(tmp_path_factory, "qwen3_vl", heads=heads, lora=True)
    full, want = _loss_and_grads(model, batch)
    got, grads = _loss_and_grads(model, batch, loss_only=True)
    assert any("lora_A" in n for n in want) and not any("lm_head" in n for n in want)  # (the head is frozen)
    assert "logits" not in model(**batch, loss_only=True) and got["num_items" if not heads else "num_items_lm"] == int(
        (batch["labels"][:, 1:] != -100).sum())
    for key, value in full.items():
        assert got[key] == pytest.approx(value, rel=1e-5), key
    _assert_close_grads(grads, want)


def test_own_vlm_trains_on_target_rows_in_chunks_with_the_full_logits_gradients(monkeypatch):
    from tests.test_vlm_model import IMG, pad, sample, tiny_vlm

    monkeypatch.setattr(lm_loss, "CHUNK_ROWS", 2)
    model = tiny_vlm()
    ids, mask = pad([sample(2, 5, 0), sample(1, 7, 1), sample(0, 4, 2)], "right")
    labels = ids.masked_fill((mask == 0) | (ids == IMG), -100)
    labels[:, :3] = -100
    pixels = torch.randn(3, 3, 32, 32)
    full, want = _loss_and_grads(model.eval(), dict(input_ids=ids, attention_mask=mask, pixel_values=pixels,
                                                    labels=labels))
    rows = _row_counter(model.decoder.lm_head)
    for train, kwargs in ((True, {}), (False, {"loss_only": True})):  # training, and evaluation without logits
        rows.clear()
        got, grads = _loss_and_grads(model.train(train), dict(input_ids=ids, attention_mask=mask,
                                                              pixel_values=pixels, labels=labels), **kwargs)
        assert sum(rows) == int((labels[:, 1:] != -100).sum()) and max(rows) == 2
        assert got["loss"] == pytest.approx(full["loss"], rel=1e-5) and got["num_items"] == full["num_items"]
        _assert_close_grads(grads, want)


@pytest.mark.parametrize("model_type", [t for t in lm_loss.LOSS_ONLY_MODEL_TYPES if t not in FAMILIES])
def test_causal_lm_types_loss_and_gradients_equal_the_full_logits(monkeypatch, model_type):
    """Each causal LM type it enables: the same loss and gradients; generation is the model's own."""
    from transformers import AutoConfig, AutoModelForCausalLM

    monkeypatch.setattr(lm_loss, "CHUNK_ROWS", 4)
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :5] = -100
    before = model.generate(input_ids=ids[:, :6], max_new_tokens=4, do_sample=False)
    assert enable_lm_loss(model)
    assert torch.equal(model.generate(input_ids=ids[:, :6], max_new_tokens=4, do_sample=False), before)
    full, want = _loss_and_grads(model, {"input_ids": ids, "labels": labels})
    got, grads = _loss_and_grads(model, {"input_ids": ids, "labels": labels}, loss_only=True)
    assert got["loss"] == pytest.approx(full["loss"], rel=1e-5) and got["num_items"] == 2 * 7
    _assert_close_grads(grads, want)


def test_models_it_does_not_know_keep_their_forward():
    """Soft-capped logits (Gemma 2) or a type not checked: not enabled, forward untouched."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = AutoModelForCausalLM.from_config(config)
    assert config.final_logit_softcapping and not enable_lm_loss(model) and "forward" not in vars(model)
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2))
    assert not enable_lm_loss(gpt2) and "forward" not in vars(gpt2)


# -- the Trainer asks for it ------------------------------------------------------------------------------------
def test_trainer_uses_target_rows_in_training_and_loss_only_evaluation(tmp_path):
    """Training and evaluation without compute_metrics run the LM head on the target rows only, with the same
    eval loss as evaluation that keeps the logits for compute_metrics (which runs it on every position)."""
    from vlmtrain import Trainer, TrainingArguments
    from vlmtrain.data.collate import DefaultCollator

    model = tiny_llama(0)
    assert enable_lm_loss(model)
    samples = token_samples(8, seed=0)
    rows = _row_counter(model.lm_head)
    collator = DefaultCollator(pad_token_id=0)
    trainer = Trainer(model, TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                                               per_device_eval_batch_size=8, save_strategy="no", report_to="none",
                                               disable_tqdm=True, logging_steps=1),
                      train_dataset=samples[:8], eval_dataset=samples, data_collator=collator)
    targets = sum(sum(t != -100 for t in s["labels"][1:]) for s in samples)
    trainer.train()
    assert sum(rows) == targets  # two steps of 4 samples: all 8 samples' targets, nothing else
    rows.clear()
    loss_only = trainer.evaluate()["eval_loss"]
    assert sum(rows) == targets
    rows.clear()
    trainer.compute_metrics = lambda pred: {"n": float(len(pred.predictions))}
    with_logits = trainer.evaluate()
    assert sum(rows) == collator(samples)["input_ids"].numel() and with_logits["eval_n"] == 8
    assert with_logits["eval_loss"] == pytest.approx(loss_only, rel=1e-5)
