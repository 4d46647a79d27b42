"""The analytic FLOP count behind tflops_per_second / mfu, checked against torch's FlopCounterMode.

FlopCounterMode counts what the kernels compute: on CPU it sees eager attention's matmuls (SDPA's CPU kernel is
not counted at all, hence attn_implementation='eager' here) and it counts padding and the masked
cross-document blocks of a packed row, which the analytic count leaves out on purpose. So a padded or packed
batch is checked against its samples run one by one (each a forward + backward of its own).
"""

from __future__ import annotations

import json
import random
import warnings

import pytest
import torch
from PIL import Image
from tiny import TwoLossModel, tiny_llama, token_samples
from torch.utils.flop_counter import FlopCounterMode

from vlmtrain import Trainer, TrainingArguments
from vlmtrain.data.processing import VLMProcessor, build_chat_tokenizer
from vlmtrain.data.vlm_collate import VLMCollator
from vlmtrain.models.own_vlm.build import build_vlm
from vlmtrain.models.speed.flops import document_lengths, flop_counter
from vlmtrain.trainer.stats import BOOKKEEPING_KEYS

VISION = {"model_type": "siglip_vision_model", "image_size": 32, "patch_size": 8, "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
TEXT = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer(["What color is it? really red blue 0 1 2 3 4 5 6 7 8 9"] * 10, vocab_size=300)


def _vlm(tokenizer):
    torch.manual_seed(0)
    model = build_vlm(VISION, TEXT, pixel_shuffle_factor=2, tokenizer=tokenizer)
    model.set_attn_implementation("eager")  # (FlopCounterMode does not see CPU SDPA)
    return model


def _processor(tokenizer, model):
    return VLMProcessor(tokenizer, image_size=model.config.image_size,
                        image_token_length=model.config.image_token_length, max_length=128, max_images=3)


def _samples(n, same_length, seed=0):
    """the_cauldron samples with 1-2 images; same_length: one layout for all (no padding in a batch)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        images = 1 if same_length else rng.randint(1, 2)
        extra = 2 if same_length else rng.randint(0, 12)
        out.append({"images": [Image.new("RGB", (32, 32), (rng.randint(0, 255), 0, 0)) for _ in range(images)],
                    "texts": [{"user": "What color is it?" + " really" * extra, "assistant": "red"}]})
    return out


def _train_one_step(tmp_path, model, samples, collator, **args):
    """(FlopCounterMode's FLOPs of one Trainer step on all samples as one batch, the batch, the counter)."""
    batches = []

    def recording(s):
        batches.append(collator(s))
        return batches[-1]

    trainer = Trainer(model, TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=len(samples), save_strategy="no",
        disable_tqdm=True, report_to="none", logging_steps=1, **args), train_dataset=samples, data_collator=recording)
    mode = FlopCounterMode(display=False)
    with mode:
        trainer.train()
    assert len(batches) == 1
    return mode.get_total_flops(), batches[0], flop_counter(trainer.model)


def _alone(model, batch):
    """FlopCounterMode's FLOPs of forward + backward of a batch, as a training step runs it (the LM head at the
    targets only where the model takes loss_only)."""
    model.zero_grad(set_to_none=True)
    inputs = {k: v for k, v in batch.items() if k not in BOOKKEEPING_KEYS and not k.startswith("prompt_")}
    if getattr(model, "vlmtrain_accepts_loss_only", False):
        inputs["loss_only"] = True
    mode = FlopCounterMode(display=False)
    with mode:
        model(**inputs)["loss"].backward()
    model.zero_grad(set_to_none=True)
    return mode.get_total_flops()


@pytest.mark.parametrize("frozen", [None, "vision_encoder", "decoder"])
def test_vlm_training_step_matches_flop_counter(tmp_path, tokenizer, frozen):
    """All trainable (3x forward), a frozen vision tower before everything trainable (forward only), a frozen
    decoder behind a trainable projector (forward + input gradients): a real step's FLOPs, exactly (eager
    attention, no padding: the count and FlopCounterMode see the same matmuls)."""
    model = _vlm(tokenizer)
    rates = {frozen: 0.0} if frozen else None  # a learning rate of 0 freezes (requires_grad=False)
    measured, batch, count = _train_one_step(tmp_path, model, _samples(4, same_length=True),
                                             VLMCollator(_processor(tokenizer, model)), module_learning_rates=rates)
    assert "attention_mask" in batch and bool(batch["attention_mask"].all())  # no padding: like for like
    print(f"frozen={frozen}: counted / measured = {count(batch) / measured:.4f}")
    assert count(batch) == pytest.approx(measured, rel=1e-6)
    if frozen:  # and the freezing is what moved the count
        for p in model.parameters():
            p.requires_grad_(True)
        assert flop_counter(model)(batch) > 1.1 * count(batch)


def test_padded_and_packed_batches_count_real_tokens_and_documents(tmp_path, tokenizer):
    """A packed batch counts each document's own attention; it and the padded batch of the same samples count
    exactly what the samples cost run one by one (FlopCounterMode), and less than the packed step computes."""
    model = _vlm(tokenizer)
    proc, samples = _processor(tokenizer, model), _samples(6, same_length=False, seed=3)
    packer = VLMCollator(proc, pack_length=256, min_fill_gain=-1)  # always pack
    measured_packed, packed, count = _train_one_step(tmp_path, model, samples, packer)
    assert "attention_mask" not in packed and packed["pack_stats"]["rows"] < len(samples)
    docs = document_lengths(packed)
    assert sorted(docs.tolist()) == sorted(len(proc.process(s)["input_ids"]) for s in samples)  # pads left out
    padded = VLMCollator(proc)(samples)
    assert count(packed) == pytest.approx(count(padded), rel=1e-9)
    one_by_one = sum(_alone(model, VLMCollator(proc)([s])) for s in samples)
    print(f"packed: counted / one by one = {count(packed) / one_by_one:.4f}, packed step measured / counted = "
          f"{measured_packed / count(packed):.3f}")
    assert count(packed) == pytest.approx(one_by_one, rel=1e-6)
    assert measured_packed > 1.05 * count(packed)  # the row-long masked attention and the row padding


HUB_FAMILIES = ("qwen3_vl", "qwen2_5_vl", "idefics3", "smolvlm", "llava_onevision", "gemma3")


def _tiny_hub(tmp_path, name):
    """A family's tiny checkpoint and collator. Gemma 3's text layers slide a 32-token window, which eager attention
    computes as the full square (FlopCounterMode sees it, the count does not): widened past these samples here."""
    from vlmtrain.data.hub_collate import HubVLMCollator
    from vlmtrain.data.hub_processing import HubVLMProcessor
    from vlmtrain.models.families import get_family

    family = get_family("idefics3" if name == "smolvlm" else name)
    extra = {"model_type": "smolvlm"} if name == "smolvlm" else {}  # (SmolVLM2's model class)
    path = family.build_tiny(str(tmp_path / "ckpt"), seed=0, **extra)
    if name == "gemma3":
        config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
        config["text_config"]["sliding_window"] = 512
        (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    return family, path, HubVLMCollator(HubVLMProcessor(family.load_processor(path), family))


def _hub_sample(sizes, i=0):
    return {"images": [Image.new("RGB", size, (40 * i, 90, 20 * j)) for j, size in enumerate(sizes)],
            "texts": [{"user": "What colour?", "assistant": "Red."}]}


@pytest.mark.parametrize("name", HUB_FAMILIES)
def test_hub_vlm_step_matches_flop_counter(tmp_path, name):
    """Every Hub family (its image_tokens: Qwen patches from image_grid_thw and Qwen2.5-VL's windows, Idefics3's
    real crops (SmolVLM2 too), LLaVA-OneVision's anyres views, Gemma 3's fixed view and bare projection weight), all trainable
    and frozen vision: a real step's FLOPs, exactly (eager attention, no padding); and a batch of mixed image
    sizes and a two-image sample counts exactly what its samples cost run one by one."""
    from vlmtrain.models.kinds.hub_vlm import load_model

    family, path, collator = _tiny_hub(tmp_path, name)
    samples = [_hub_sample([(32, 48)], i) for i in range(3)]
    for frozen in (None, "vision"):
        model = load_model(path, attn_implementation="eager")
        rates = {frozen: 0.0} if frozen else None
        measured, batch, count = _train_one_step(tmp_path / str(frozen), model, samples, collator,
                                                 module_learning_rates=rates)
        assert bool(batch["attention_mask"].all()) and len(count.image_tokens(batch)) >= 3
        print(f"{name} frozen={frozen}: counted / measured = {count(batch) / measured:.4f}")
        assert count(batch) == pytest.approx(measured, rel=1e-6)
    mixed = [_hub_sample([(32, 48)]), _hub_sample([(64, 40)], 1), _hub_sample([(96, 80)], 2),
             _hub_sample([(40, 56), (72, 32)], 3)]
    one_by_one = sum(_alone(model, collator([s])) for s in mixed)
    assert count(collator(mixed)) == pytest.approx(one_by_one, rel=1e-6)


def test_metrics_rows_carry_tflops_and_mfu(tmp_path):
    """tflops_per_second / tokens_per_second is the count's FLOPs per real token (the time cancels): between a
    token's matmuls and those plus attention over the longest sample; mfu = tflops / peak_tflops."""
    args = dict(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, logging_steps=2,
                save_strategy="no", disable_tqdm=True, report_to="none", peak_tflops=0.5)
    trainer = Trainer(tiny_llama(), TrainingArguments(**args), train_dataset=token_samples(16, max_len=12))
    trainer.train()
    count = flop_counter(trainer.model)
    text = count.stages["text"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert len(train_rows) == 2
    for r in train_rows:
        per_token = r["tflops_per_second"] * 1e12 / r["tokens_per_second"]
        assert text.per_row <= per_token * 1.001 and per_token <= (text.per_row + 12 * text.attention[None]) * 1.001
        assert r["mfu"] == pytest.approx(r["tflops_per_second"] / 0.5, rel=1e-3)
    # 2 layers, 4 heads x 8, training: 2 * 4 * 32 * 3 per query-key pair; matmuls 6 x the Linear weights
    assert text.attention == {None: 2 * 4 * 32 * 3}
    linear = sum(m.weight.numel() for m in trainer.model.modules() if isinstance(m, torch.nn.Linear))
    assert text.per_row == 6 * linear


def test_a_model_it_does_not_understand_gets_no_tflops_and_one_warning(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert flop_counter(TwoLossModel()) is None
    assert len(caught) == 1 and "tflops_per_second / mfu are not logged" in str(caught[0].message)
    moe = tiny_llama()
    moe.model.layers[0].mlp.__class__ = type("LlamaSparseMoeBlock", (torch.nn.Module,), {})
    with pytest.warns(UserWarning, match="mixture-of-experts"):
        assert flop_counter(moe) is None


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen2_5_vl", "own"])
def test_a_text_only_batch_counts_the_text_model_alone(tmp_path, tokenizer, name, monkeypatch):
    """A batch without images (Qwen: no image_grid_thw; the own VLM: no pixel_values) counts the text model's FLOPs
    exactly: what its forward + backward cost (it used to raise 'cannot reshape tensor of 0 elements'). The dummy
    image the own VLM runs in training so that every parameter gets a gradient (models/vision/dummy_vision.py) is
    overhead, not model work: it is left out of the count, and of the measurement here."""
    from vlmtrain.models.kinds.hub_vlm import load_model

    text_only = [{"images": [], "texts": [{"user": "What colour is it?" + " really" * i, "assistant": "Red."}]}
                 for i in range(2)]
    if name == "own":
        model = _vlm(tokenizer)
        collator = VLMCollator(_processor(tokenizer, model))
        monkeypatch.setattr(model, "_dummy_image_zero", lambda embeds: embeds.new_zeros(()))
    else:
        _, path, collator = _tiny_hub(tmp_path, name)
        model = load_model(path, attn_implementation="eager")
    batch = collator(text_only)
    count = flop_counter(model)
    assert count.image_tokens(batch) == []
    one_by_one = sum(_alone(model, collator([s])) for s in text_only)
    assert count(batch) == pytest.approx(one_by_one, rel=1e-6)


def test_a_batch_it_cannot_count_leaves_its_window_out_with_a_warning():
    """A counting error is named in one warning; the window it happened in logs no tflops_per_second / mfu, the
    next windows do again (it used to stop them for the rest of the run)."""
    from vlmtrain.logging.throughput import WindowRates

    def count(batch):
        if batch.get("odd") is not None:
            raise ValueError("an odd batch")
        return 1e9

    rates, good = WindowRates(count, peak_tflops=1.0), {"input_ids": torch.ones(1, 4, dtype=torch.long)}
    with pytest.warns(UserWarning, match=r"counting a batch's FLOPs failed \(ValueError: an odd batch"):
        rates.add_batch({**good, "odd": torch.ones(1)}, 0.0)
        rates.add_batch({**good, "odd": torch.ones(1)}, 0.0)  # (the same cause: warned once)
    rates.add_batch(good, 0.0)
    assert "tflops_per_second" not in rates.compute(2) and "mfu" not in rates.compute(2)
    rates.reset()
    rates.add_batch(good, 0.0)
    assert {"tflops_per_second", "mfu"} <= set(rates.compute(1))
