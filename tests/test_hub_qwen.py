"""Qwen3-VL and Qwen2.5-VL families: tiny checkpoints built offline, their processor, template, labels, batches."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import subprocess
import sys
import textwrap

import pytest
import torch
from PIL import Image

from vlmtrain.data.hub_collate import HubVLMCollator
from vlmtrain.data.hub_processing import (
    HubVLMProcessor,
    build_messages,
    check_training_template,
    strip_generation_markers,
)
from vlmtrain.data.processing import IGNORE_INDEX, SkipSample
from vlmtrain.errors import ConfigError
from vlmtrain.models.families import family_of, get_family

FAMILIES = ("qwen3_vl", "qwen2_5_vl")
PIXEL_KEYS = ("pixel_values", "image_grid_thw")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family name -> (family, checkpoint dir, processor), each built once."""
    out = {}
    for name in FAMILIES:
        fam = get_family(name)
        path = fam.build_tiny(str(tmp_path_factory.mktemp(name)), seed=0)
        out[name] = (fam, path, fam.load_processor(path))
    return out


@pytest.fixture(scope="module")
def models(tiny):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    return {name: AutoModelForImageTextToText.from_pretrained(path).eval() for name, (_, path, _) in tiny.items()}


def image(w=32, h=32, color=(200, 30, 30)):
    return Image.new("RGB", (w, h), color)


def sample(n_images, turns=(("What colour?", "Red."),), sizes=((32, 32), (48, 32)), **extra):
    imgs = [image(*sizes[i % len(sizes)], color=(40 * i, 100, 200)) for i in range(n_images)]
    return {"images": imgs, "texts": [{"user": u, "assistant": a} for u, a in turns], **extra}


