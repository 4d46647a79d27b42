"""Hub VLM samples, every family at tiny size: images where `<image>` placeholders put them, image-size bounds
(data.max_pixels / min_pixels / max_image_tokens), and bad input skipped and counted by its own reason
(no_target, control_token_in_text, placeholder_in_assistant, placeholder_mismatch, bad_aspect_ratio, ...)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from PIL import Image

from vlmtrain import run
from vlmtrain.config import ConfigError, load_run_config
from vlmtrain.data.hub_collate import HubVLMCollator
from vlmtrain.data.hub_messages import processor_error_reason
from vlmtrain.data.hub_processing import HubVLMProcessor, check_training_template
from vlmtrain.data.processing import IGNORE_INDEX, SkipSample
from vlmtrain.models.families import get_family

FAMILIES = ("qwen3_vl", "qwen2_5_vl", "idefics3", "llava_onevision", "gemma3")


@pytest.fixture(scope="module")
def tiny(tiny_hub):
    """family name -> (family, checkpoint dir, processor), built on first use."""
    return tiny_hub


def _image(i: int, size=(32, 32)) -> Image.Image:
    return Image.new("RGB", size, (60 * i + 20, 100, 200 - 50 * i))


def _texts(processor, input_ids) -> str:
    return processor.tokenizer.decode(input_ids.tolist(), skip_special_tokens=False)


def _image_spans(text: str, image_token: str, markers: list[str]) -> list[int]:
    """Image tokens in ``text`` between consecutive ``markers`` (and before the first / after the last)."""
    cuts = [text.index(m) for m in markers]
    assert cuts == sorted(cuts), "markers out of order"
    bounds = [0, *cuts, len(text)]
    return [text[a:b].count(image_token) for a, b in zip(bounds, bounds[1:])]


# -- item 8: images where the text puts them -------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_placeholders_put_each_image_where_it_stands(tiny, name):
    fam, _, proc = tiny(name)
    check_training_template(proc, fam)  # (its mask probes include images placed by <image>)
    token = proc.image_token
    hp = HubVLMProcessor(proc, fam, max_length=4096)
    placed = hp.process({"images": [_image(0), _image(1)],
                         "texts": [{"user": "Alpha <image> Bravo", "assistant": "Reply one"},
                                   {"user": "Charlie <image> Delta", "assistant": "Reply two"}]})
    text = _texts(proc, placed["input_ids"])
    if token != "<image>":
        assert "<image>" not in text
    spans = _image_spans(text, token, ["Alpha", "Bravo", "Charlie", "Delta"])
    # nothing before Alpha, the first image between Alpha and Bravo, the second between Charlie and Delta
    assert spans[0] == spans[2] == spans[4] == 0 and spans[1] > 0 and spans[3] > 0, (spans, text)
    first = hp.process({"images": [_image(0), _image(1)],
                        "texts": [{"user": "Alpha Bravo", "assistant": "Reply one"},
                                  {"user": "Charlie Delta", "assistant": "Reply two"}]})
    first_text = _texts(proc, first["input_ids"])
    spans_first = _image_spans(first_text, token, ["Alpha", "Charlie"])
    assert spans_first[0] == spans[1] + spans[3] and spans_first[1:] == [0, 0], (spans_first, first_text)
    # the assistant replies (and only they, with their end-of-turn tokens) are labelled in both layouts
    for item in (placed, first):
        labelled = _texts(proc, item["input_ids"][item["labels"] != IGNORE_INDEX])
        assert "Reply one" in labelled and "Reply two" in labelled and fam.end_of_turn in labelled
        assert token not in labelled and "Alpha" not in labelled and "Charlie" not in labelled
    # the pixels are the same images in the same order either way
    for key, value in placed.items():
        if key.startswith("pixel"):
            assert torch.equal(value, first[key]), key


class PlacedImageMaskBug:
    """A processor whose assistant mask is shifted only when an image follows text inside a turn."""

    def __init__(self, processor):
        self._processor = processor

    def __getattr__(self, name):
        return getattr(self._processor, name)

    def apply_chat_template(self, messages, **kwargs):
        out = self._processor.apply_chat_template(messages, **kwargs)
        placed = any([b["type"] for b in m["content"]][:2] == ["text", "image"] for m in messages)
        if kwargs.get("return_assistant_tokens_mask") and placed:
            out["assistant_masks"] = torch.as_tensor(out["assistant_masks"]).roll(-2, dims=-1)
        return out


def test_template_check_masks_images_placed_inside_turns(tiny):
    fam, _, proc = tiny("qwen3_vl")
    with pytest.raises(ConfigError, match="mask covers.*probe 'two images placed by <image>'"):
        check_training_template(PlacedImageMaskBug(proc), fam)


@pytest.mark.parametrize("name", ["qwen3_vl", "idefics3"])
def test_placeholder_errors_are_skipped_and_counted(tiny, name):
    fam, _, proc = tiny(name)
    coll = HubVLMCollator(HubVLMProcessor(proc, fam, max_length=4096))
    bad = [
        {"images": [_image(0)], "texts": [{"user": "<image> and <image>", "assistant": "ok"}]},
        {"images": [_image(0), _image(1)], "texts": [{"user": "only <image>", "assistant": "ok"}]},
        {"images": [_image(0)], "texts": [{"user": "look", "assistant": "here: <image>"}]},
        {"images": [_image(0)], "texts": [{"user": "<image>", "assistant": "ok"},
                                          {"user": "<image>", "assistant": "ok"}]},
    ]
    good = {"images": [_image(0)], "texts": [{"user": "<image>", "assistant": "ok"}]}
    batch = coll([*bad, good])
    assert batch["skipped"] == {"placeholder_mismatch": 3, "placeholder_in_assistant": 1}
    assert batch["input_ids"].shape[0] == 1


# -- item 7: bad input counted by its own reason ------------------------------------------------------------
CONTROL = {"qwen3_vl": ["<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|endoftext|>"],
           "idefics3": ["<end_of_utterance>", "<fake_token_around_image>", "<global-img>", "<row_1_col_1>"],
           "gemma3": ["<start_of_turn>", "<start_of_image>", "<image_soft_token>", "<bos>"]}


@pytest.mark.parametrize("name", list(CONTROL))
def test_control_tokens_in_text_are_rejected(tiny, name):
    fam, _, proc = tiny(name)
    hp = HubVLMProcessor(proc, fam, max_length=4096)
    for i, token in enumerate(CONTROL[name]):
        role = ("user", "assistant")[i % 2]
        texts = {"user": "Hi", "assistant": "Fine"} | {role: f"Hi {token} there"}
        with pytest.raises(SkipSample) as err:
            hp.process({"images": [_image(0)], "texts": [texts]})
        assert err.value.reason == "control_token_in_text" and token in err.value.detail, token
    # look-alikes are text
    item = hp.process({"images": [], "texts": [{"user": "<b>bold</b> <im_end> <|im_end", "assistant": "ok"}]})
    assert "<b>bold</b> <im_end> <|im_end" in _texts(proc, item["input_ids"])


def test_no_target_and_video_samples_are_skipped(tiny):
    fam, _, proc = tiny("qwen3_vl")
    score_only = {"images": [_image(0)], "texts": [{"user": "Rate it."}]}

    def reason(head_names, sample):
        try:
            HubVLMProcessor(proc, fam, head_names=head_names).process(sample)
        except SkipSample as err:
            return err.reason
        return None

    assert reason((), score_only) == "no_target"  # no heads, no assistant text
    assert reason(("color",), score_only | {"labels": {"color": 1}}) is None
    assert reason(("color",), score_only | {"labels": {"color": None, "size": 2}}) == "no_target"
    assert reason(("color",), score_only | {"texts": [{"user": "Rate it.", "assistant": ""}]}) == "no_target"
    assert reason((), score_only | {"texts": [{"user": "Rate it.", "assistant": "Good"}]}) is None
    assert reason(None, score_only) is None  # inference: a prompt has no target
    # a video file among the images: counted as such, not as a corrupt image
    assert reason((), score_only | {"images": ["clip.MP4"], "texts": [{"user": "a", "assistant": "b"}]}) == \
        "video_unsupported"
    # Qwen3-VL takes videos (tests/test_video_processing.py): a missing file is an unreadable video
    assert reason((), score_only | {"videos": ["clip.webm"], "texts": [{"user": "a", "assistant": "b"}]}) == \
        "video_unreadable"


def test_processor_errors_are_named_by_cause(tiny):
    fam, _, proc = tiny("qwen3_vl")
    coll = HubVLMCollator(HubVLMProcessor(proc, fam, max_length=4096))
    batch = coll([{"images": [_image(0, (2, 500))], "texts": [{"user": "thin", "assistant": "ok"}]},
                  {"images": [_image(0)], "texts": [{"user": "fine", "assistant": "ok"}]}])
    assert batch["skipped"] == {"bad_aspect_ratio": 1}
    # the messages transformers' processors raise, by cause (older Qwen processors raise for tiny images)
    cases = {"height:10 or width:20 must be larger than factor:28": "image_too_small",
             "absolute aspect ratio must be smaller than 200, got 250.0": "bad_aspect_ratio",
             "The number of <image> tokens in each prompt should be the same as the number of images passed. "
             "Found 1 <image> tokens and 2 images per sample.": "placeholder_mismatch",
             "Mismatch in `image` token count between text and `input_ids`. Got ids=3 and text=4.":
                 "placeholder_mismatch",
             "operands could not be broadcast together": "processor_error"}
    assert {m: processor_error_reason(ValueError(m)) for m in cases} == cases

    class Failing:
        def __getattr__(self, name):
            return getattr(proc, name)

        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("something else broke")

    with pytest.raises(SkipSample) as err:
        HubVLMProcessor(Failing(), fam).process({"images": [], "texts": [{"user": "a", "assistant": "b"}]})
    assert err.value.reason == "processor_error"


def test_no_target_batches_never_reach_the_model(tiny, tmp_path, one_thread):
    """No heads, half the samples score-only: those are skipped (train_skipped_no_target), every loss finite
    (a batch of only such samples used to give a NaN loss)."""
    _, path, _ = tiny("qwen3_vl")
    rows = []
    for i in range(8):
        _image(i % 3).save(tmp_path / f"{i}.png")
        texts = [{"user": "Which colour?", "assistant": "rgb"[i % 3]}] if i >= 4 else [{"user": "Which colour?"}]
        rows.append({"images": [f"{i}.png"], "texts": texts})
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _run_config(tmp_path, path, train={"max_steps": 2, "per_device_train_batch_size": 4})
    with pytest.warns(UserWarning, match=r"4 training samples were skipped: \{'no_target': 4\}"):
        out = run.build(cfg).train()
    assert out.metrics["train_skipped_no_target"] == 4
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in logged if "loss" in r]
    assert losses and all(torch.isfinite(torch.tensor(v)) for v in losses), losses


def _run_config(tmp_path, pretrained, data=None, train=None):
    cfg = {"model": {"kind": "hub_vlm", "pretrained": pretrained},
           "data": {"source": "jsonl", "train_file": str(tmp_path / "data.jsonl"), "num_eval": 0,
                    "max_length": 4096, **(data or {})},
           "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1, "per_device_train_batch_size": 1,
                     "logging_steps": 1, "save_strategy": "no", "disable_tqdm": True, **(train or {})}}
    file = tmp_path / "cfg.yaml"
    file.write_text(yaml.safe_dump(cfg))
    return load_run_config(str(file))


# -- item 3: image size ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_like(tiny, tmp_path_factory):
    """A tiny Qwen3-VL whose image processor is the real checkpoints': patch 16 x merge 2 (1,024 pixels per
    image token), 65,536 to 16,777,216 pixels per image (only processing is tested: the tiny tower's patch 8
    does not matter)."""
    _, path, _ = tiny("qwen3_vl")
    out = tmp_path_factory.mktemp("qwen_like")
    import shutil

    shutil.copytree(path, out, dirs_exist_ok=True)
    config = json.loads((out / "preprocessor_config.json").read_text())
    config.update(patch_size=16, merge_size=2, size={"shortest_edge": 65536, "longest_edge": 16777216})
    (out / "preprocessor_config.json").write_text(json.dumps(config))
    return str(out)


def _tokens(height, width, min_pixels, max_pixels):
    """Image tokens of one image by the processor's own rule (smart_resize, factor 32, 1 token per 32 x 32)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    h, w = smart_resize(height, width, factor=32, min_pixels=min_pixels, max_pixels=max_pixels)
    return (h // 32) * (w // 32)


@pytest.mark.parametrize("setting", [{}, {"max_image_tokens": 256}, {"max_pixels": 300_000, "min_pixels": 100_000},
                                     {"max_pixels": 16777216}], ids=lambda s: "-".join(map(str, s.items())) or "default")
def test_image_size_bounds_image_tokens(qwen_like, tmp_path, setting):
    Image.new("RGB", (1920, 1080), (10, 120, 200)).save(tmp_path / "hd.png")
    Image.new("RGB", (4000, 3000), (200, 120, 10)).save(tmp_path / "photo.jpg")
    Image.new("RGB", (40, 30), (0, 0, 0)).save(tmp_path / "small.png")
    hd_png, photo_jpg, small_png = (str(tmp_path / f) for f in ("hd.png", "photo.jpg", "small.png"))
    rows = [{"images": [hd_png, hd_png], "texts": [{"user": "Compare.", "assistant": "Same."}]},
            {"images": [photo_jpg, small_png], "texts": [{"user": "Two.", "assistant": "Yes."}]}]
    uncapped = setting.get("max_pixels") == 16777216  # the checkpoint's own limit
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer = run.build(_run_config(tmp_path, qwen_like, data=setting))
    max_pixels = setting.get("max_pixels", 256 * 1024 if "max_image_tokens" in setting else 1024 * 1024)
    min_pixels = setting.get("min_pixels", min(65536, max_pixels))
    size = trainer.processing_class.image_processor.size
    assert (size["shortest_edge"], size["longest_edge"]) == (min_pixels, max_pixels)
    hd, photo, small = (_tokens(h, w, min_pixels, max_pixels) for h, w in ((1080, 1920), (3000, 4000), (30, 40)))
    if not setting:  # the default: 1,024 tokens at most (1080p: 24 x 42; 12 MP: 27 x 36)
        assert (hd, photo) == (1008, 972)
        # the processor a checkpoint saves keeps the bound: inference resizes as training did
        trainer.processing_class.save_pretrained(str(tmp_path / "saved"))
        reloaded = get_family("qwen3_vl").load_processor(str(tmp_path / "saved")).image_processor.size
        assert (reloaded["shortest_edge"], reloaded["longest_edge"]) == (min_pixels, max_pixels)
    if uncapped:  # 2,040 tokens per 1080p image (11,750 for 12 MP): two 1080p images overflow max_length 4096
        assert (hd, photo) == (2040, 11750)
        assert trainer.data_collator(rows[:1])["skipped"] == {"too_long": 1}
        return
    batch = trainer.data_collator(rows)
    assert batch.get("skipped", {}) == {}
    assert (batch["image_grid_thw"].prod(-1) // 4).tolist() == [hd, hd, photo, small]
    image_pad = trainer.processing_class.image_token_id
    assert (batch["input_ids"] == image_pad).sum(-1).tolist() == [2 * hd, photo + small]
    assert batch["input_ids"].shape[1] <= 4096


@pytest.mark.parametrize("override, match", [
    ({"data.max_pixels": -5}, "data.max_pixels must be a positive integer"),
    ({"data.max_image_tokens": 0}, "data.max_image_tokens must be a positive integer"),
    ({"data.min_pixels": 2_000_000, "data.max_pixels": 1_000_000}, "data.min_pixels=2000000 is above data.max_pixels"),
    ({"data.max_pixels": 1_000_000, "data.max_image_tokens": 1024}, "data.max_pixels and data.max_image_tokens both"),
])
def test_bad_image_size_keys_are_config_errors(qwen_like, tmp_path, override, match):
    (tmp_path / "data.jsonl").write_text(json.dumps({"texts": [{"user": "a", "assistant": "b"}]}) + "\n")
    _run_config(tmp_path, qwen_like)  # (writes cfg.yaml)
    with pytest.raises(ConfigError, match=match):
        load_run_config(str(tmp_path / "cfg.yaml"), override)


def test_image_size_keys_the_family_cannot_apply(tiny, tmp_path):
    _, path, _ = tiny("gemma3")
    (tmp_path / "data.jsonl").write_text(json.dumps({"texts": [{"user": "a", "assistant": "b"}]}) + "\n")
    cfg = _run_config(tmp_path, path, data={"max_image_tokens": 256})
    with pytest.raises(ConfigError, match="data.max_image_tokens does not apply to the gemma3 family"):
        run.build(cfg)
    # min_pixels above the default cap, or below one token's worth of pixels: named at build
    _, qpath, _ = tiny("qwen3_vl")
    with pytest.raises(ConfigError, match="data.max_pixels / max_image_tokens: 100 pixels is less than one"):
        run.build(_run_config(tmp_path, qpath, data={"max_pixels": 100}))
    with pytest.raises(ConfigError, match="data.min_pixels=5000 is above the max_pixels of 4096"):
        run.build(_run_config(tmp_path, qpath, data={"min_pixels": 5000}))
