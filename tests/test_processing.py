"""Chat template, exact loss mask, image placeholders/tiling, SkipSample reasons and VLM collation."""

from __future__ import annotations

import io
import pickle
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from vlmtrain.data.processing import (
    IGNORE_INDEX,
    SKIP_REASONS,
    SkipSample,
    VLMProcessor,
    build_chat_tokenizer,
    split_grid,
)
from vlmtrain.data.vlm_collate import VLMCollator

S, L = 16, 3  # tiny image size and tokens per image keep the test fast


@pytest.fixture(scope="module")
def tok():
    corpus = ["What color is the square?", "The square is red.", "How many circles are there?", "Two."] * 20
    return build_chat_tokenizer(corpus, vocab_size=320)


@pytest.fixture(scope="module")
def proc(tok):
    return VLMProcessor(tok, image_size=S, image_token_length=L, max_length=256, max_images=3)


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def png_bytes(size=(20, 12), color=(200, 30, 90)) -> bytes:
    img = Image.new("RGB", size, color)
    img.putpixel((0, 0), (0, 255, 0))  # not uniform, so resampling differences would show
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def sample(n_images=1, turns=(("What color is the square?", "Red."),)):
    return {"images": [png_bytes() for _ in range(n_images)],
            "texts": [{"user": u, "assistant": a} for u, a in turns]}