@pytest.mark.parametrize("name", FAMILIES)
def test_build_tiny_and_load_processor_offline(tiny, name):
    fam, path, proc = tiny[name]
    assert family_of(path) is fam
    assert type(proc.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert getattr(proc, "video_processor", None) is None
    tok = proc.tokenizer
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    for attr, token in (("image_token_id", "<|image_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
                        ("vision_end_token_id", "<|vision_end|>")):
        assert getattr(cfg, attr) == tok.convert_tokens_to_ids(token)
    assert cfg.text_config.pad_token_id == tok.pad_token_id and cfg.text_config.eos_token_id == tok.eos_token_id
    assert cfg.text_config.vocab_size >= len(tok)
    mod = sys.modules[f"vlmtrain.models.families.{name}"]
    assert proc.chat_template == mod.CHAT_TEMPLATE
    # a 32 px image is 4 tokens
    out = proc(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[image()], return_tensors="pt")
    assert int((out["input_ids"] == cfg.image_token_id).sum()) == 4


@pytest.mark.parametrize("name", FAMILIES)
def test_training_template_check(tiny, name):
    fam, _, proc = tiny[name]
    check_training_template(proc, fam)
    no_markers = dataclasses.replace(fam, training_template=strip_generation_markers(fam.training_template))
    with pytest.raises(ConfigError, match=r"no \{% generation %\} markers"):
        check_training_template(proc, no_markers)
    # renders differently: an extra space after each assistant turn
    bad = fam.training_template.replace("endgeneration %}", "endgeneration %}{{ ' ' }}")
    assert bad != fam.training_template
    with pytest.raises(ConfigError, match=rf"{name}.*renders differently.*character \d+"):
        check_training_template(proc, dataclasses.replace(fam, training_template=bad))
    # markers that leave out the end-of-turn token: renders the same, wrong mask
    short = fam.training_template.replace("<|im_end|>{% endgeneration %}", "{% endgeneration %}<|im_end|>")
    short = short.replace("{{- '<|im_end|>' }}\n        {%- endgeneration %}",
                          "{%- endgeneration %}\n        {{- '<|im_end|>' }}")
    assert short != fam.training_template
    with pytest.raises(ConfigError, match="mask covers"):
        check_training_template(proc, dataclasses.replace(fam, training_template=short))


class ImageMaskBug:
    """A processor whose assistant mask is wrong only when the conversation has images, as transformers 5.17's
    was for Qwen3-VL (all zeros: every training loss NaN) while text-only conversations came out right."""

    def __init__(self, processor, how):
        self._processor, self._how = processor, how

    def __getattr__(self, name):
        return getattr(self._processor, name)

    def apply_chat_template(self, messages, **kwargs):
        out = self._processor.apply_chat_template(messages, **kwargs)
        images = any(block["type"] == "image" for m in messages for block in m["content"])
        if kwargs.get("return_assistant_tokens_mask") and images:
            mask = torch.as_tensor(out["assistant_masks"])
            out["assistant_masks"] = torch.zeros_like(mask) if self._how == "zeros" else mask.roll(-3, dims=-1)
        return out


@pytest.mark.parametrize("how", ["zeros", "shifted"])
def test_training_template_check_catches_a_mask_misplaced_by_image_tokens(tiny, how):
    fam, _, proc = tiny["qwen3_vl"]
    with pytest.raises(ConfigError, match=r"(all zeros|mask covers).*probe 'two images, two turns'.*"
                                          r"upgrade transformers"):
        check_training_template(ImageMaskBug(proc, how), fam)


def expected_labels(tok, input_ids):
    """-100 except from each '<|im_start|>assistant\\n' up to and including its '<|im_end|>'."""
    ids = input_ids.tolist()
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    labels = [IGNORE_INDEX] * len(ids)
    for i in range(len(ids)):
        if ids[i:i + len(header)] == header:
            j = i + len(header)
            while ids[j] != end:
                labels[j] = ids[j]
                j += 1
            labels[j] = end
    return torch.tensor(labels)


@pytest.mark.parametrize("name", FAMILIES)
def test_exact_labels_one_image_two_turns(tiny, name):
    fam, _, proc = tiny[name]
    tok = proc.tokenizer
    item = HubVLMProcessor(proc, fam).process(sample(1, turns=(("What colour?", "Red."), ("Sure?", "Yes, red"))))
    ids, labels = item["input_ids"], item["labels"]
    assert torch.equal(labels, expected_labels(tok, ids))
    assert tok.decode(ids[labels != IGNORE_INDEX]) == "Red.<|im_end|>Yes, red<|im_end|>"
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    assert int((ids == image_id).sum()) == 4 and bool((labels[ids == image_id] == IGNORE_INDEX).all())
    assert torch.equal(item["mm_token_type_ids"], (ids == image_id).long())
    assert item["image_grid_thw"].tolist() == [[1, 4, 4]] and item["pixel_values"].shape[0] == 16
    # the generation prompt: everything before the last assistant reply
    n = len(item["prompt_input_ids"])
    assert torch.equal(item["prompt_input_ids"], ids[:n])
    assert tok.decode(item["prompt_input_ids"]).endswith("Sure?<|im_end|>\n<|im_start|>assistant\n")
    assert torch.equal(item["prompt_pixel_values"], item["pixel_values"])


@pytest.mark.parametrize("name", FAMILIES)
def test_score_only_sample_and_head_labels(tiny, name):
    fam, _, proc = tiny[name]
    checked = []

    def check(labels):
        checked.append(labels)
        if not isinstance(labels.get("count"), int):
            raise SkipSample("bad_head_label", "count must be an int")

    hp = HubVLMProcessor(proc, fam, label_check=check)
    item = hp.process({"images": [image()], "texts": [{"user": "Rate it."}], "labels": {"count": 3}})
    assert bool((item["labels"] == IGNORE_INDEX).all()) and item["head_labels"] == {"count": 3}
    assert proc.tokenizer.decode(item["input_ids"]).endswith("Rate it.<|im_end|>\n")
    with pytest.raises(SkipSample, match="bad_head_label"):
        hp.process(sample(1, labels={"count": "three"}))
    assert len(checked) == 2
    coll = HubVLMCollator(hp, label_collate=lambda heads: {"count": torch.tensor([h["count"] for h in heads])})
    batch = coll([sample(0, labels={"count": 1}), sample(2, labels={"count": 2})])
    assert batch["count"].tolist() == [1, 2] and "head_labels" not in batch
    plain = HubVLMCollator(hp)([sample(0), sample(1, labels={"count": 5})])
    assert plain["head_labels"] == [None, {"count": 5}]


def batched_reference(proc, fam, samples, prompt):
    """One batched processor call over the same conversations (what the per-sample path must equal)."""
    convs = []
    for s in samples:
        turns = [(t["user"], t["assistant"]) for t in s["texts"]]
        if prompt:
            turns = [*turns[:-1], (turns[-1][0], None)]
        convs.append(build_messages(turns, s["images"]))
    tok = proc.tokenizer
    side, tok.padding_side = tok.padding_side, "left" if prompt else "right"
    try:
        out = proc.apply_chat_template(convs, chat_template=fam.training_template, tokenize=True, return_dict=True,
                                       return_tensors="pt", add_generation_prompt=prompt,
                                       return_assistant_tokens_mask=not prompt, processor_kwargs={"padding": True})
    finally:
        tok.padding_side = side
    out = dict(out)
    if not prompt:
        out["labels"] = torch.where(out.pop("assistant_masks").bool(), out["input_ids"], IGNORE_INDEX)
    return out


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("n_images", [(0, 0), (1, 1), (2, 2), (0, 1, 2), (2, 0)], ids=str)
def test_batch_equals_one_batched_processor_call(tiny, name, n_images):
    fam, _, proc = tiny[name]
    turns = [(("Hi", "Hello there"),), (("What?", "Red."), ("Sure?", "Yes")), (("Count", "2"),)]
    samples = [sample(n, turns=turns[i % 3]) for i, n in enumerate(n_images)]
    batch = HubVLMCollator(HubVLMProcessor(proc, fam))(samples)
    ref = batched_reference(proc, fam, samples, prompt=False)
    ref_prompt = batched_reference(proc, fam, samples, prompt=True)
    has_pixels = any(n_images)
    for keys in (ref, {f"prompt_{k}": v for k, v in ref_prompt.items()}):
        assert set(keys) == {k for k in batch if k.startswith("prompt_") == next(iter(keys)).startswith("prompt_")
                             and k not in ("skipped", "skipped_keys", "pack_stats")}
        for k, v in keys.items():
            assert torch.equal(batch[k], v), k
    assert ("pixel_values" in batch) == has_pixels
    assert batch["skipped"] == {} and batch["pack_stats"]["images"] == sum(n_images)


@pytest.mark.parametrize("name", FAMILIES)
def test_batched_per_sample_losses_equal_single_sample(tiny, models, name, one_thread):
    fam, _, proc = tiny[name]
    model = models[name]
    coll = HubVLMCollator(HubVLMProcessor(proc, fam))
    samples = [sample(2, turns=(("What?", "Red."), ("Sure?", "Yes"))), sample(0, turns=(("Hi", "Hello there"),)),
               sample(1, turns=(("Count the shapes please", "2"),))]

    def forward(batch):
        inputs = {k: v for k, v in batch.items() if not k.startswith("prompt_")
                  and k not in ("skipped", "skipped_keys", "pack_stats", "labels")}
        with torch.no_grad():
            logits = model(**inputs).logits.float()
        labels = batch["labels"][:, 1:]
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels, reduction="none")
        return ce.sum(1) / (labels != IGNORE_INDEX).sum(1)

    together = forward(coll(samples))
    alone = torch.cat([forward(coll([s])) for s in samples])
    torch.testing.assert_close(together, alone, atol=2e-5, rtol=1e-4)
    single = coll([samples[0]])
    inputs = {k: v for k, v in single.items() if not k.startswith("prompt_")
              and k not in ("skipped", "skipped_keys", "pack_stats")}
    with torch.no_grad():
        assert float(model(**inputs).loss) == pytest.approx(float(alone[0]), rel=1e-5)
    # generation from the left-padded prompts
    batch = coll(samples)
    prompt = {k[len("prompt_"):]: v for k, v in batch.items() if k.startswith("prompt_")}
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=3, do_sample=False, pad_token_id=proc.tokenizer.pad_token_id)
    assert out.shape == (3, prompt["input_ids"].shape[1] + 3)


