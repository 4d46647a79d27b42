"""Packing: the knapsack, per-sample masking (packed logits == alone), loss, collators, Trainer logging."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from PIL import Image

from tests.test_vlm_model import IMG, VOCAB, L, sample, tiny_vlm
from tests.tiny import tiny_llama, token_samples
from vlmtrain import Trainer, TrainingArguments
from vlmtrain.data.packing import PackingCollator, check_packing, pack_items, pack_lengths, worth_packing
from vlmtrain.data.processing import IGNORE_INDEX, VLMProcessor, build_chat_tokenizer
from vlmtrain.data.vlm_collate import VLMCollator


def test_knapsack_places_every_item_once_within_capacity_and_image_cap():
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(300)]
    images = [rng.randint(0, 3) for _ in range(300)]
    bins = pack_lengths(lengths, 128, images, max_images=4)
    assert sorted(i for b in bins for i in b) == list(range(300))
    assert all(sum(lengths[i] for i in b) <= 128 and sum(images[i] for i in b) <= 4 for b in bins)
    assert bins == pack_lengths(lengths, 128, images, max_images=4)  # deterministic
    assert all(b == sorted(b) for b in bins) and [b[0] for b in bins] == sorted(b[0] for b in bins)
    lower_bound = max(math.ceil(sum(lengths) / 128), math.ceil(sum(images) / 4))
    assert len(bins) <= 1.03 * lower_bound, (len(bins), lower_bound)  # both resources near their bound
    fill = sum(lengths) / (len(pack_lengths(lengths, 128)) * 128)
    assert fill > 0.97, fill  # no image cap: the tokens alone
    assert pack_lengths([64, 64, 64, 64], 128) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="item 1 has 200 tokens"):
        pack_lengths([10, 200], 128)


def test_pack_items_restarts_positions_and_cuts_labels_at_boundaries():
    items = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]},
             {"input_ids": [6, 7, 8, 9], "labels": [-100, 7, 8, 9]}]
    batch, bins = pack_items(items, 6, pad_token_id=0)
    assert bins == [[0], [1, 2]]
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 8, 9]]  # best fit: 2 joins 4
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3]]
    # each sample's first label is -100: the token before it (another sample's) never predicts it
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, -100, -100], [-100, 5, -100, 7, 8, 9]]


def _packed_vs_alone(model, seqs, pack_length, pixel_values=None):
    """Max |logit difference| between each sequence inside its pack and the sequence run alone."""
    items = [{"input_ids": s, "labels": s} for s in seqs]
    batch, bins = pack_items(items, pack_length, pad_token_id=0)
    assert bins == pack_lengths([len(s) for s in seqs], pack_length) and len(bins) < len(seqs)  # rows shared
    order = [i for b in bins for i in b]
    kwargs = {"pixel_values": torch.cat([pixel_values[i] for i in order])} if pixel_values is not None else {}
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
                       **kwargs)["logits"]
    worst = 0.0
    for row, members in enumerate(bins):
        at = 0
        for i in members:
            n = len(seqs[i])
            assert batch["input_ids"][row, at:at + n].tolist() == seqs[i]
            alone_kwargs = {"pixel_values": pixel_values[i]} if pixel_values is not None else {}
            with torch.no_grad():
                alone = model(input_ids=torch.tensor([seqs[i]]), attention_mask=torch.ones(1, n, dtype=torch.long),
                              **alone_kwargs)["logits"][0]
            worst = max(worst, float((packed[row, at:at + n] - alone).abs().max()))
            at += n
    return worst


def test_packed_logits_equal_alone_for_a_plain_lm():
    model = tiny_llama().eval()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, 48, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (12,), generator=g)]
    assert _packed_vs_alone(model, seqs, pack_length=40) < 1e-5
    assert check_packing(model, vocab_size=48) < 1e-5


def test_packed_logits_equal_alone_for_the_vlm():
    model = tiny_vlm()
    seqs = [sample(n_images, n_text, seed) for seed, (n_images, n_text) in
            enumerate([(1, 3), (0, 6), (2, 2), (1, 9), (0, 2), (3, 1), (1, 5)])]
    g = torch.Generator().manual_seed(2)
    pixels = [torch.randn(s.count(IMG) // L, 3, 32, 32, generator=g) for s in seqs]
    assert _packed_vs_alone(model, seqs, pack_length=48, pixel_values=pixels) < 1e-5
    assert check_packing(model, vocab_size=VOCAB) < 1e-5


def test_check_packing_catches_a_model_that_ignores_positions():
    model = tiny_llama().eval()
    forward = model.forward

    def leaky(input_ids, position_ids=None, attention_mask=None, **kw):  # a plain causal mask across samples
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return forward(input_ids=input_ids, attention_mask=attention_mask, **kw)

    model.forward = leaky
    assert check_packing(model, vocab_size=48) > 1e-3


def test_a_batch_is_packed_only_when_that_fills_it_better():
    uniform = [{"input_ids": list(range(1, 11)), "labels": list(range(1, 11))} for _ in range(8)]
    varied = [{"input_ids": list(range(1, n)), "labels": list(range(1, n))} for n in (4, 30, 5, 6, 3, 7, 4, 5)]
    collate = PackingCollator(pack_length=32, pad_token_id=0)
    padded = collate(uniform)  # 3 rows of 32 would be less full than 8 rows of 10: padded
    assert "position_ids" not in padded and padded["input_ids"].shape == (8, 10)
    assert padded["pack_stats"] == {"samples": 8, "tokens": 80, "rows": 8, "capacity": 80, "images": 0}
    packed = collate(varied)
    assert "position_ids" in packed and packed["input_ids"].shape == (2, 32)  # 56 tokens
    assert worth_packing([10] * 8, 3, 32) is False and worth_packing([3, 29, 4], 2, 32) is True


def test_packed_loss_and_num_items_equal_the_padded_batch():
    model = tiny_llama().eval()
    samples = token_samples(10, seed=3)
    padded = {k: v for k, v in _pad_collate(samples).items()}
    packed = PackingCollator(pack_length=32, pad_token_id=0)(samples)
    assert packed["pack_stats"]["samples"] == 10 and packed["pack_stats"]["rows"] == packed["input_ids"].shape[0]
    with torch.no_grad():
        a = model(**padded)
        b = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], labels=packed["labels"],
                  use_cache=False)
    n_targets = sum(sum(1 for t in s["labels"][1:] if t != IGNORE_INDEX) for s in samples)
    assert int((packed["labels"] != IGNORE_INDEX).sum()) == n_targets
    assert torch.allclose(a.loss, b.loss, atol=1e-6)


def _pad_collate(samples):
    from vlmtrain.data.collate import DefaultCollator

    batch = DefaultCollator(0)(samples)
    return {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}


def _shapes_like(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        images = [Image.new("RGB", (16, 16), (rng.randint(0, 255), 0, 0)) for _ in range(rng.randint(0, 2))]
        turns = [{"user": "What color is it?" + " really" * rng.randint(0, 8), "assistant": f"red {i}"}
                 for _ in range(rng.randint(1, 3))]
        out.append({"images": images, "texts": turns})
    return out


@pytest.fixture(scope="module")
def proc():
    tok = build_chat_tokenizer(["What color is it? really red 0 1 2 3 4 5 6 7 8 9"] * 10, vocab_size=300)
    return VLMProcessor(tok, image_size=16, image_token_length=4, max_length=160, max_images=2)


def test_vlm_collator_packs_with_images_in_row_order_and_unpacks_for_eval(proc):
    samples = _shapes_like(12)
    packed = VLMCollator(proc, pack_length=192, max_images_per_pack=3, min_fill_gain=-1)(samples)  # always pack
    padded = VLMCollator(proc)(samples)
    stats = packed["pack_stats"]
    assert "attention_mask" not in packed and packed["input_ids"].shape == (stats["rows"], 192)
    assert stats["samples"] == 12 and stats["tokens"] == int(padded["attention_mask"].sum())
    assert stats["rows"] < 12 and stats["images"] == padded["pixel_values"].shape[0]
    # at most 3 image runs per row, and images follow the placeholders' order row by row
    runs = (packed["input_ids"] == proc.image_token_id).sum(1) // 4
    assert runs.max() <= 3 and int(runs.sum()) == packed["pixel_values"].shape[0]
    processed = [proc.process(s) for s in samples]
    order = _order_in_rows(packed, processed)
    expected = [p["pixel_values"] for i in order for p in [processed[i]] if p["pixel_values"].shape[0]]
    assert torch.equal(packed["pixel_values"], torch.cat(expected))
    # prompts (generation) stay per sample, in sample order
    assert torch.equal(packed["prompt_input_ids"], padded["prompt_input_ids"])
    assert torch.equal(packed["prompt_pixel_values"], padded["pixel_values"])
    assert VLMCollator(proc, pack_length=192).without_packing().pack_length is None
    with pytest.raises(ValueError, match="shorter than the processor's max_length"):
        VLMCollator(proc, pack_length=100)


def _order_in_rows(packed, processed):
    """Which processed sample sits where, read back from the packed rows."""
    order = []
    for r in range(packed["input_ids"].shape[0]):
        ids, pos = packed["input_ids"][r], packed["position_ids"][r]
        starts = (pos == 0).nonzero().flatten().tolist() + [len(pos)]
        for a, b in zip(starts, starts[1:]):
            match = [i for i, p in enumerate(processed) if i not in order and len(p["input_ids"]) == b - a
                     and torch.equal(p["input_ids"], ids[a:b])]
            if match:
                order.append(match[0])
    assert sorted(order) == list(range(len(processed)))
    return order


def test_trainer_logs_pack_fill_and_matches_padded_training(tmp_path):
    """Same samples per step, packed or padded: the same losses (packing is layout only) + fill in the log."""
    samples = token_samples(64, seed=4, max_len=30)
    losses = {}
    for name, collator in (("padded", None), ("packed", PackingCollator(64, pad_token_id=0, min_fill_gain=-1))):
        args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=6, per_device_train_batch_size=8,
                                 learning_rate=1e-3, logging_steps=1, save_strategy="no", disable_tqdm=True,
                                 report_to="none", seed=0)
        Trainer(model=tiny_llama(), args=args, train_dataset=samples, data_collator=collator).train()
        rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
        losses[name] = [r["loss"] for r in rows if "loss" in r and "step" in r and "train_runtime" not in r]
        if name == "packed":
            logged = [r for r in rows if "pack_fill" in r]
            assert logged and all(0.5 < r["pack_fill"] <= 1 and r["padding_fraction"] == pytest.approx(
                1 - r["pack_fill"], abs=1e-4) for r in logged)
            assert all(r["samples_per_second"] > 0 for r in logged)
    assert len(losses["packed"]) == 6
    assert losses["packed"] == pytest.approx(losses["padded"], abs=1e-5)


def test_config_packs_by_default_pads_when_off_and_refuses_an_unsafe_model(tmp_path, monkeypatch):
    from tests.test_vlm_run import _config
    from vlmtrain import run
    from vlmtrain.config import ConfigError

    cfg = _config(tmp_path, data={"max_length": 200, "max_images_per_pack": 4})
    metrics = run.train(cfg)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    packed = [r for r in rows if "pack_fill" in r]
    assert len(packed) == 2 and all(0 < r["pack_fill"] <= 1 and r["images_per_pack"] <= 4 for r in packed)
    assert all(0 <= metrics[f"eval_{q}_exact_match"] <= 1 for q in ("color", "multi_count"))

    off = run.build(_config(tmp_path, data={"packing": False}))
    assert off.data_collator.pack_length is None
    with pytest.raises(ConfigError, match="pack_length=300 is below data.max_length=512"):
        _config(tmp_path, data={"pack_length": 300})
    on = run.build(_config(tmp_path, data={"pack_length": 300, "max_length": 300}))
    assert on.data_collator.pack_length == 300 and on.get_eval_dataloader().collate_fn.pack_length is None

    monkeypatch.setattr("vlmtrain.data.packing.check_packing", lambda model, vocab: 0.5)  # a leaky model
    with pytest.raises(ConfigError, match="data.packing=true but VisionLanguageModel does not keep packed"):
        run.build(_config(tmp_path, data={"packing": True}))
    assert run.build(_config(tmp_path)).data_collator.pack_length is None  # auto: falls back to padding


def _window_stream(proc, n=120, window=40):
    from vlmtrain.data.pack_stream import PackedDataset
    from vlmtrain.data.sources import IndexedSource, StreamingDataset

    samples = _shapes_like(n, seed=7) + [{"texts": []}]  # one bad sample, counted on a row
    stream = StreamingDataset([IndexedSource(samples, block_size=16)], seed=0)
    return PackedDataset(stream, proc.process, pack_length=192, pad_token_id=proc.tokenizer.pad_token_id,
                         window=window, max_images_per_pack=4)


def test_window_packing_fills_rows_and_keeps_every_sample(proc):
    from vlmtrain.data.pack_stream import collate_rows

    rows = list(_window_stream(proc))
    stats = collate_rows(rows)["pack_stats"]
    assert stats["samples"] == 120 and stats["rows"] == len(rows)
    assert sum(sum(r["skipped"].values()) for r in rows) == 1
    lengths = [len(proc.process(s)["input_ids"]) for s in _shapes_like(120, seed=7)]
    assert stats["tokens"] == sum(lengths)
    full = [r for r in rows if r["pack_stats"]["tokens"]]
    # rows packed from a window of 40 samples are fuller than rows packed from batches of 8
    per_batch = [VLMCollator(proc, pack_length=192, max_images_per_pack=4)(_shapes_like(120, seed=7)[i:i + 8])
                 ["pack_stats"] for i in range(0, 120, 8)]
    batch_fill = sum(p["tokens"] for p in per_batch) / sum(p["capacity"] for p in per_batch)
    assert stats["tokens"] / stats["capacity"] > batch_fill + 0.08, (stats, batch_fill)  # 0.89 vs 0.78
    assert all(int((r["position_ids"] == 0).sum()) >= 1 for r in full)
    assert all((r["input_ids"] == proc.image_token_id).sum() == 4 * r["pixel_values"].shape[0] for r in full)


def test_window_packing_resumes_mid_window(proc):
    from vlmtrain.data.pack_stream import collate_rows

    def loader(ds, workers):
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(ds, batch_size=3, num_workers=workers, collate_fn=collate_rows)

    for workers in (0, 2):
        full = [b["input_ids"] for b in loader(_window_stream(proc), workers)]
        first = loader(_window_stream(proc), workers)
        it = iter(first)
        head = [next(it)["input_ids"] for _ in range(4)]  # the window boundary is not at a batch boundary
        state = first.state_dict()
        resumed = loader(_window_stream(proc), workers)
        resumed.load_state_dict(state)
        tail = [b["input_ids"] for b in resumed]
        assert len(head + tail) == len(full)
        assert all(torch.equal(a, b) for a, b in zip(head + tail, full))


@pytest.mark.parametrize("num_train", [96, 16], ids=["mid-epoch", "epoch-end"])
def test_config_pack_window_trains_on_full_rows_and_resumes(tmp_path, num_train):
    """Resumed from checkpoint-2, mid-epoch or (16 samples: 2 steps an epoch, the second a partial batch; no
    evaluation) at the epoch's end, which goes on with the next epoch: the uninterrupted run's losses and weights
    (AdamW, weight decay)."""
    from safetensors.torch import load_file

    from tests.test_vlm_run import _config
    from vlmtrain import run
    from vlmtrain.data.pack_stream import PackedDataset

    def config(out):
        cfg = _config(tmp_path, data={"max_length": 200, "pack_window": 32, "num_train": num_train},
                      train={"max_steps": 4, "save_steps": 2, "eval_steps": 4, "per_device_train_batch_size": 3,
                             "weight_decay": 0.1, "eval_strategy": "steps" if num_train == 96 else "no"})
        cfg.train.output_dir = str(tmp_path / out)
        return cfg

    straight = config("straight")
    trainer = run.build(straight)
    assert isinstance(trainer.train_dataset, PackedDataset)
    metrics = run.train(straight)
    assert num_train != 96 or 0 <= metrics["eval_color_exact_match"] <= 1  # evaluation pads, one sample per row
    rows = [json.loads(line) for line in open(tmp_path / "straight" / "metrics.jsonl")]
    logged = [r for r in rows if "pack_fill" in r]
    assert len(logged) == 4 and all(r["samples_per_second"] > 0 for r in logged)
    resumed = config("resumed")
    resumed.train.resume_from_checkpoint = str(tmp_path / "straight" / "checkpoint-2")
    run.train(resumed)
    again = [json.loads(line) for line in open(tmp_path / "resumed" / "metrics.jsonl")]
    loss = {r["step"]: r["loss"] for r in rows if "loss" in r and "train_runtime" not in r}
    loss_resumed = {r["step"]: r["loss"] for r in again if "loss" in r and "train_runtime" not in r}
    assert loss_resumed == {3: loss[3], 4: loss[4]}
    wa, wb = (load_file(str(tmp_path / name / "checkpoint-4" / "model.safetensors")) for name in ("straight", "resumed"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
