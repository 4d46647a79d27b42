"""Fast tests for the two-digit addition task, the char tokenizer and build_causal_lm."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from vlmtrain.data.tokenizers import build_char_tokenizer
from vlmtrain.models.hub.causal_lm import build_causal_lm
from vlmtrain.tasks.addition import (
    ADDITION_CHARS,
    AdditionCollator,
    AdditionDataset,
    build_addition,
    exact_match_metric,
    split_pairs,
)

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
}


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ADDITION_CHARS)


@pytest.fixture(scope="module")
def task():
    return build_addition(num_train=300, num_eval=50, seed=0)


def test_char_tokenizer_ids_and_decode(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == 4 + len(ADDITION_CHARS)
    ids = tok("37+48=85")["input_ids"]
    assert ids == [tok.convert_tokens_to_ids(c) for c in "37+48=85"]  # one token per char, no bos/eos
    assert tok.decode(ids) == "37+48=85"  # no spaces between characters
    with_specials = [tok.bos_token_id, *ids, tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(with_specials, skip_special_tokens=True) == "37+48=85"
    assert tok("7x")["input_ids"] == [tok.convert_tokens_to_ids("7"), tok.unk_token_id]


def test_char_tokenizer_keeps_spaces():
    tok = build_char_tokenizer("ab ,")
    ids = tok("a , b")["input_ids"]
    assert len(ids) == 5
    assert tok.decode(ids) == "a , b"


def test_char_tokenizer_save_load_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == tok.get_vocab()
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id"):
        assert getattr(loaded, name) == getattr(tok, name)
    ids = loaded("12+99=111")["input_ids"]
    assert ids == tok("12+99=111")["input_ids"]
    assert (
        loaded.decode([loaded.bos_token_id, *ids, loaded.eos_token_id], skip_special_tokens=True)
        == "12+99=111"
    )


def test_known_sample_exact_tokens(tok):
    ds = AdditionDataset(tok, [(37, 48)])
    item = ds[0]
    c = tok.convert_tokens_to_ids
    bos, eos = tok.bos_token_id, tok.eos_token_id
    prompt = [bos, c("3"), c("7"), c("+"), c("4"), c("8"), c("=")]
    assert prompt == [1, 7, 11, 14, 8, 12, 15]  # pins the vocabulary layout too
    assert item["prompt_input_ids"] == prompt
    assert item["input_ids"] == [1, 7, 11, 14, 8, 12, 15, 12, 9, 2]
    assert item["labels"] == [-100, -100, -100, -100, -100, -100, -100, 12, 9, 2]
    assert item["input_ids"] == prompt + [c("8"), c("5"), eos]
    # Three-digit sums get three answer tokens.
    assert AdditionDataset(tok, [(99, 99)])[0]["labels"][-4:] == [c("1"), c("9"), c("8"), eos]


def test_train_eval_pairs_disjoint_and_deterministic():
    train, held_out = split_pairs(num_digits=2, num_eval=500, seed=0)
    assert len(held_out) >= 500
    assert not set(train) & set(held_out)
    # Mirrored pairs stay in one split, so eval is never a memorized (b, a).
    assert not {(b, a) for a, b in train} & set(held_out)
    assert len(set(train)) + len(set(held_out)) == 90 * 90
    assert all(10 <= a <= 99 and 10 <= b <= 99 for a, b in train + held_out)
    assert split_pairs(2, 500, 0) == (train, held_out)
    assert split_pairs(2, 500, 1)[1] != held_out


def test_build_addition_datasets(task):
    train_ds, eval_ds = task["train_dataset"], task["eval_dataset"]
    assert len(train_ds) == 300 and len(eval_ds) == 50
    assert set(train_ds.samples) <= set(train_ds.pairs)
    assert len(set(eval_ds.samples)) == 50  # distinct held-out pairs
    assert not set(train_ds.pairs) & set(eval_ds.samples)
    again = build_addition(num_train=300, num_eval=50, seed=0)
    assert [again["train_dataset"][i] for i in range(10)] == [train_ds[i] for i in range(10)]


def test_collator_padding_sides_and_shapes(tok):
    ds = AdditionDataset(tok, [(10, 10), (99, 99)])  # answers "20" and "198": lengths 10 and 11
    batch = AdditionCollator(tok)([ds[0], ds[1]])
    assert set(batch) == {
        "input_ids",
        "attention_mask",
        "labels",
        "prompt_input_ids",
        "prompt_attention_mask",
    }
    assert all(v.dtype == torch.long for v in batch.values())
    assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["labels"].shape == (2, 11)
    # Training tensors are right-padded.
    assert batch["input_ids"][0].tolist() == ds[0]["input_ids"] + [tok.pad_token_id]
    assert batch["attention_mask"][0].tolist() == [1] * 10 + [0]
    assert batch["labels"][0].tolist() == ds[0]["labels"] + [-100]
    assert batch["input_ids"][1].tolist() == ds[1]["input_ids"]

    ragged = AdditionDataset(tok, [(5, 5), (12, 34)])  # 1-digit operand: shorter prompt
    b2 = AdditionCollator(tok)([ragged[0], ragged[1]])
    assert b2["prompt_input_ids"].shape == b2["prompt_attention_mask"].shape == (2, 7)
    # Prompts are left-padded, so generation continues right after every "=".
    assert (
        b2["prompt_input_ids"][0].tolist()
        == [tok.pad_token_id, tok.pad_token_id] + ragged[0]["prompt_input_ids"]
    )
    assert b2["prompt_attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert (b2["prompt_input_ids"][:, -1] == tok.convert_tokens_to_ids("=")).all()


def test_exact_match_metric(tok):
    c = tok.convert_tokens_to_ids
    eos, pad = tok.eos_token_id, tok.pad_token_id
    labels = np.array(
        [
            [-100] * 7 + [c("8"), c("5"), eos, -100],
            [-100] * 7 + [c("8"), c("5"), eos, -100],
            [-100] * 7 + [c("1"), c("9"), c("8"), eos],
            [-100] * 7 + [c("2"), c("0"), eos, -100],
        ]
    )
    preds = np.array(
        [
            [c("8"), c("5"), eos, -100],  # correct, -100 padding after eos
            [c("8"), c("6"), eos, -100],  # wrong digit
            [c("1"), c("9"), c("8"), eos],  # correct, full width
            [c("2"), c("0"), eos, c("7")],  # correct: tokens after eos are ignored
        ]
    )
    metric = exact_match_metric(tok)
    assert metric(SimpleNamespace(predictions=preds, label_ids=labels)) == {"exact_match": 0.75}
    prefix = np.array([[c("8"), eos, -100, -100]] * 4)  # a strict prefix is not a match
    assert metric(SimpleNamespace(predictions=prefix, label_ids=labels))["exact_match"] == 0.0
    no_eos = np.array([[c("8"), c("5"), pad, -100]])  # ran out of new tokens; pad is ignored
    assert metric(SimpleNamespace(predictions=no_eos, label_ids=labels[:1]))["exact_match"] == 1.0


def test_build_causal_lm_forward_finite_loss(task):
    tok = task["tokenizer"]
    model = build_causal_lm(TINY_LLAMA, tokenizer=tok, seed=0)
    assert model.config.vocab_size == len(tok)
    assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == (0, 1, 2)
    batch = task["data_collator"]([task["train_dataset"][i] for i in range(8)])
    inputs = {k: v for k, v in batch.items() if not k.startswith("prompt_")}
    loss = model(**inputs).loss
    assert math.isfinite(loss.item())
    loss.backward()  # gradients flow through the masked labels
    # Greedy generation from the left-padded prompt works with the collated tensors.
    out = model.generate(
        input_ids=batch["prompt_input_ids"],
        attention_mask=batch["prompt_attention_mask"],
        max_new_tokens=4,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    assert out.shape[0] == 8 and out.shape[1] <= batch["prompt_input_ids"].shape[1] + 4


def test_build_causal_lm_seed_is_reproducible(tok):
    a = build_causal_lm(TINY_LLAMA, tokenizer=tok, seed=3)
    b = build_causal_lm(TINY_LLAMA, tokenizer=tok, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_build_causal_lm_loads_local_dir(tok, tmp_path):
    build_causal_lm(TINY_LLAMA, tokenizer=tok, seed=0).save_pretrained(tmp_path)
    loaded = build_causal_lm(pretrained=str(tmp_path), tokenizer=tok)
    assert loaded.config.vocab_size == len(tok)


def test_build_causal_lm_unknown_model_type_is_helpful():
    with pytest.raises(ValueError, match=r"model_type='lama'.*llama"):
        build_causal_lm({**TINY_LLAMA, "model_type": "lama"})
    with pytest.raises(ValueError, match="model_type"):
        build_causal_lm({"hidden_size": 32})
