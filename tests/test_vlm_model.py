"""VisionLanguageModel: projector math, image splicing, loss contract, generation, save/load, building."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModel, LlamaConfig, LlamaForCausalLM, SiglipConfig, SiglipModel

from vlmtrain import Trainer, TrainingArguments
from vlmtrain.data.tokenizers import build_char_tokenizer
from vlmtrain.models.own_vlm.build import build_vlm
from vlmtrain.models.own_vlm.projector import ModalityProjector, pixel_shuffle
from vlmtrain.models.own_vlm.vlm import VisionLanguageModel, VLMConfig
from vlmtrain.trainer import ConfigError
from vlmtrain.trainer.optim import build_param_groups

VOCAB, IMG, PAD, EOS = 40, 5, 0, 2
VISION = dict(model_type="siglip_vision_model", image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=4)  # 4x4 = 16 patches
TEXT = dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD,
            bos_token_id=1, eos_token_id=EOS)
L = 4  # image tokens per image: 16 patches / 2^2


def tiny_vlm(seed: int = 0, **text) -> VisionLanguageModel:
    torch.manual_seed(seed)
    model = build_vlm(VISION, {**TEXT, **text}, pixel_shuffle_factor=2)
    model.config.image_token_id = IMG
    return model.eval()


def sample(n_images: int, n_text: int, seed: int) -> list[int]:
    """BOS, then n_images placeholder runs each followed by a text token, then n_text text tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = [1]
    for _ in range(n_images):
        ids += [IMG] * L + [int(torch.randint(6, VOCAB, (1,), generator=g))]
    return ids + torch.randint(6, VOCAB, (n_text,), generator=g).tolist()


def pad(seqs: list[list[int]], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs))
    rows = [([PAD] * (width - len(s)) + s) if side == "left" else (s + [PAD] * (width - len(s))) for s in seqs]
    ids = torch.tensor(rows)
    mask = torch.tensor([([0] * (width - len(s)) + [1] * len(s)) if side == "left" else
                         ([1] * len(s) + [0] * (width - len(s))) for s in seqs])
    return ids, mask