def test_tokenizer_specials_and_round_trip(tok, tmp_path):
    assert tok.convert_ids_to_tokens(list(range(7))) == [
        "<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "<image>"]
    assert tok.pad_token_id == 0 and tok.eos_token == "<|im_end|>" and tok.image_token_id == 6
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    text = "<|im_start|>user\n<image>What color?<|im_end|>\n"
    assert again.encode(text, add_special_tokens=False) == enc(tok, text)
    assert again.pad_token_id == 0 and again.image_token_id == 6
    char = build_chat_tokenizer(None)
    ids = char.encode("Hi there!\n", add_special_tokens=False)
    assert len(ids) == 10 and char.unk_token_id not in ids and char.decode(ids) == "Hi there!\n"


def test_exact_labels_single_turn(tok, proc):
    out = proc.process(sample(n_images=1))
    im_start, im_end, image = 4, 5, 6
    user_ids, answer_ids = enc(tok, "What color is the square?"), enc(tok, "Red.")
    head = [im_start, *enc(tok, "user\n"), *[image] * L, *user_ids, im_end, *enc(tok, "\n"), im_start,
            *enc(tok, "assistant\n")]
    tail = [*answer_ids, im_end]
    expected_ids = head + tail + enc(tok, "\n")
    expected_labels = [IGNORE_INDEX] * len(head) + tail + [IGNORE_INDEX] * len(enc(tok, "\n"))
    assert out["input_ids"].tolist() == expected_ids
    assert out["labels"].tolist() == expected_labels
    assert out["prompt_input_ids"].tolist() == head
    assert out["input_ids"].dtype == out["labels"].dtype == torch.long
    assert out["num_images"] == 1 and out["pixel_values"].shape == (1, 3, S, S)
    # Same text as the tokenizer's ChatML template with the placeholders in the first user message.
    msgs = [{"role": "user", "content": "<image>" * L + "What color is the square?"},
            {"role": "assistant", "content": "Red."}]
    assert tok.decode(expected_ids) == tok.apply_chat_template(msgs, tokenize=False)


def test_images_after_text_follow_the_first_question_and_are_saved(tok, proc):
    """images_after_text: the first question, then its images' placeholders; labels and later turns unchanged;
    a checkpoint's processor (preprocessing entry) lays prompts out the same way."""
    turns = (("What color is the square?", "Red."), ("How many circles are there?", "Two."))
    after = VLMProcessor(tok, image_size=S, image_token_length=L, max_length=256, max_images=3,
                         images_after_text=True)
    base, out = proc.process(sample(2, turns)), after.process(sample(2, turns))
    user_ids, image = enc(tok, "What color is the square?"), 6
    head = [4, *enc(tok, "user\n")]
    assert out["input_ids"][: len(head) + len(user_ids) + 2 * L].tolist() == head + user_ids + [image] * 2 * L
    assert base["input_ids"][: len(head) + 2 * L].tolist() == head + [image] * 2 * L
    assert sorted(out["input_ids"].tolist()) == sorted(base["input_ids"].tolist())
    assert out["labels"].tolist() == base["labels"].tolist()  # the moved piece has no targets
    assert torch.equal(out["pixel_values"], base["pixel_values"])
    saved = SimpleNamespace(image_size=S, image_token_length=L, preprocessing={"images_after_text": True})
    reloaded = VLMProcessor.for_checkpoint(tok, saved).process(sample(2, turns))
    assert torch.equal(reloaded["prompt_input_ids"], out["prompt_input_ids"])


def test_multi_turn_both_answers_supervised(tok, proc):
    turns = (("What color is the square?", "Red."), ("How many circles are there?", "Two."))
    out = proc.process(sample(n_images=0, turns=turns))
    ids, labels = out["input_ids"].tolist(), out["labels"].tolist()
    supervised = [t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX]
    assert supervised == [*enc(tok, "Red."), 5, *enc(tok, "Two."), 5]  # both closing <|im_end|> included
    assert labels == [t if lab != IGNORE_INDEX else IGNORE_INDEX for t, lab in zip(ids, labels)]
    prompt = out["prompt_input_ids"].tolist()
    assert prompt == ids[: len(prompt)]
    assert prompt[-len(enc(tok, "<|im_start|>assistant\n")):] == enc(tok, "<|im_start|>assistant\n")
    assert tok.decode(prompt).count("<|im_start|>assistant\n") == 2  # the prompt ends at the LAST turn
    assert tok.decode(prompt).endswith("Red.<|im_end|>\n<|im_start|>user\nHow many circles are there?"
                                       "<|im_end|>\n<|im_start|>assistant\n")


def test_literal_image_token_in_text_adds_no_placeholder(proc):
    out = proc.process({"images": [], "texts": [{"user": "what is <image>?", "assistant": "a tag"}]})
    assert (out["input_ids"] == proc.image_token_id).sum() == 0


def test_placeholder_counts(proc):
    assert (proc.process(sample(2))["input_ids"] == proc.image_token_id).sum() == 2 * L
    out = proc.process(sample(0))
    assert (out["input_ids"] == proc.image_token_id).sum() == 0 and out["pixel_values"].shape == (0, 3, S, S)
    # Images only in the FIRST user turn, and the run is contiguous.
    ids = proc.process(sample(2, turns=(("a?", "b."), ("c?", "d."))))["input_ids"].tolist()
    pos = [i for i, t in enumerate(ids) if t == proc.image_token_id]
    assert pos == list(range(pos[0], pos[0] + 2 * L)) and pos[0] < ids.index(proc.im_end_id)


def test_tiling(tok):
    tiler = VLMProcessor(tok, image_size=S, image_token_length=L, split_large_images=True, max_tiles=4)
    assert split_grid(2 * S, S, S, 4) == (1, 2)
    assert split_grid(3 * S, 3 * S, S, 4) == (2, 2)
    assert split_grid(S, S, S, 4) == (1, 1)
    big = {"images": [Image.new("RGB", (2 * S, 2 * S), "white"), Image.new("RGB", (S, S))],
           "texts": [{"user": "q?", "assistant": "a."}]}
    out = tiler.process(big)
    assert out["pixel_values"].shape == (4 + 1 + 1, 3, S, S)  # 2x2 tiles + global view, small image as is
    assert (out["input_ids"] == tiler.image_token_id).sum() == (4 + 1 + 1) * L
    assert out["num_images"] == 2
    # Tiles come first in row-major order, then the global view: check with a 4-colour image.
    img = Image.new("RGB", (2 * S, 2 * S))
    for (x, y), colour in zip([(0, 0), (S, 0), (0, S), (S, S)], ["red", "green", "blue", "yellow"]):
        img.paste(Image.new("RGB", (S, S), colour), (x, y))
    views = tiler.image_views(img)
    assert len(views) == 5 and views[-1] is img
    assert [v.getpixel((S // 2, S // 2)) for v in views[:4]] == [(255, 0, 0), (0, 128, 0), (0, 0, 255),
                                                                 (255, 255, 0)]


def test_pixel_normalisation_and_input_kinds(proc, tmp_path):
    data = png_bytes()
    path = tmp_path / "img.png"
    path.write_bytes(data)
    pil = Image.open(io.BytesIO(data))
    tensors = [proc.process_images([x]) for x in (data, path, str(path), pil, {"bytes": data, "path": None})]
    for t in tensors[1:]:
        assert torch.equal(t, tensors[0])
    x = proc.process_images([Image.new("RGB", (5, 7), (0, 255, 128))])
    assert x.dtype == torch.float32 and x.shape == (1, 3, S, S)
    assert x.min() >= -1.0 and x.max() <= 1.0
    assert torch.allclose(x[0, :, 0, 0], torch.tensor([-1.0, 1.0, 128 / 255 * 2 - 1]), atol=1e-6)
    grey = proc.process_images([Image.new("L", (4, 4), 255)])  # non-RGB modes are converted
    assert grey.shape == (1, 3, S, S) and torch.allclose(grey, torch.ones_like(grey))


@pytest.mark.parametrize("reason, bad", [
    ("missing_image", {"images": ["/no/such/file.png"], "texts": [{"user": "q", "assistant": "a"}]}),
    ("corrupt_image", {"images": [b"not an image at all"], "texts": [{"user": "q", "assistant": "a"}]}),
    ("corrupt_image", {"images": [png_bytes()[:40]], "texts": [{"user": "q", "assistant": "a"}]}),
    ("empty_conversation", {"images": [], "texts": []}),
    ("empty_conversation", {"images": []}),
    ("malformed_text", {"images": [], "texts": [{"user": "q", "assistant": ""}]}),
    ("malformed_text", {"images": [], "texts": [{"user": "  ", "assistant": "a"}]}),
    ("malformed_text", {"images": [], "texts": [{"user": "q", "assistant": 3}]}),
    ("malformed_text", {"images": [], "texts": ["q a"]}),
    ("too_many_images", {"images": [png_bytes()] * 4, "texts": [{"user": "q", "assistant": "a"}]}),
    ("too_long", {"images": [], "texts": [{"user": "q " * 300, "assistant": "a"}]}),
])
def test_skip_reasons(proc, reason, bad):
    with pytest.raises(SkipSample) as info:
        proc.process(bad)
    assert info.value.reason == reason and reason in SKIP_REASONS


def test_too_long_counts_image_tokens(tok):
    short = VLMProcessor(tok, image_size=S, image_token_length=40, max_length=60)
    short.process(sample(0))
    with pytest.raises(SkipSample, match="too_long"):
        short.process(sample(2))  # 80 placeholders: dropped whole, never truncated


def test_collator_shapes_padding_and_skips(proc):
    collate = VLMCollator(proc)
    good = [sample(2), sample(0, turns=(("Hi?", "Hello there."), ("And?", "Done."))), sample(1)]
    bad = [{"images": ["/missing.png"], "texts": [{"user": "q", "assistant": "a"}]}, {"texts": []}]
    batch = collate([good[0], bad[0], good[1], bad[1], good[2]])
    assert batch.pop("skipped") == {"missing_image": 1, "empty_conversation": 1}  # this batch's drops
    stats = batch.pop("pack_stats")
    # no key or id in these samples: named by the start of their first user text
    assert batch.pop("skipped_keys") == ["(no id, user text 'q') (missing_image)", "(no id) (empty_conversation)"]
    assert all(isinstance(v, torch.Tensor) for v in batch.values())
    assert set(batch) == {"input_ids", "attention_mask", "labels", "pixel_values", "prompt_input_ids",
                          "prompt_attention_mask", "prompt_pixel_values"}
    assert collate.skipped == {"missing_image": 1, "empty_conversation": 1}
    assert collate([good[0]])["skipped"] == {} and collate.skipped["missing_image"] == 1  # a running total
    assert batch["pixel_values"].shape == (3, 3, S, S)
    assert batch["prompt_pixel_values"] is batch["pixel_values"]
    processed = [proc.process(s) for s in good]
    assert torch.equal(batch["pixel_values"], torch.cat([p["pixel_values"] for p in processed]))
    n, width = batch["input_ids"].shape
    assert n == 3 and width == max(len(p["input_ids"]) for p in processed)
    assert stats == {"samples": 3, "tokens": sum(len(p["input_ids"]) for p in processed), "rows": 3,
                     "capacity": 3 * width, "images": 3}
    pid = proc.tokenizer.pad_token_id
    for i, p in enumerate(processed):
        k = len(p["input_ids"])  # right padding for training
        assert batch["input_ids"][i, :k].tolist() == p["input_ids"].tolist()
        assert (batch["input_ids"][i, k:] == pid).all() and (batch["labels"][i, k:] == IGNORE_INDEX).all()
        assert batch["labels"][i, :k].tolist() == p["labels"].tolist()
        assert batch["attention_mask"][i].tolist() == [1] * k + [0] * (width - k)
        k, pw = len(p["prompt_input_ids"]), batch["prompt_input_ids"].shape[1]  # left padding for prompts
        assert batch["prompt_input_ids"][i, pw - k:].tolist() == p["prompt_input_ids"].tolist()
        assert (batch["prompt_input_ids"][i, : pw - k] == pid).all()
        assert batch["prompt_attention_mask"][i].tolist() == [0] * (pw - k) + [1] * k
    # Placeholders across the batch match the pixel rows (what the model's splice relies on).
    assert (batch["input_ids"] == proc.image_token_id).sum() == batch["pixel_values"].shape[0] * L
    assert (batch["prompt_input_ids"] == proc.image_token_id).sum() == batch["pixel_values"].shape[0] * L


def test_collator_no_images_and_all_bad(proc):
    collate = VLMCollator(proc)
    batch = collate([sample(0), sample(0)])
    assert batch["pixel_values"].shape == (0, 3, S, S)
    # every sample bad: a batch with nothing for the model, only the counts (the Trainer skips it)
    empty = collate([{"texts": []}, {"images": [b"junk"], "texts": [{"user": "q", "assistant": "a"}]}])
    assert empty == {"skipped": {"empty_conversation": 1, "corrupt_image": 1},
                     "skipped_keys": ["(no id) (empty_conversation)", "(no id, user text 'q') (corrupt_image)"],
                     "pack_stats": {"samples": 0, "tokens": 0, "rows": 0, "capacity": 0, "images": 0}}
    assert collate.skipped == {"empty_conversation": 1, "corrupt_image": 1}


def test_pickles_for_dataloader_workers(proc):
    err = pickle.loads(pickle.dumps(SkipSample("too_long", "300 > 256")))
    assert err.reason == "too_long" and err.detail == "300 > 256"
    collate = pickle.loads(pickle.dumps(VLMCollator(proc)))
    assert collate([sample(1)])["pixel_values"].shape == (1, 3, S, S)


def test_exact_match_scores_the_last_answer_of_a_conversation(proc, tok):
    from types import SimpleNamespace

    from vlmtrain.tasks.addition import exact_match_metric

    turns = (("What color is the square?", "Red."), ("How many circles are there?", "Two."))
    labels = proc.process(sample(1, turns=turns))["labels"][None].numpy()
    metric = exact_match_metric(tok)
    for answer, score in (("Two.", 1.0), ("Red.", 0.0), ("Red.Two.", 0.0)):
        generated = [enc(tok, answer) + [tok.eos_token_id]]
        assert metric(SimpleNamespace(predictions=generated, label_ids=labels)) == {"exact_match": score}
