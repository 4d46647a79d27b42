"""Padding-free packing for Hub VLMs: packed rows compute exactly what the unpacked samples do, per family.

Per family (tiny checkpoints, fp32, sdpa and eager): the logits at every sample's real positions, the loss and
every parameter gradient of a packed batch equal the padded batch's of the same samples; Qwen's multimodal
positions are each sample's own; the window-packed stream resumes to the same rows; bad combinations (score
heads, Gemma 3, an attention kernel that cannot keep samples apart, flash-attention not installed) are
ConfigErrors before any work.
"""

from __future__ import annotations

import functools
import importlib.util
import json

import numpy as np
import pytest
import torch
import yaml

from tests.test_hub_families import _image  # a random colourful image
from vlmtrain.config import ConfigError, load_run_config
from vlmtrain.data.hub_collate import HubVLMCollator
from vlmtrain.data.hub_processing import HubVLMProcessor
from vlmtrain.models.families import get_family

# family name -> build_tiny options (smolvlm: the SmolVLM2 class of the idefics3 family)
PACKING = {"qwen3_vl": {}, "qwen2_5_vl": {}, "idefics3": {}, "smolvlm": {"model_type": "smolvlm"},
           "llava_onevision": {}}
IMAGES = (1, 0, 2, 1, 3)  # images per sample: text-only and multi-image samples share rows


def _sample(n_images: int, seed: int) -> dict:
    sizes = [(40, 30), (24, 48), (32, 32)]
    return {"images": [_image(seed * 10 + i, sizes[(seed + i) % 3]) for i in range(n_images)],
            "texts": [{"user": f"What is {seed}?" + " more" * seed, "assistant": f"It is {seed}."},
                      {"user": "And?", "assistant": f"Done {seed}"}]}


def _samples() -> list[dict]:
    return [_sample(n, seed=i) for i, n in enumerate(IMAGES)]


@functools.cache
def _tiny(name: str, root: str) -> str:
    family = get_family("idefics3" if name == "smolvlm" else name)
    return family.build_tiny(f"{root}/{name}", seed=0, **PACKING.get(name, {}))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hub_packing"))


def _parts(name: str, root: str, attn: str = "sdpa"):
    from transformers import AutoModelForImageTextToText

    path = _tiny(name, root)
    family = get_family("idefics3" if name == "smolvlm" else name)
    processor = family.load_processor(path)
    model = AutoModelForImageTextToText.from_pretrained(path, attn_implementation=attn)
    return family, processor, model


def _collators(family, processor, model, pack_length: int, flatten: bool = False):
    hub = HubVLMProcessor(processor, family, max_length=pack_length, prompts=False)
    packed = HubVLMCollator(hub, pack_length=pack_length, model_config=model.config, flatten=flatten,
                            min_fill_gain=-1.0)  # always pack, however the fill compares
    return packed, packed.without_packing()


def _inputs(batch: dict) -> dict:
    """The model's inputs (a packed batch's use_cache=False included: with a cache transformers builds no
    per-sample mask)."""
    return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) or k == "use_cache"}