# -- projector ------------------------------------------------------------------------------------------
def test_pixel_shuffle_matches_reference_and_shapes():
    b, g, d, f = 2, 4, 3, 2
    x = torch.randn(b, g * g, d)
    out = pixel_shuffle(x, f)
    assert out.shape == (b, (g // f) ** 2, d * f * f)
    grid = x.reshape(b, g, g, d)
    for i in range(g // f):
        for j in range(g // f):  # output token (i, j) = its f x f block, concatenated row-major
            block = [grid[:, i * f + di, j * f + dj] for di in range(f) for dj in range(f)]
            assert torch.equal(out[:, i * (g // f) + j], torch.cat(block, dim=-1))
    assert torch.equal(pixel_shuffle(x, 1), x)
    # SigLIP2-B/16-512: 32x32 = 1024 patches, factor 4 -> 64 tokens of 16x the width
    assert pixel_shuffle(torch.zeros(1, 1024, 2), 4).shape == (1, 64, 32)
    with pytest.raises(ValueError, match="does not divide the 4x4"):
        pixel_shuffle(x, 3)
    with pytest.raises(ValueError, match="perfect square"):
        pixel_shuffle(torch.zeros(1, 15, 2), 1)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_projector_maps_to_decoder_width(kind):
    proj = ModalityProjector(vision_hidden=8, text_hidden=5, factor=2, projector_type=kind)
    assert proj(torch.randn(3, 16, 8)).shape == (3, 4, 5)
    with pytest.raises(ValueError, match="projector_type"):
        ModalityProjector(8, 5, 2, "conv")


def test_config_derives_image_token_length_and_round_trips(tmp_path):
    cfg = VLMConfig(vision_config=VISION, text_config=TEXT, pixel_shuffle_factor=2, image_token_id=IMG)
    assert (cfg.image_token_length, cfg.image_size) == (L, 32)
    assert VLMConfig(vision_config=VISION, text_config=TEXT, pixel_shuffle_factor=4).image_token_length == 1
    with pytest.raises(ConfigError, match="must divide"):
        VLMConfig(vision_config=VISION, text_config=TEXT, pixel_shuffle_factor=3)
    cfg.save_pretrained(tmp_path)
    back = AutoConfig.from_pretrained(tmp_path)  # registered model_type "vlmtrain_vlm"
    assert isinstance(back, VLMConfig) and back.image_token_length == L and back.image_token_id == IMG
    assert back.vision_config.model_type == "siglip_vision_model" and back.text_config.model_type == "llama"


# -- forward ----------------------------------------------------------------------------------------------
def test_forward_with_two_and_zero_images():
    model = tiny_vlm().train()
    ids, mask = pad([sample(2, 3, 0), sample(0, 5, 1)], "right")
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100
    rows = []  # the LM head's input rows: only the positions that predict a label
    model.decoder.lm_head.register_forward_hook(lambda m, inputs, output: rows.append(output.shape))
    out = model(ids, mask, torch.randn(2, 3, 32, 32), labels=labels)
    n = int((labels[:, 1:] != -100).sum())
    assert torch.isfinite(out["loss"]) and rows == [(n, VOCAB)] and "logits" not in out
    assert int(out["num_items"]) == n
    out["loss"].backward()
    assert model.projector.proj.weight.grad.abs().sum() > 0
    assert model.vision_encoder.embeddings.patch_embedding.weight.grad.abs().sum() > 0


def test_text_only_batch_touches_image_params_and_no_targets_is_zero_loss():
    model = tiny_vlm().train()
    ids, mask = pad([sample(0, 4, 0), sample(0, 6, 1)], "right")
    out = model(ids, mask, torch.zeros(0, 3, 32, 32), labels=torch.full_like(ids, -100))
    assert out["loss"].item() == 0.0 and int(out["num_items"]) == 0
    out["loss"].backward()
    # every trainable parameter gets a (zero) gradient, so DDP does not stall on text-only batches
    assert all(p.grad is not None for p in model.parameters())
    assert model.projector.proj.weight.grad.abs().sum() == 0
    assert model(ids, mask, None)["logits"].shape == (*ids.shape, VOCAB)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_training_loss_from_target_logits_equals_full_logits(softcap):
    """Training computes logits only where a label is predicted: same loss and gradients as the full logits
    (eval mode; no dropout here); a decoder that post-processes its logits (soft-capping) keeps the full path."""
    model = tiny_vlm()
    model.decoder.config.final_logit_softcapping = softcap
    ids, mask = pad([sample(2, 5, 0), sample(1, 7, 1), sample(0, 4, 2)], "right")
    labels = ids.masked_fill((mask == 0) | (ids == IMG), -100)
    labels[:, :3] = -100
    pixels = torch.randn(3, 3, 32, 32)
    full = model.eval()(ids, mask, pixels, labels=labels)
    full["loss"].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    rows = []
    model.decoder.lm_head.register_forward_hook(lambda m, inputs, output: rows.append(output.shape[:-1]))
    part = model.train()(ids, mask, pixels, labels=labels)
    part["loss"].backward()
    targets_only = rows == [(int(part["num_items"]),)]  # else the full [B, L] logits
    assert ("logits" not in part) == targets_only == (softcap is None) == (model.vlmtrain_target_logits_module
                                                                           is not None)
    assert torch.allclose(part["loss"], full["loss"], atol=1e-6) and int(part["num_items"]) == int(full["num_items"])
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, grads[name], atol=1e-6), name


def test_placeholder_mismatch_names_the_sample():
    model = tiny_vlm()
    ids, mask = pad([sample(1, 2, 0), sample(1, 2, 1)], "right")
    with pytest.raises(ValueError, match=r"sample 1 has 4 image-token positions .* only 1 images"):
        model(ids, mask, torch.randn(1, 3, 32, 32))
    truncated, mask = pad([sample(0, 2, 0), sample(1, 2, 1)[:3]], "right")
    with pytest.raises(ValueError, match=r"sample 1 has 2 image-token positions, not a multiple of .*=4"):
        model(truncated, mask, torch.randn(1, 3, 32, 32))
    ids, mask = pad([sample(0, 2, 0), sample(1, 2, 1)], "right")
    with pytest.raises(ValueError, match="pixel_values has 2 images but .* account for 1"):
        model(ids, mask, torch.randn(2, 3, 32, 32))
    with pytest.raises(ValueError, match=r"sample 0 has 0 image-token positions .* but 1 images"):
        model(ids, mask, torch.randn(1, 3, 32, 32), image_counts=[1, 0])
    with pytest.raises(ValueError, match="expects 32x32"):
        model(ids, mask, torch.randn(1, 3, 16, 16))


def test_batched_forward_equals_per_sample_forwards():
    model = tiny_vlm()
    seqs, counts = [sample(2, 1, 0), sample(0, 7, 1), sample(1, 2, 2)], [2, 0, 1]
    pixels = torch.randn(sum(counts), 3, 32, 32)
    ids, mask = pad(seqs, "right")
    with torch.no_grad():
        batched = model(ids, mask, pixels, labels=ids.masked_fill(mask == 0, -100))
        start, weighted = 0, 0.0
        for b, (s, n) in enumerate(zip(seqs, counts)):
            one = model(torch.tensor([s]), None, pixels[start:start + n], labels=torch.tensor([s]))
            start += n
            torch.testing.assert_close(batched["logits"][b, :len(s)], one["logits"][0], atol=1e-5, rtol=1e-5)
            weighted += one["loss"] * one["num_items"]
    torch.testing.assert_close(batched["loss"], weighted / batched["num_items"], atol=1e-5, rtol=1e-5)


def test_image_index_embeddings_mark_each_image_of_a_sample(tmp_path):
    """image_index_embeddings adds vector k to every token of a sample's (k+1)-th image (a sample's images are one
    run of placeholders; later images share the last vector); zero at init, trained, saved with the model."""
    plain = tiny_vlm()
    torch.manual_seed(0)
    model = build_vlm(VISION, TEXT, pixel_shuffle_factor=2, image_index_embeddings=2)
    model.config.image_token_id = IMG
    # one row: a sample with three images in one run, then a packed second sample with one image
    row = [1] + [IMG] * (3 * L) + [7, 8] + [IMG] * L + [9]
    ids, pixels = torch.tensor([row]), torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model.embed(ids, pixels), plain.embed(ids, pixels))  # zero at init
        vectors = torch.randn(2, model.config.text_config.hidden_size)
        model.projector.image_index.weight.copy_(vectors)
        added = (model.embed(ids, pixels) - plain.embed(ids, pixels))[0]
    expected = torch.zeros_like(added)
    for start, k in ((1, 0), (1 + L, 1), (1 + 2 * L, 1), (3 + 3 * L, 0)):
        expected[start:start + L] = vectors[k]
    torch.testing.assert_close(added, expected)
    model.train()
    labels = ids.clone()
    model(ids, None, pixels, labels=labels)["loss"].backward()
    assert model.projector.image_index.weight.grad.abs().sum(-1).min() > 0  # both vectors learn
    model.save_pretrained(tmp_path)
    loaded = VisionLanguageModel.from_pretrained(tmp_path).eval()
    assert loaded.config.image_index_embeddings == 2
    assert torch.equal(loaded.projector.image_index.weight, model.projector.image_index.weight)
    with pytest.raises(ValueError, match="image_index_embeddings"):
        ModalityProjector(8, 8, image_index_embeddings=-1)


# -- generation -------------------------------------------------------------------------------------------
def test_generate_cache_matches_no_cache_and_per_sample():
    model = tiny_vlm(seed=1)
    seqs, counts = [sample(1, 2, 3), sample(0, 3, 4), sample(2, 1, 5)], [1, 0, 2]
    pixels = torch.randn(sum(counts), 3, 32, 32)
    ids, mask = pad(seqs, "left")
    kw = dict(max_new_tokens=8, eos_token_id=[])  # no eos: all 8 steps run
    cached = model.generate(ids, mask, pixels, **kw)
    assert cached.shape == (3, ids.shape[1] + 8) and torch.equal(cached[:, :ids.shape[1]], ids)
    assert torch.equal(cached, model.generate(ids, mask, pixels, use_cache=False, **kw))
    start = 0
    for b, (s, n) in enumerate(zip(seqs, counts)):  # left padding changes nothing
        one = model.generate(torch.tensor([s]), None, pixels[start:start + n] if n else None, **kw)
        start += n
        assert torch.equal(one[0, len(s):], cached[b, ids.shape[1]:])
    # transformers' own generate on the spliced embeddings agrees (it returns only the new tokens)
    hf = model.decoder.generate(inputs_embeds=model.embed(ids, pixels), attention_mask=mask, max_new_tokens=8,
                                do_sample=False, eos_token_id=None, pad_token_id=PAD)
    assert torch.equal(hf, cached[:, ids.shape[1]:])


def test_generate_with_a_cache_logs_no_deprecation(monkeypatch):
    """The KV-cache loop uses the decoder's own name for the cache: no transformers deprecation line on the
    console of every evaluation (the demo's included)."""
    import transformers.utils.logging as hf_logging

    said = []
    monkeypatch.setattr(hf_logging.logging.Logger, "warning", lambda self, msg, *a, **k: said.append(str(msg)))
    hf_logging.warning_once.cache_clear()  # a warning another test already triggered would not show again
    model = tiny_vlm(seed=1)
    ids, mask = pad([sample(1, 2, 3)], "left")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(ids, mask, torch.randn(1, 3, 32, 32), max_new_tokens=3, eos_token_id=[])
    assert out.shape == (1, ids.shape[1] + 3)
    said += [str(w.message) for w in caught]
    assert not [m for m in said if "deprecated" in m], said


def test_generate_stops_at_eos_per_sample():
    model = tiny_vlm(seed=1)
    ids, mask = pad([sample(1, 2, 3), sample(0, 3, 4)], "left")
    pixels = torch.randn(1, 3, 32, 32)
    free = model.generate(ids, mask, pixels, max_new_tokens=6, eos_token_id=[])[:, ids.shape[1]:]
    eos = int(free[0, 1])  # make sample 0's second new token the eos
    out = model.generate(ids, mask, pixels, max_new_tokens=6, eos_token_id=eos, pad_token_id=PAD)[:, ids.shape[1]:]
    first = (free[1] == eos).nonzero()
    stop1 = int(first[0]) if len(first) else 6
    assert out[0, :2].tolist() == free[0, :2].tolist() and (out[0, 2:] == PAD).all()
    assert out[1, :stop1 + 1].tolist() == free[1, :stop1 + 1].tolist() and (out[1, stop1 + 1:] == PAD).all()
    with pytest.raises(ValueError, match="left-padded"):
        model.generate(*pad([sample(1, 2, 3), sample(0, 3, 4)], "right"), pixels)


# -- save / load ------------------------------------------------------------------------------------------
def test_save_pretrained_round_trip_with_tied_decoder(tmp_path):
    model = tiny_vlm(tie_word_embeddings=True)
    assert model.decoder.lm_head.weight is model.decoder.get_input_embeddings().weight
    ids, mask = pad([sample(1, 2, 0), sample(0, 4, 1)], "right")
    pixels = torch.randn(1, 3, 32, 32)
    model.save_pretrained(tmp_path)
    assert {"config.json", "model.safetensors"} <= {p.name for p in tmp_path.iterdir()}
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "vlmtrain_vlm"
    with torch.no_grad():
        ref = model(ids, mask, pixels)["logits"]
        for loaded in (VisionLanguageModel.from_pretrained(tmp_path), AutoModel.from_pretrained(tmp_path)):
            assert isinstance(loaded, VisionLanguageModel)
            assert loaded.decoder.lm_head.weight is loaded.decoder.get_input_embeddings().weight
            assert torch.equal(loaded.eval()(ids, mask, pixels)["logits"], ref)
        fresh = tiny_vlm(seed=7, tie_word_embeddings=True)
        Trainer.parts.model_files.load_model_weights(fresh, str(tmp_path))
        assert torch.equal(fresh(ids, mask, pixels)["logits"], ref)


# -- building ---------------------------------------------------------------------------------------------
def test_build_vlm_with_tokenizer_adds_image_token():
    tok = build_char_tokenizer("abcdefgh ")
    before = len(tok)
    model = build_vlm(VISION, {k: v for k, v in TEXT.items() if k != "vocab_size"}, 2, tokenizer=tok)
    assert len(tok) == before + 1 and "<image>" in tok.all_special_tokens
    image_id = tok.convert_tokens_to_ids("<image>")
    assert model.config.image_token_id == image_id
    assert model.decoder.get_input_embeddings().num_embeddings == len(tok) == model.config.text_config.vocab_size
    assert tok("ab<image>c")["input_ids"] == [tok.convert_tokens_to_ids(c) for c in "ab"] + [image_id, 6]
    build_vlm(VISION, TEXT, 2, tokenizer=tok)  # already there: not added twice
    assert len(tok) == before + 1


def test_module_names_for_per_module_learning_rates():
    model = tiny_vlm()
    assert {"vision_encoder", "projector", "decoder"} == {n for n, _ in model.named_children()}
    assert all(n.split(".")[0] in {"vision_encoder", "projector", "decoder"} for n, _ in model.named_parameters())
    args = TrainingArguments(learning_rate=1e-3,
                             module_learning_rates={"projector": 5e-3, "vision_encoder": 5e-5, "decoder": 5e-5})
    groups = build_param_groups(model, args)
    assert {g["name"] for g in groups} == {"projector", "vision_encoder", "decoder"}


def test_unknown_model_type_names_close_matches():
    with pytest.raises(ConfigError, match=r"'siglip_vison_model' .* Did you mean 'siglip_vision_model'"):
        build_vlm({**VISION, "model_type": "siglip_vison_model"}, TEXT, 2)
    with pytest.raises(ConfigError, match=r"'lama' .* Did you mean 'llama'"):
        build_vlm(VISION, {**TEXT, "model_type": "lama"}, 2)
    with pytest.raises(ConfigError, match="no causal LM"):
        build_vlm(VISION, VISION, 2)
    with pytest.raises(ConfigError, match="needs a model_type"):
        build_vlm(VISION, {"hidden_size": 32}, 2)


def test_load_backbone_from_local_dirs(tmp_path):
    torch.manual_seed(0)
    vision = {k: v for k, v in VISION.items() if k != "model_type"}
    siglip = SiglipModel(SiglipConfig(vision_config=vision, text_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=50)))
    llama = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TEXT.items() if k != "model_type"}))
    siglip.save_pretrained(tmp_path / "vision")
    llama.save_pretrained(tmp_path / "text")
    model = build_vlm(str(tmp_path / "vision"), str(tmp_path / "text"), 4, "mlp", load_backbone=True)
    assert model.config.image_token_length == 1 and model.config.vision_config.vision_use_head is False
    assert torch.equal(model.vision_encoder.embeddings.patch_embedding.weight,
                       siglip.vision_model.embeddings.patch_embedding.weight)
    assert torch.equal(model.decoder.lm_head.weight, llama.lm_head.weight)
    # Pretrained position embeddings are kept as they are (no sin-cos overwrite).
    assert torch.equal(model.vision_encoder.embeddings.position_embedding.weight,
                       siglip.vision_model.embeddings.position_embedding.weight)


@pytest.mark.parametrize("vision", [VISION, dict(model_type="siglip2_vision_model", num_patches=16, patch_size=8,
                                                 hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=4)])
def test_random_init_tower_gets_2d_sincos_positions(vision):
    """Patches in the same column share the x half of their position vector, same row the y half; columns and
    rows differ; values are sin/cos themselves (unit scale, as in MAE)."""
    table = build_vlm(vision, TEXT, 2).vision_encoder.embeddings.position_embedding.weight.detach()
    g, half = 4, table.shape[1] // 2
    grid = table.reshape(g, g, -1)  # [row, column, dim]
    for c in range(g):
        assert torch.allclose(grid[:, c, :half], grid[0, c, :half].expand(g, -1))
        assert torch.allclose(grid[c, :, half:], grid[c, 0, half:].expand(g, -1))
    assert all(not torch.allclose(grid[0, a, :half], grid[0, b, :half]) for a in range(g) for b in range(a))
    quarter = table.shape[1] // 4  # patch (0, 0): sin(0) = 0 and cos(0) = 1 for x, then for y
    origin = torch.cat([torch.zeros(quarter), torch.ones(quarter)]).repeat(2)
    assert table.abs().max() <= 1.0 and torch.allclose(table[0], origin)
    scaled = build_vlm(vision, TEXT, 2, vision_position_scale=3.0).vision_encoder.embeddings.position_embedding
    assert torch.allclose(scaled.weight.detach(), 3.0 * table)


def test_siglip2_vision_tower():
    vision = dict(model_type="siglip2_vision_model", num_patches=16, patch_size=8, hidden_size=32,
                  intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    model = build_vlm(vision, TEXT, 2)
    model.config.image_token_id = IMG
    assert (model.config.image_size, model.config.image_token_length) == (32, L)
    ids, mask = pad([sample(1, 2, 0)], "right")
    out = model(ids, mask, torch.randn(1, 3, 32, 32), labels=ids)
    assert torch.isfinite(out["loss"])
