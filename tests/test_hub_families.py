"""SmolVLM/Idefics3, LLaVA-OneVision and Gemma 3 as Hub VLM families, each at tiny size, offline.

Per family: the tiny checkpoint builds and loads back with transformers alone; the training template passes
the load-time check (and the checkpoint's own template does not); labels of a 1-image 2-turn sample are
exactly the assistant replies and their end-of-turn tokens; a batch collated from per-sample processing
equals one batched processor call key by key (0, 1 and 2 images per sample); per-sample losses in a batch
equal single-sample ones.
"""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest
import torch
from PIL import Image

from vlmtrain.data.hub_collate import HubVLMCollator
from vlmtrain.data.hub_processing import HubVLMProcessor, build_messages, check_training_template
from vlmtrain.errors import ConfigError
from vlmtrain.models.families import family_of

# (module, build_tiny options): SmolVLM-Instruct (idefics3) and SmolVLM2 (smolvlm) share one family module.
FAMILIES = {"idefics3": ("idefics3", {}), "smolvlm": ("idefics3", {"model_type": "smolvlm"}),
            "llava_onevision": ("llava_onevision", {}), "gemma3": ("gemma3", {})}
# What the model generates after the generation prompt, per family: labelled = PREFIX + reply + end-of-turn.
LABEL_PREFIX = {"idefics3": " ", "llava_onevision": "", "gemma3": ""}
GENERATION_PROMPT = {"idefics3": "Assistant:", "llava_onevision": "<|im_start|>assistant\n",
                     "gemma3": "<start_of_turn>model\n"}


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    """A random colourful image (never all one value, so no crop normalizes to all zeros)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def _sample(n_images: int, seed: int) -> dict:
    sizes = [(40, 30), (24, 48), (32, 32)]
    return {"images": [_image(seed * 10 + i, sizes[(seed + i) % 3]) for i in range(n_images)],
            "texts": [{"user": f"What is {seed}?", "assistant": f"It is {seed}."},
                      {"user": "And?", "assistant": f"Done {seed}"}]}


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    """(family module, checkpoint dir, processor, model) built once per family."""
    from transformers import AutoModelForImageTextToText

    torch.set_num_threads(1)
    name, options = FAMILIES[request.param]
    module = importlib.import_module(f"vlmtrain.models.families.{name}")
    path = module.FAMILY.build_tiny(str(tmp_path_factory.mktemp(request.param)), seed=0, **options)
    processor = module.FAMILY.load_processor(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    return module, path, processor, model


def test_build_and_load_offline(tiny):
    module, path, processor, model = tiny
    family = module.FAMILY
    assert family_of(path) is family
    assert type(model).__name__ == type(processor).__name__.replace("ImageOnly", "").replace(
        "Processor", "ForConditionalGeneration")
    assert type(processor.image_processor).__name__.endswith("Pil")
    assert getattr(processor, "video_processor", None) is None
    tok = processor.tokenizer
    config = model.config
    image_id = getattr(config, "image_token_id", None) or config.image_token_index
    assert image_id == tok.convert_tokens_to_ids(getattr(processor.tokenizer, "image_token", None) or "<image>")
    assert config.get_text_config().vocab_size == len(tok)
    assert config.get_text_config().pad_token_id == tok.pad_token_id
    eot = tok.convert_tokens_to_ids(family.end_of_turn)
    eos = model.generation_config.eos_token_id
    assert eot in (eos if isinstance(eos, list) else [eos])
    # module groups: every parameter in exactly one group; the text module is a real submodule
    groups = {name: [n for n, _ in model.named_parameters() if n.startswith(prefixes)]
              for name, prefixes in family.module_groups.items()}
    assert all(groups.values()), {k: len(v) for k, v in groups.items()}
    grouped = sorted(n for names in groups.values() for n in names)
    assert grouped == sorted(n for n, _ in model.named_parameters())
    text = model.get_submodule(family.text_module)
    assert any(isinstance(m, torch.nn.Linear) for m in text.modules())
    assert not any(n.startswith(family.text_module) for n in groups["vision"] + groups["projector"])


def test_training_template(tiny):
    module, _, processor, _ = tiny
    check_training_template(processor, module.FAMILY)
    # the checkpoint's own template is not a training template (no markers, or the end-of-turn outside them)
    own = dataclasses.replace(module.FAMILY, training_template=module.CHAT_TEMPLATE)
    with pytest.raises(ConfigError, match=module.FAMILY.name):
        check_training_template(processor, own)


def test_exact_labels(tiny):
    module, _, processor, _ = tiny
    family, tok = module.FAMILY, processor.tokenizer
    sample = _sample(1, seed=3)
    item = HubVLMProcessor(processor, family, prompts=False).process(sample)
    ids, labels = item["input_ids"], item["labels"]
    assert ids.dim() == 1 and labels.shape == ids.shape
    expected = torch.full_like(ids, -100)
    start = 0
    for turn in sample["texts"]:
        want = tok.encode(LABEL_PREFIX[family.name] + turn["assistant"] + family.end_of_turn,
                          add_special_tokens=False)
        hits = [i for i in range(start, len(ids) - len(want) + 1) if ids[i:i + len(want)].tolist() == want]
        assert hits, f"{turn['assistant']!r} not found in {tok.decode(ids)!r}"
        expected[hits[0]:hits[0] + len(want)] = ids[hits[0]:hits[0] + len(want)]
        start = hits[0] + len(want)
    assert torch.equal(labels, expected), (tok.decode(ids[labels != -100]), tok.decode(ids[expected != -100]))
    image_id = processor.image_token_id if family.name != "gemma3" else tok.image_token_id
    assert (ids == image_id).sum() > 0 and (labels[ids == image_id] == -100).all()
    if tok.bos_token is not None and family.name == "gemma3":  # the template's BOS, and no second one
        assert ids[0] == tok.bos_token_id and (ids == tok.bos_token_id).sum() == 1


def _batched_call(processor, family, samples):
    """One batched processor call over the samples' conversations (the reference for the collator)."""
    convs = [build_messages([(t["user"], t["assistant"]) for t in s["texts"]], s["images"]) for s in samples]
    tok = processor.tokenizer
    side, tok.padding_side = tok.padding_side, "right"
    try:
        out = processor.apply_chat_template(convs, chat_template=family.training_template, tokenize=True,
                                            return_dict=True, return_tensors="pt", padding=True,
                                            return_assistant_tokens_mask=True)
    finally:
        tok.padding_side = side
    out = dict(out)
    mask = torch.as_tensor(out.pop("assistant_masks")).bool() & out["attention_mask"].bool()
    out["labels"] = torch.where(mask, out["input_ids"], -100)
    return out