def _forward(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    out = model(**_inputs(batch))
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def _documents(batch: dict) -> list[tuple[int, int]]:
    """(flat start, length) of each packed sample, read from the text-position row (restarts at 0)."""
    pos = batch["position_ids"]
    text = (pos[0] if pos.dim() == 3 else pos).reshape(-1)
    starts = (text == 0).nonzero().flatten().tolist() + [len(text)]
    return [(a, b - a) for a, b in zip(starts, starts[1:])]


def assert_documents_match(logits: torch.Tensor, packed: dict, ref_logits: torch.Tensor, padded: dict,
                           n_samples: int) -> None:
    """Every sample's packed logits equal its padded ones at its real positions (1e-5); each sample is found by
    its tokens among the packed documents."""
    flat = logits.reshape(-1, logits.shape[-1])
    ids = packed["input_ids"].reshape(-1)
    lengths = padded["attention_mask"].sum(1).tolist()
    matched = 0
    for start, n in _documents(packed):
        for i, length in enumerate(lengths):
            if length == n and torch.equal(ids[start:start + n], padded["input_ids"][i, :n]):
                torch.testing.assert_close(flat[start:start + n], ref_logits[i, :n], rtol=1e-5, atol=1e-5)
                matched += 1
                break
    assert matched == n_samples


@pytest.mark.parametrize("name", list(PACKING))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logits_loss_and_gradients_equal_unpacked(root, name, attn, one_thread):
    family, processor, model = _parts(name, root, attn)
    model.eval()  # no dropout; gradients still flow
    pack, pad = _collators(family, processor, model, pack_length=400)
    samples = _samples()
    packed, padded = pack(samples), pad(samples)
    assert "attention_mask" not in packed and packed["input_ids"].shape[0] < len(samples)
    stats = packed["pack_stats"]
    assert stats["samples"] == len(samples) and stats["rows"] == packed["input_ids"].shape[0]
    logits, loss, grads = _forward(model, packed)
    ref_logits, ref_loss, ref_grads = _forward(model, padded)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for group in ("vision", "projector", "text"):  # gradients reach the image tower through the packed rows
        assert any(n.startswith(family.module_groups[group]) for n in grads), group
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-5, msg=n)
    assert_documents_match(logits, packed, ref_logits, padded, len(samples))


@pytest.mark.parametrize("name", ["qwen3_vl", "idefics3"])
def test_flattened_rows_for_flash_attention_compute_the_same(root, name, one_thread):
    """flatten (what flash_attention_2 gets: one row, documents found from its positions) on sdpa: same loss."""
    family, processor, model = _parts(name, root)
    model.eval()
    rows, _ = _collators(family, processor, model, pack_length=400)
    one, _ = _collators(family, processor, model, pack_length=400, flatten=True)
    samples = _samples()
    a, b = rows(samples), one(samples)
    assert b["input_ids"].shape == (1, a["input_ids"].numel())
    assert torch.equal(b["position_ids"], a["position_ids"].reshape(*a["position_ids"].shape[:-2], 1, -1))
    with torch.no_grad():
        loss_rows = model(**_inputs(a)).loss
        loss_one = model(**_inputs(b)).loss
    torch.testing.assert_close(loss_one, loss_rows, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen2_5_vl"])
def test_qwen_positions_are_each_samples_own_under_a_restarting_text_row(root, name):
    family, processor, model = _parts(name, root)
    pack, pad = _collators(family, processor, model, pack_length=400)
    samples = _samples()
    packed, padded = pack(samples), pad(samples)
    pos = packed["position_ids"]
    assert pos.shape == (4, *packed["input_ids"].shape)
    # the model's own positions for the padded batch (get_rope_index over the batch, padding masked)
    ref, _ = model.model.get_rope_index(padded["input_ids"], padded["mm_token_type_ids"],
                                        image_grid_thw=padded["image_grid_thw"],
                                        attention_mask=padded["attention_mask"])
    flat = pos.reshape(4, -1)
    ids = packed["input_ids"].reshape(-1)
    lengths = padded["attention_mask"].sum(1).tolist()
    for start, n in _documents(packed):
        assert torch.equal(flat[0, start:start + n], torch.arange(n))
        match = [i for i, length in enumerate(lengths)
                 if length == n and torch.equal(ids[start:start + n], padded["input_ids"][i, :n])]
        if match:  # (the runs after the last sample of a row are padding)
            assert torch.equal(flat[1:, start:start + n], ref[:, match[0], :n])
    # image grids (and their pixels) follow the row order, the order the model meets the image tokens
    order = [i for start, n in _documents(packed) for i, length in enumerate(lengths)
             if length == n and torch.equal(ids[start:start + n], padded["input_ids"][i, :n])]
    grids = [pad([samples[i]])["image_grid_thw"] for i in order if IMAGES[i]]
    assert torch.equal(packed["image_grid_thw"], torch.cat(grids))


def test_gemma3_is_refused_because_its_packed_logits_differ(root, tmp_path, one_thread):
    """The refusal is needed: transformers' sliding-window mask misplaces Gemma 3's image blocks when packed."""
    from transformers import AutoModelForImageTextToText

    from vlmtrain.data.hub_packing import pack_hub_items
    from vlmtrain.models.kinds import get_kind

    family = get_family("gemma3")
    path = family.build_tiny(str(tmp_path / "gemma3"), seed=0)
    processor = family.load_processor(path)
    model = AutoModelForImageTextToText.from_pretrained(path, attn_implementation="sdpa").eval()
    hub = HubVLMProcessor(processor, family, prompts=False)
    items = [hub.process(s) for s in _samples()[:3]]
    batch = pack_hub_items(items, [[0, 1, 2]], 400, family, processor.tokenizer.pad_token_id)
    pad = HubVLMCollator(hub)
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]  # (use_cache=False)
        at, worst = 0, 0.0
        for sample, item in zip(_samples(), items):
            n = len(item["input_ids"])
            ref = model(**_inputs(pad([sample]))).logits[0]
            worst = max(worst, float((packed[at:at + n] - ref).abs().max()))
            at += n
    assert worst > 1e-2  # (else lift the refusal: Family.packing_unsupported)
    cfg = load_run_config(_config(tmp_path, path))
    with pytest.raises(ConfigError, match="the gemma3 family cannot pack: its image tokens attend"):
        get_kind("hub_vlm").validate(cfg)


