"""data.pad_to_multiple_of for Hub VLMs: padded batches as long as their longest sample rounded up to a multiple
(fewer distinct shapes for torch.compile), computing what the unrounded batch computes."""

from __future__ import annotations

import pytest
import torch

from tests.test_hub_packing import _config, _forward, _parts, _samples, _tiny
from vlmtrain.config import ConfigError, load_run_config
from vlmtrain.data.hub_collate import HubVLMCollator
from vlmtrain.data.hub_processing import HubVLMProcessor
from vlmtrain.data.processing import IGNORE_INDEX


def test_padded_batches_round_their_length_up_and_compute_the_same(tmp_path, one_thread):
    """Every per-token key gets the rounded length (pad id, attention 0, label -100, token type 0 beyond the
    longest sample); the loss, the gradients and the logits at the real positions equal the unrounded batch's
    (Qwen3-VL: its multimodal positions come from the attention mask)."""
    family, processor, model = _parts("qwen3_vl", str(tmp_path))
    model.eval()  # no dropout; gradients still flow
    hub = HubVLMProcessor(processor, family, max_length=400, prompts=False)
    samples = _samples()
    plain = HubVLMCollator(hub)(samples)
    rounded = HubVLMCollator(hub, pad_to_multiple_of=64)(samples)
    width = plain["input_ids"].shape[1]
    assert width % 64 != 0
    assert rounded["input_ids"].shape[1] == -(-width // 64) * 64
    for key in ("input_ids", "attention_mask", "labels", "mm_token_type_ids"):
        assert rounded[key].shape == rounded["input_ids"].shape, key
        assert torch.equal(rounded[key][:, :width], plain[key]), key
    assert (rounded["input_ids"][:, width:] == processor.tokenizer.pad_token_id).all()
    assert (rounded["attention_mask"][:, width:] == 0).all() and (rounded["labels"][:, width:] == IGNORE_INDEX).all()
    logits, loss, grads = _forward(model, plain)
    logits_r, loss_r, grads_r = _forward(model, rounded)
    assert loss_r.item() == pytest.approx(loss.item(), rel=1e-5)
    real = plain["attention_mask"].bool()
    torch.testing.assert_close(logits_r[:, :width][real], logits[real], rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_r.keys()
    for name, g in grads.items():
        torch.testing.assert_close(grads_r[name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert pytest.raises(ValueError, HubVLMCollator, hub, pad_to_multiple_of=0)


def test_the_config_key_reaches_the_trainers_collator_and_is_checked(tmp_path):
    from vlmtrain import run

    config = _config(tmp_path, _tiny("qwen3_vl", str(tmp_path)))
    with pytest.raises(ConfigError, match=r"data.pad_to_multiple_of must be >= 1 or null, got 0"):
        load_run_config(config, {"data.pad_to_multiple_of": 0})
    trainer = run.build(load_run_config(config, {"data.packing": False, "data.pad_to_multiple_of": 32}))
    batch = trainer.data_collator(_samples())
    assert batch["input_ids"].shape[1] % 32 == 0
    assert trainer.data_collator.without_packing().pad_to_multiple_of == 32