@pytest.mark.parametrize("n_images", [(1, 0, 2), (0, 0), (2, 1)], ids=lambda n: "-".join(map(str, n)))
def test_batch_equals_one_processor_call(tiny, n_images):
    module, _, processor, _ = tiny
    samples = [_sample(n, seed=i) for i, n in enumerate(n_images)]
    batch = HubVLMCollator(HubVLMProcessor(processor, module.FAMILY, prompts=False))(samples)
    want = _batched_call(processor, module.FAMILY, samples)
    model_keys = {k for k, v in batch.items() if isinstance(v, torch.Tensor)}
    assert model_keys == set(want), (sorted(model_keys), sorted(want))
    for key, value in want.items():
        assert batch[key].shape == value.shape, (key, batch[key].shape, value.shape)
        assert batch[key].dtype == value.dtype, (key, batch[key].dtype, value.dtype)
        assert torch.equal(batch[key], value), key


def _per_sample_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    shift_logits, shift_labels = logits[:, :-1].float(), labels[:, 1:]
    ce = torch.nn.functional.cross_entropy(shift_logits.transpose(1, 2), shift_labels, reduction="none",
                                           ignore_index=-100)
    return ce.sum(1) / (shift_labels != -100).sum(1)


def _model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "labels"}


def test_batched_losses_equal_single(tiny):
    module, _, processor, model = tiny
    collate = HubVLMCollator(HubVLMProcessor(processor, module.FAMILY, prompts=False))
    samples = [_sample(n, seed=i) for i, n in enumerate((1, 0, 2))]
    batch = collate(samples)
    with torch.no_grad():
        out = model(**_model_inputs(batch), labels=batch["labels"])
        batched = _per_sample_losses(out.logits, batch["labels"])
        singles = []
        for s in samples:
            one = collate([s])
            singles.append(_per_sample_losses(model(**_model_inputs(one)).logits, one["labels"])[0])
    assert torch.isfinite(out.loss)
    torch.testing.assert_close(batched, torch.stack(singles), rtol=1e-4, atol=1e-5)
    # the model's own loss is the mean over the batch's target tokens
    n = (batch["labels"][:, 1:] != -100).sum(1).float()
    torch.testing.assert_close(out.loss, (batched * n).sum() / n.sum(), rtol=1e-4, atol=1e-5)