def _config(tmp_path, pretrained: str, **data) -> str:
    rows = []
    for i, n in enumerate(IMAGES * 2):
        for j in range(n):
            _image(i * 10 + j, (32, 32)).save(tmp_path / f"{i}_{j}.png")
        rows.append({"images": [f"{i}_{j}.png" for j in range(n)],
                     "texts": [{"user": "What is it?" + " more" * i, "assistant": f"It is {i}."}]})
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"model": {"kind": "hub_vlm", "pretrained": pretrained},
           "data": {"source": "jsonl", "train_file": str(tmp_path / "data.jsonl"), "max_length": 300,
                    "packing": True, **data},
           "train": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "per_device_train_batch_size": 4,
                     "logging_steps": 1, "save_steps": 2, "learning_rate": 1e-3, "disable_tqdm": True}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return str(tmp_path / "cfg.yaml")


def test_bad_packing_combinations_fail_before_any_work(root, tmp_path):
    config = _config(tmp_path, _tiny("qwen3_vl", root))
    heads = {"color": {"type": "classification", "num_outputs": 3}}
    with pytest.raises(ConfigError, match="data.packing=true with model.heads"):
        load_run_config(config, {"model.heads": heads})
    with pytest.raises(ConfigError, match="model.attn_implementation='flex_attention'"):
        load_run_config(config, {"model.attn_implementation": "flex_attention"})
    with pytest.raises(ConfigError, match="pack_length=100 is below data.max_length=300"):
        load_run_config(config, {"data.pack_length": 100})
    load_run_config(config, {"model.heads": heads, "data.packing": False})  # heads pad: fine
    for packing in (None, False):  # padding: every packing key is refused alike, naming itself
        for key, value in (("pack_window", 8), ("pack_length", 400), ("max_images_per_pack", 2),
                           ("max_patches_per_pack", 192)):
            with pytest.raises(ConfigError, match=rf"data.{key}={value} is a packing setting, but Hub VLM "
                                                  rf"batches are packed only with data.packing: true \(got {packing}\)"):
                load_run_config(config, {"data.packing": packing, f"data.{key}": value})
    if importlib.util.find_spec("flash_attn") is None:
        from vlmtrain.models.kinds import get_kind

        cfg = load_run_config(config, {"model.attn_implementation": "flash_attention_2"})
        with pytest.raises(ConfigError, match="flash_attn package is not installed"):
            get_kind("hub_vlm").validate(cfg)