@pytest.mark.parametrize("name", FAMILIES)
def test_bad_samples_skipped_and_counted(tiny, name, tmp_path):
    fam, _, proc = tiny[name]
    corrupt = io.BytesIO()
    image().save(corrupt, format="PNG")
    bad = {
        "missing_image": sample(0, images=[str(tmp_path / "nope.png")], __key__="m"),
        "corrupt_image": sample(0, images=[corrupt.getvalue()[:40]], __key__="c"),
        "too_many_images": sample(3, __key__="t"),
        "too_long": sample(0, turns=(("x" * 300, "y"),), __key__="l"),
        "control_token_in_text": sample(1, turns=(("look <|image_pad|> here", "ok"),), __key__="p"),
        "placeholder_mismatch": sample(1, turns=(("look <image> and <image>", "ok"),), __key__="q"),
        "malformed_text": {"images": [], "texts": [{"user": "a"}, {"user": "b", "assistant": "c"}], "__key__": "f"},
        "empty_conversation": {"images": [], "texts": []},
        "bad_head_label": sample(0, labels=[1, 2]),
    }
    coll = HubVLMCollator(HubVLMProcessor(proc, fam, max_length=250, max_images=2))
    good = sample(1)
    batch = coll([*bad.values(), good])
    assert batch["skipped"] == {reason: 1 for reason in bad}
    assert batch["input_ids"].shape[0] == 1 and batch["image_grid_thw"].shape[0] == 1
    assert "m (missing_image)" in batch["skipped_keys"] and len(batch["skipped_keys"]) == len(bad)  # each named
    only_bad = coll([bad["too_long"], bad["corrupt_image"]])
    assert set(only_bad) == {"skipped", "skipped_keys", "pack_stats"}
    assert only_bad["skipped"] == {"too_long": 1, "corrupt_image": 1}
    assert coll.skipped["too_long"] == 2
    # already-processed items pass through
    item = HubVLMProcessor(proc, fam).process(good)
    assert torch.equal(coll([item, good])["input_ids"][0], coll([good])["input_ids"][0])


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None,
                    reason="torchvision is installed: transformers imports it whenever it can")
def test_whole_flow_imports_no_torchvision(tiny):
    _, path, _ = tiny["qwen3_vl"]
    code = textwrap.dedent(f"""
        import sys
        import torch
        from PIL import Image
        from transformers import AutoModelForImageTextToText
        from vlmtrain.models.families import family_of
        from vlmtrain.data.hub_processing import HubVLMProcessor, check_training_template
        from vlmtrain.data.hub_collate import HubVLMCollator
        fam = family_of({path!r})
        proc = fam.load_processor({path!r})
        check_training_template(proc, fam)
        img = Image.new("RGB", (32, 32))
        batch = HubVLMCollator(HubVLMProcessor(proc, fam))([{{"images": [img], "texts": [{{"user": "a", "assistant": "b"}}]}}])
        model = AutoModelForImageTextToText.from_pretrained({path!r})
        keep = {{k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels", "pixel_values",
                                                        "image_grid_thw", "mm_token_type_ids")}}
        assert torch.isfinite(model(**keep).loss)
        assert "torchvision" not in sys.modules, "torchvision was imported"
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]
