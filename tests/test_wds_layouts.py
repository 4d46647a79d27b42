"""WebDataset layouts people actually have (issue 14, item 8), in shards written by webdataset's own ShardWriter
(webdataset is a test-only dependency: vlmtrain reads the tar files itself).

Single-image samples as KEY.jpg / KEY.png / KEY.webp (image 0) next to the indexed KEY.0.png, KEY.1.jpg form;
the_cauldron records in KEY.json; bad records at the very end of the stream still counted.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter

import pytest
from optional_extras import requires
from PIL import Image

from vlmtrain.data.sources import KEY, StreamingDataset, WebDatasetSource, is_counts_only
from vlmtrain.data.tools import inspect_source

pytestmark = requires("webdataset", "dev")  # a test-only package: the shards' writer

COLORS = {"red": (255, 0, 0), "green": (0, 200, 0), "blue": (0, 0, 255)}


def _image(color: str, size: int = 16) -> Image.Image:
    return Image.new("RGB", (size, size), COLORS[color])


def _webp(image: Image.Image) -> bytes:  # (ShardWriter has no webp encoder: bytes are written as they are)
    buf = io.BytesIO()
    image.save(buf, format="WEBP", lossless=True)
    return buf.getvalue()


def _record(colors: list[str]) -> dict:
    return {"texts": [{"user": "What colors?", "assistant": " ".join(colors) or "none"}],
            "labels": {"count": len(colors)}}


def _write(pattern: str, samples: list[dict], maxcount: int = 3) -> None:
    import webdataset

    with webdataset.ShardWriter(pattern, maxcount=maxcount, verbose=0) as sink:
        for sample in samples:
            sink.write(sample)


# key: (image members, the colors they hold in order)
LAYOUTS = {
    "single_jpg": ({"jpg": _image("red")}, ["red"]),
    "single_png": ({"png": _image("green")}, ["green"]),
    "single_webp": ({"webp": _webp(_image("blue"))}, ["blue"]),
    "indexed": ({"0.png": _image("blue"), "1.png": _image("red")}, ["blue", "red"]),
    "mixed": ({"jpg": _image("green"), "1.png": _image("blue")}, ["green", "blue"]),  # image 0 unindexed
    "text_only": ({}, []),
    "upper_ext": ({"PNG": _image("red")}, ["red"]),
}


def _color_of(data: bytes) -> str:
    pixel = Image.open(io.BytesIO(data)).convert("RGB").getpixel((8, 8))
    return min(COLORS, key=lambda c: sum((a - b) ** 2 for a, b in zip(COLORS[c], pixel)))


@pytest.fixture
def shards(tmp_path):
    """Three shards of 3, 3 and 2 samples; the last record of the last shard has a corrupt JSON."""
    samples = [{"__key__": key, **members, "json": _record(colors)} for key, (members, colors) in LAYOUTS.items()]
    samples.append({"__key__": "zz_corrupt", "png": _image("red"), "json": b'{"texts": [{"user": '})
    _write(str(tmp_path / "shard-%06d.tar"), samples)
    return str(tmp_path / "shard-{000000..000002}.tar")


def test_shardwriter_layouts_arrive_with_their_images_and_texts(shards):
    samples = list(StreamingDataset([WebDatasetSource(shards)], shuffle=False))
    carrier, samples = samples[-1], samples[:-1]
    by_key = {s[KEY].rsplit(":", 1)[1]: s for s in samples}
    assert list(by_key) == list(LAYOUTS)  # every good sample, in shard order
    for key, (_, colors) in LAYOUTS.items():
        sample = by_key[key]
        assert [_color_of(im) for im in sample["images"]] == colors, key
        assert {k: v for k, v in sample.items() if k not in ("images", KEY)} == _record(colors)
    # the corrupt record is the very last of the stream: a counts-only sample carries it
    assert is_counts_only(carrier) and carrier["__dropped__"] == {"malformed_json": 1}
    assert not any("__dropped__" in s for s in samples)


def test_a_sample_with_two_images_0_is_a_counted_bad_record(tmp_path):
    _write(str(tmp_path / "d-%06d.tar"), [
        {"__key__": "both", "jpg": _image("red"), "0.png": _image("blue"), "json": _record(["red"])},
        {"__key__": "fine", "jpg": _image("red"), "json": _record(["red"])}])
    samples = list(StreamingDataset([WebDatasetSource(str(tmp_path / "d-000000.tar"))], shuffle=False))
    assert len(samples) == 1 and samples[0]["__dropped__"] == {"duplicate_image": 1}
    assert inspect_source(str(tmp_path / "d-000000.tar"))["bad"] == {"duplicate_image": 1}


def test_video_members_are_counted_not_dropped(tmp_path):
    """Video is not supported: a sample with a video member (any of the usual containers, indexed or not, with
    or without images) is a bad record counted as video_unsupported, never trained on as its text alone."""
    video = b"\x00\x00\x00\x18ftypmp42 not really a video"
    _write(str(tmp_path / "v-%06d.tar"), [
        {"__key__": "mp4", "0.mp4": video, "json": _record(["red"])},
        {"__key__": "webm", "webm": video, "json": _record(["red"])},
        {"__key__": "mixed", "0.png": _image("red"), "1.MOV": video, "json": _record(["red"])},
        {"__key__": "avi", "0.avi": video, "json": _record([])},
        {"__key__": "mkv", "2.mkv": video, "json": _record([])},
        {"__key__": "fine", "jpg": _image("red"), "json": _record(["red"])}], maxcount=10)
    path = str(tmp_path / "v-000000.tar")
    samples = list(StreamingDataset([WebDatasetSource(path)], shuffle=False))
    assert [s[KEY].rsplit(":", 1)[1] for s in samples] == ["fine"]
    assert samples[0]["__dropped__"] == {"video_unsupported": 5}
    assert inspect_source(path)["bad"] == {"video_unsupported": 5}


def test_a_shard_cut_short_ends_with_a_counted_bad_record(tmp_path):
    """A writer killed mid-shard: the tar ends inside the last sample's image. Reading does not fail; the
    cut record is counted at the end of the stream."""
    _write(str(tmp_path / "c-%06d.tar"), [{"__key__": f"s{i}", "json": _record(["red"]), "png": _image("red", 64)}
                                          for i in range(3)])
    path = tmp_path / "c-000000.tar"
    with tarfile.open(path) as tar:
        last = [m for m in tar if m.name == "s2.png"][0]
    raw = path.read_bytes()
    path.write_bytes(raw[:last.offset_data + last.size // 2])
    samples = list(StreamingDataset([WebDatasetSource(str(path))], shuffle=False))
    assert [s[KEY].rsplit(":", 1)[1] for s in samples[:-1]] == ["s0", "s1"]
    assert is_counts_only(samples[-1]) and samples[-1]["__dropped__"] == {"corrupt_image": 1}


def test_through_the_config_the_last_bad_record_reaches_the_skipped_counts(tmp_path, shards, one_thread):
    """data.source: stream with a wds source (the public path): the VLM collator gets images and texts, and
    the corrupt last record is in the batches' skipped counts; one epoch of batches counts each sample once."""
    from tests.test_vlm_run import _config
    from vlmtrain import run
    from vlmtrain.trainer.stats import is_empty_batch, skipped_counts

    cfg = _config(tmp_path, data={"source": "stream", "sources": [{"kind": "wds", "path": shards}],
                                  "num_eval": 0},
                  train={"max_steps": 1, "eval_strategy": "no", "save_strategy": "no",
                         "per_device_train_batch_size": 3})
    trainer = run.build(cfg)
    trainer.train_dataset.shuffle = False
    skipped, images, rows = Counter(), 0, 0
    for batch in trainer.get_train_dataloader():
        skipped.update(skipped_counts(batch))
        if not is_empty_batch(batch):
            rows += batch["input_ids"].shape[0]
            images += int(batch["pixel_values"].shape[0]) if "pixel_values" in batch else 0
    assert rows == len(LAYOUTS) and skipped == {"malformed_json": 1}
    assert images >= sum(len(colors) for _, colors in LAYOUTS.values())  # (tiles may add views)
    assert json.loads(json.dumps(dict(skipped)))  # plain counts, loggable