def test_collator_refuses_head_labels_and_too_short_rows(root):
    family, processor, model = _parts("qwen3_vl", root)
    with pytest.raises(ValueError, match="pack_length=50 is shorter than max_length=400"):
        HubVLMCollator(HubVLMProcessor(processor, family, max_length=400), pack_length=50,
                       model_config=model.config)
    pack, _ = _collators(family, processor, model, pack_length=400)
    with pytest.raises(ValueError, match="cannot carry head labels"):
        pack([{**_sample(1, 0), "labels": {"color": 1}}])


@pytest.mark.slow
def test_config_trains_packed_and_window_packed_rows_resume_exactly(root, tmp_path, one_thread):
    """data.packing through run.build (batches packed, evaluation padded) and data.pack_window: rows after a
    mid-window resume are exactly the uninterrupted stream's."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from vlmtrain import run
    from vlmtrain.data.pack_stream import PackedDataset

    config = _config(tmp_path, _tiny("qwen3_vl", root))
    trainer = run.build(load_run_config(config))
    varied = _samples() + [_sample(0, 40)]  # (packed: fills rows better than padding)
    batch = trainer.data_collator(varied)
    assert batch["position_ids"].shape[0] == 4 and "attention_mask" not in batch
    assert "attention_mask" in trainer.data_collator.without_packing()(varied)  # evaluation: one sample per row
    metrics = run.train(load_run_config(config))
    assert np.isfinite(metrics["train_loss"])

    def stream():
        trainer = run.build(load_run_config(config, {"data.pack_window": 4}))
        assert isinstance(trainer.train_dataset, PackedDataset)
        return trainer.train_dataset, trainer.data_collator

    def loader(ds, collate):
        return StatefulDataLoader(ds, batch_size=3, num_workers=0, collate_fn=collate)

    ds, collate = stream()
    full = list(loader(ds, collate))
    assert len(full) >= 2 and all(b["position_ids"].shape[0] == 4 for b in full)
    assert sum(b["pack_stats"]["samples"] for b in full) == len(IMAGES) * 2  # every sample, once
    ds, collate = stream()
    first = loader(ds, collate)
    it = iter(first)
    head = [next(it)]  # 3 rows from windows of 4 samples
    state = first.state_dict()
    assert state["dataset_state"]["rows_done"] > 0  # resumed inside a window: re-packed, its first rows skipped
    ds, collate = stream()
    resumed = loader(ds, collate)
    resumed.load_state_dict(state)
    tail = list(resumed)
    assert len(head + tail) == len(full)
    for a, b in zip(head + tail, full):
        for key in ("input_ids", "labels", "position_ids", "pixel_values", "image_grid_thw"):
            assert torch.equal(a[key], b[key]), key


def test_flops_count_each_packed_sample_as_its_own_sequence(root):
    """The logged TFLOP/s read documents from the text row of Qwen's [4, rows, L] positions."""
    from vlmtrain.models.speed.flops import document_lengths

    family, processor, model = _parts("qwen3_vl", root)
    pack, pad = _collators(family, processor, model, pack_length=400)
    samples = _samples()
    lengths = sorted(pad(samples)["attention_mask"].sum(1).tolist())
    assert sorted(document_lengths(pack(samples)).tolist()) == lengths  # (row-end padding left out)


def test_no_target_crosses_a_sample_boundary():
    """A sample's first label is -100 in a row (the previous sample's last token never predicts it), even where
    the sample supervises its first token; the row's end is padding with its own positions."""
    from vlmtrain.data.hub_packing import pack_hub_items

    items = [{"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([5, 6, 7])},
             {"input_ids": torch.tensor([8, 9]), "labels": torch.tensor([8, 9])}]
    batch = pack_hub_items(items, [[0, 1]], 7, get_family("idefics3"), pad_token_id=0)
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, -100]]
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1]]