def test_family_specific_inputs(tiny):
    """What each family's batch must carry for the model to see the right images with the right attention."""
    module, _, processor, model = tiny
    batch = HubVLMCollator(HubVLMProcessor(processor, module.FAMILY))(
        [_sample(n, seed=i) for i, n in enumerate((1, 0, 2))])
    name = module.FAMILY.name
    # generation prompts (left-padded) end with the family's generation prompt and carry the same images
    for ids, mask in zip(batch["prompt_input_ids"], batch["prompt_attention_mask"]):
        text = processor.tokenizer.decode(ids[mask.bool()])
        assert text.endswith(GENERATION_PROMPT[name]) and "Done" not in text, text
    assert torch.equal(batch["prompt_pixel_values"], batch["pixel_values"])
    if name == "idefics3":
        # crops padded per sample; the text-only sample has only all-zero crops and masks
        pixels, mask = batch["pixel_values"], batch["pixel_attention_mask"]
        assert pixels.shape[:2] == mask.shape[:2] and pixels.shape[0] == 3
        assert not pixels[1].any() and not mask[1].any() and mask[0].any() and mask[2].any()
        # the checkpoint's template drops string content: samples must be rendered as content blocks
        text = processor.apply_chat_template([{"role": "user", "content": "hello there"}], tokenize=False)
        assert "hello there" not in text
    elif name == "llava_onevision":
        # images nested per sample: one lone image (anyres, several crops), then two single-view images
        assert batch["batch_num_images"].tolist() == [1, 2]
        assert batch["image_sizes"].shape == (3, 2) and batch["pixel_values"].shape[0] == 3
        assert batch["pixel_values"][0].abs().sum((1, 2, 3)).gt(0).sum() > 1
        assert not batch["pixel_values"][1:, 1:].any()
    else:
        # token_type_ids mark each image's soft tokens; without them Gemma 3's attention silently changes
        image_id = processor.tokenizer.image_token_id
        assert torch.equal(batch["token_type_ids"].bool(), batch["input_ids"] == image_id)
        inputs = _model_inputs(batch)
        with torch.no_grad():
            with_types = model(**inputs).logits
            without = model(**{k: v for k, v in inputs.items() if k != "token_type_ids"}).logits
        assert not torch.allclose(with_types[0], without[0], atol=1e-4)
        torch.testing.assert_close(with_types[1], without[1])  # the text-only sample is unaffected


def _auto_processor(path: str) -> str:
    """The class AutoProcessor builds for ``path``, or the type of the error it raises."""
    from transformers import AutoProcessor

    try:
        return type(AutoProcessor.from_pretrained(path)).__name__
    except (ImportError, OSError, ValueError) as err:
        return type(err).__name__


def test_saved_processor_loads_with_auto_processor_as_its_base(tiny, tmp_path):
    """A processor vlmtrain saves (checkpoints, exports) loads with transformers' AutoProcessor exactly as the
    checkpoint it came from does: the real class where transformers needs no torchvision for it (Gemma 3,
    Idefics3), processing a sample as vlmtrain's processor does; the base's video processor settings where the
    real class has a video processor (transformers' AutoVideoProcessor reads the same ones)."""
    import inspect

    import transformers
    from transformers.video_processing_utils import BaseVideoProcessor

    _, path, processor, _ = tiny
    saved = str(tmp_path / "saved")
    processor.save_pretrained(saved)
    assert _auto_processor(saved) == _auto_processor(path)
    real = getattr(transformers, getattr(processor, "saved_class_name", type(processor).__name__))
    if "video_processor" in inspect.signature(real.__init__).parameters:
        def settings(folder):
            try:
                return BaseVideoProcessor.get_video_processor_dict(folder)[0]
            except OSError:
                return None
        assert settings(saved) == settings(path)
        return
    auto = transformers.AutoProcessor.from_pretrained(saved)
    assert type(auto) is real
    images = [_image(0, (40, 30))]
    text = processor.apply_chat_template(build_messages([("What is it?", "A test.")], images), tokenize=False)
    ours = processor(text=[text], images=[images], return_tensors="pt")
    theirs = auto(text=[text], images=[images], return_tensors="pt")
    assert set(ours) == set(theirs)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def test_tiny_tokenizer_is_the_same_file_in_every_process(tmp_path):
    """The byte vocabulary's order does not follow a process's string hashing: two processes with different
    PYTHONHASHSEEDs write the same tokenizer.json (else the same weights read other bytes in each run)."""
    import os
    import subprocess
    import sys

    code = ("import sys; from vlmtrain.models.families.tiny import byte_level_tokenizer as b; "
            "b(['<pad>', '<eos>'], bos=None, eos='<eos>', pad='<pad>').save_pretrained(sys.argv[1])")
    files = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        subprocess.run([sys.executable, "-c", code, str(out)], check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed})
        files.append((out / "tokenizer.json").read_bytes())
    assert files[0] == files[1]


def test_build_tiny_hub_script_changes_the_layer_count(tmp_path):
    """scripts/build_tiny_hub.py --text num_hidden_layers=3: the per-layer layer_types follow the new count."""
    import json
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "build_tiny_hub.py"
    build = runpy.run_path(str(script))["build"]
    build("qwen2_5_vl", str(tmp_path), text={"num_hidden_layers": 3})
    text = json.loads((tmp_path / "config.json").read_text())["text_config"]
    assert text["num_hidden_layers"] == 3 and len(text["layer_types"]) == 3
