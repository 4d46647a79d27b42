"""Model kinds and data sources behind registries: causal_lm on any text source, clear mismatches."""

from __future__ import annotations

import json

import pytest
import yaml

from vlmtrain import run
from vlmtrain.config import ConfigError, load_run_config
from vlmtrain.data.registry import SOURCES, get_source
from vlmtrain.data.text import TextChatProcessor, TextCollator
from vlmtrain.data.tokenizers import build_char_tokenizer
from vlmtrain.models.kinds import KINDS, get_kind

CHARS = "0123456789+=? abcdefghijklmnopqrstuvwxyz\n"


def test_every_registered_kind_and_source_loads_under_its_name():
    assert {get_kind(n).name for n in KINDS} == set(KINDS)
    assert {get_source(n).name for n in SOURCES} == set(SOURCES)
    with pytest.raises(ConfigError, match="model.kind='nope' is not one of"):
        get_kind("nope")


def test_text_processor_labels_only_answers_and_eos():
    tok = build_char_tokenizer(CHARS)
    proc = TextChatProcessor(tok, max_length=64)
    item = proc.process({"texts": [{"user": "1+1=?", "assistant": "2"}, {"user": "2+3=?", "assistant": "5"}]})
    labelled = [t for t, lab in zip(item["input_ids"], item["labels"]) if lab != -100]
    assert labelled == [tok.convert_tokens_to_ids("2"), tok.eos_token_id, tok.convert_tokens_to_ids("5"),
                        tok.eos_token_id]
    assert item["input_ids"][: len(item["prompt_input_ids"])] == item["prompt_input_ids"]
    assert tok.decode(item["prompt_input_ids"][-6:]) == "2+3=?\n"
    batch = TextCollator(proc)([item, {"images": ["x.png"], "texts": [{"user": "a", "assistant": "b"}]},
                                {"texts": "x" * 100}])
    assert batch["skipped"] == {"images_for_text_model": 1, "empty_conversation": 1}
    assert batch["input_ids"].shape[0] == 1 and batch["prompt_input_ids"][0, -1] == tok.convert_tokens_to_ids("\n")


def _write_text_run(tmp_path, packing):
    tok = build_char_tokenizer(CHARS)
    tok.save_pretrained(tmp_path / "tok")
    rows = [{"texts": [{"user": f"{a}+{b}=?", "assistant": str(a + b)}]} for a in range(10) for b in range(10)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    cfg = {"model": {"kind": "causal_lm", "tokenizer": str(tmp_path / "tok"),
                     "config": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                                "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                                "max_position_embeddings": 64}},
           "data": {"source": "jsonl", "train_file": str(tmp_path / "train.jsonl"),
                    "eval_file": str(tmp_path / "eval.jsonl"), "max_length": 32, "packing": packing},
           "train": {"output_dir": str(tmp_path / "run"), "max_steps": 6, "per_device_train_batch_size": 8,
                     "learning_rate": 3e-3, "logging_steps": 2, "save_strategy": "no", "disable_tqdm": True,
                     "predict_with_generate": True, "generation_max_new_tokens": 3}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("packing", [False, True])
def test_causal_lm_trains_on_a_jsonl_text_source(tmp_path, one_thread, packing):
    cfg = load_run_config(_write_text_run(tmp_path, packing))
    metrics = run.train(cfg)
    assert metrics["global_step"] == 6 and metrics["eval_samples"] == 8
    assert 0 <= metrics["eval_exact_match"] <= 1 and metrics["eval_loss"] > 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
    if packing:
        assert any("pack_fill" in r for r in train_rows)


def test_causal_lm_on_text_needs_a_tokenizer(tmp_path):
    cfg = load_run_config(_write_text_run(tmp_path, False), {"model.tokenizer": None})
    with pytest.raises(ConfigError, match="needs a tokenizer: set model.tokenizer or model.pretrained"):
        run.build(cfg)


def test_source_kind_mismatch_names_the_kinds_it_takes(tmp_path):
    path = _write_text_run(tmp_path, False)
    with pytest.raises(ConfigError, match="data.source='addition' needs model.kind='causal_lm'"):
        load_run_config(path, {"data.source": "addition", "model.kind": "vlm", "model.tokenizer": None})
    with pytest.raises(ConfigError, match="model.kind='hub_vlm' needs model.pretrained"):
        load_run_config(path, {"model.kind": "hub_vlm", "model.tokenizer": None})
