"""Scripts written for transformers' Trainer whose data is an HF `datasets.Dataset` with columns the model does not
take (run_ner's `tokens`, run_qa's offsets), or whose collator returns transformers' `BatchEncoding` (run_mlm): the
same script runs under transformers' Trainer and vlmtrain's, and what it observes is the same (metrics,
log_history, predictions, errors, files)."""

from __future__ import annotations

import logging
import os

import datasets
import numpy as np
import pytest
import torch
import transformers
from test_transformers_dropin import OUR_EVAL_ADDITIONS, _same_rows, _untimed
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForTokenClassification,
    DataCollatorForLanguageModeling,
    DataCollatorForTokenClassification,
    PreTrainedTokenizerFast,
)

import vlmtrain

FRAMEWORKS = {"hf": (transformers.Trainer, transformers.TrainingArguments),
              "ours": (vlmtrain.Trainer, vlmtrain.TrainingArguments)}
WORDS = [f"w{i}" for i in range(24)]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained on nothing (its vocabulary written out): no network."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def _bert_config(**kw) -> BertConfig:
    return BertConfig(vocab_size=len(SPECIALS) + len(WORDS), hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0, **kw)


def _args(framework: str, out, **kw):
    base = dict(output_dir=str(out / framework), report_to="none", disable_tqdm=True, learning_rate=5e-3,
                per_device_train_batch_size=4, per_device_eval_batch_size=4, optim="adamw_torch", logging_steps=1,
                save_strategy="no", train_sampling_strategy="sequential", seed=7)
    base.update(kw)
    extra = {"use_cpu": True} if framework == "hf" else {}
    return FRAMEWORKS[framework][1](**base, **extra)


# -- token classification: string and offset columns the model does not take --------------------------------------------
def _ner_dataset(n: int, seed: int) -> datasets.Dataset:
    """Sentences as run_ner has them after tokenization: the words (`tokens`, strings), their character spans
    (`offsets`), an `id` string, and the model's input_ids / labels (a word's tag is its index mod 3)."""
    g = np.random.default_rng(seed)
    tok = _tokenizer()
    rows: dict[str, list] = {"id": [], "tokens": [], "offsets": [], "input_ids": [], "labels": []}
    for i in range(n):
        words = [WORDS[j] for j in g.integers(0, len(WORDS), int(g.integers(3, 9)))]
        starts = np.cumsum([0] + [len(w) + 1 for w in words[:-1]])
        rows["id"].append(f"sent-{seed}-{i}")
        rows["tokens"].append(words)
        rows["offsets"].append([[int(s), int(s) + len(w)] for s, w in zip(starts, words)])
        rows["input_ids"].append(tok.convert_tokens_to_ids(words))
        rows["labels"].append([int(w[1:]) % 3 for w in words])
    return datasets.Dataset.from_dict(rows)


def _token_accuracy(p) -> dict:
    predictions, labels = np.asarray(p.predictions).argmax(-1), np.asarray(p.label_ids)
    keep = labels != -100
    return {"accuracy": float((predictions[keep] == labels[keep]).mean())}


def _ner_script(framework: str, out, **args_kw):
    train, dev, test = _ner_dataset(16, 0), _ner_dataset(6, 1), _ner_dataset(5, 2)
    tok = _tokenizer()
    torch.manual_seed(0)
    model = BertForTokenClassification(_bert_config(num_labels=3))
    trainer = FRAMEWORKS[framework][0](
        model=model, args=_args(framework, out, max_steps=4, eval_strategy="steps", eval_steps=2, **args_kw),
        train_dataset=train, eval_dataset=dev, processing_class=tok,
        data_collator=DataCollatorForTokenClassification(tok), compute_metrics=_token_accuracy)
    result = trainer.train()
    evaluation = trainer.evaluate()
    prediction = trainer.predict(test)
    assert train.column_names == ["id", "tokens", "offsets", "input_ids", "labels"]  # the script's set is untouched
    return trainer, result.metrics, evaluation, prediction


def test_token_classification_unused_columns_dropped_as_transformers(tmp_path):
    hf, hf_train, hf_eval, hf_pred = _ner_script("hf", tmp_path)
    ours, train, evaluation, pred = _ner_script("ours", tmp_path)
    assert set(train) == set(hf_train) and _untimed(train) == pytest.approx(_untimed(hf_train), rel=1e-4)
    _same_rows(ours.state.log_history, hf.state.log_history, rel=1e-4)
    assert set(evaluation) - set(hf_eval) == OUR_EVAL_ADDITIONS and set(hf_eval) <= set(evaluation)
    assert _untimed(evaluation) == pytest.approx(_untimed(hf_eval), rel=1e-4)
    assert set(pred.metrics) == set(hf_pred.metrics)
    assert _untimed(pred.metrics) == pytest.approx(_untimed(hf_pred.metrics), rel=1e-4)
    np.testing.assert_allclose(pred.predictions, hf_pred.predictions, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(pred.label_ids, hf_pred.label_ids)


def test_token_classification_keeping_columns_fails_as_transformers(tmp_path):
    """remove_unused_columns=False hands the string columns to the collator: the same error under both."""
    errors = {}
    for framework in FRAMEWORKS:
        with pytest.raises(ValueError) as info:
            _ner_script(framework, tmp_path, remove_unused_columns=False)
        errors[framework] = str(info.value)
    assert "Unable to create tensor" in errors["hf"]
    assert errors["ours"] == errors["hf"]


class _Records:
    """Log records of one logger (transformers' loggers do not propagate to pytest's caplog)."""

    def __init__(self, name: str) -> None:
        self.logger, self.messages = logging.getLogger(name), []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.messages.append(record.getMessage())

    def __enter__(self):
        self.level = self.logger.level
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
        return False


def _ignored_columns(messages: list[str]) -> list[tuple[str, frozenset]]:
    """(set description, column names) of each "have been ignored" message."""
    found = []
    for m in messages:
        if "have been ignored: " in m:
            where = m.split("The following columns ")[1].split(" don't have")[0]
            names = m.split("have been ignored: ")[1].split(". If ")[0]
            found.append((where, frozenset(names.split(", "))))
    return found


def test_ignored_columns_logged_as_transformers(tmp_path):
    data = _ner_dataset(4, 0)
    tok = _tokenizer()
    seen = {}
    for framework, logger in (("hf", "transformers.trainer"), ("ours", "vlmtrain")):
        torch.manual_seed(0)
        trainer = FRAMEWORKS[framework][0](
            model=BertForTokenClassification(_bert_config(num_labels=3)), args=_args(framework, tmp_path, max_steps=1),
            train_dataset=data, eval_dataset=data, data_collator=DataCollatorForTokenClassification(tok))
        with _Records(logger) as records:
            trainer.train()
            trainer.evaluate()
            trainer.predict(data)
        seen[framework] = _ignored_columns(records.messages)
    assert seen["ours"] == seen["hf"]
    assert seen["ours"][0] == ("in the Training set", frozenset({"id", "tokens", "offsets"}))


def test_list_dataset_samples_reach_the_collator_whole(tmp_path):
    """A dataset that is not a datasets.Dataset (a list of dicts) is not trimmed: a collator over vlmtrain's
    samples reads fields that are no forward argument (transformers' Trainer would drop them: a documented
    difference)."""
    data = [{"input_ids": [5, 6, 7], "labels": [0, 1, 2], "tokens": ["w0", "w1", "w2"]}] * 4
    seen = []

    def collate(samples):
        seen.append(sorted(samples[0]))
        return DataCollatorForTokenClassification(_tokenizer())([{k: s[k] for k in ("input_ids", "labels")}
                                                                 for s in samples])

    trainer = vlmtrain.Trainer(model=BertForTokenClassification(_bert_config(num_labels=3)),
                               args=_args("ours", tmp_path, max_steps=1), train_dataset=data, eval_dataset=data,
                               data_collator=collate)
    trainer.train()
    trainer.evaluate()
    assert seen and all(keys == ["input_ids", "labels", "tokens"] for keys in seen)


def test_no_matching_column_is_transformers_error(tmp_path):
    data = datasets.Dataset.from_dict({"text": ["w1 w2", "w3"], "id": ["a", "b"]})
    errors = {}
    for framework in FRAMEWORKS:
        trainer = FRAMEWORKS[framework][0](model=BertForTokenClassification(_bert_config(num_labels=3)),
                                           args=_args(framework, tmp_path, max_steps=1), train_dataset=data)
        with pytest.raises(ValueError) as info:
            trainer.train()
        errors[framework] = str(info.value)
    assert "No columns in the dataset match the model's forward method signature" in errors["ours"]
    assert "remove_unused_columns=False" in errors["ours"]


# -- masked LM: BatchEncoding batches and the counts -------------------------------------------------------------------
def _mlm_dataset(n: int, seed: int) -> datasets.Dataset:
    """run_mlm's tokenized text: input_ids, attention_mask and special_tokens_mask ([CLS] ... [SEP])."""
    g = np.random.default_rng(seed)
    tok = _tokenizer()
    texts = [" ".join(WORDS[j] for j in g.integers(0, len(WORDS), int(g.integers(4, 12)))) for _ in range(n)]
    raw = datasets.Dataset.from_dict({"text": texts})

    def tokenize(batch):
        out = tok(batch["text"])
        out["input_ids"] = [[tok.cls_token_id, *ids, tok.sep_token_id] for ids in out["input_ids"]]
        out["attention_mask"] = [[1] * len(ids) for ids in out["input_ids"]]
        out["special_tokens_mask"] = [[1] + [0] * (len(ids) - 2) + [1] for ids in out["input_ids"]]
        return out

    return raw.map(tokenize, batched=True, remove_columns=["text"])


def _mlm_script(framework: str, out, tokens_seen: str):
    train, dev = _mlm_dataset(16, 0), _mlm_dataset(8, 1)
    tok = _tokenizer()
    torch.manual_seed(0)
    model = BertForMaskedLM(_bert_config())
    # A seeded collator: the same masks in both runs when both call it on the same batches in the same order.
    # Evaluation comes after training (one whole epoch): in the middle of it, transformers' loader (accelerate's)
    # would already have drawn the masks of the next training batch, vlmtrain's not yet.
    collator = DataCollatorForLanguageModeling(tok, mlm_probability=0.3, seed=11)
    trainer = FRAMEWORKS[framework][0](
        model=model, args=_args(framework, out, num_train_epochs=1, logging_steps=2,
                                include_num_input_tokens_seen=tokens_seen),
        train_dataset=train, eval_dataset=dev, processing_class=tok, data_collator=collator)
    metrics = trainer.train().metrics
    trainer.evaluate()
    return trainer, metrics


@pytest.mark.parametrize("tokens_seen", ["all", "non_padding"])
def test_mlm_batch_encoding_counts_flos_and_tokens_as_transformers(tmp_path, tokens_seen):
    hf, hf_train = _mlm_script("hf", tmp_path, tokens_seen)
    ours, train = _mlm_script("ours", tmp_path, tokens_seen)
    assert ours.state.total_flos == hf.state.total_flos > 0
    assert ours.state.num_input_tokens_seen == hf.state.num_input_tokens_seen > 0
    assert set(train) == set(hf_train) and _untimed(train) == pytest.approx(_untimed(hf_train), rel=1e-4)
    _same_rows(ours.state.log_history, hf.state.log_history, rel=1e-4)
    assert ours.state.global_step == 4 and "eval_loss" in ours.state.log_history[-1]


# -- save_model --------------------------------------------------------------------------------------------------------
def test_save_model_writes_training_args_as_transformers(tmp_path):
    saved = {}
    for framework in FRAMEWORKS:
        trainer = FRAMEWORKS[framework][0](model=BertForTokenClassification(_bert_config(num_labels=3)),
                                           args=_args(framework, tmp_path), processing_class=_tokenizer())
        trainer.save_model()
        path = os.path.join(trainer.args.output_dir, "training_args.bin")
        args = torch.load(path, weights_only=False)
        assert args.output_dir == trainer.args.output_dir and args.learning_rate == 5e-3
        saved[framework] = set(os.listdir(trainer.args.output_dir))
        trainer.save_model(str(tmp_path / framework / "elsewhere"))
        assert os.path.isfile(tmp_path / framework / "elsewhere" / "training_args.bin")
    assert saved["hf"] <= saved["ours"]


def test_vlmtrain_collators_reading_whole_samples_keep_every_column(tmp_path):
    """vlmtrain's own collators (keeps_columns: VLM, Hub VLM, text, packing rows, tasks) build the model's inputs
    from fields that are no forward argument (images, texts): a datasets.Dataset reaches them whole."""
    from vlmtrain.data.text import TextCollator
    from vlmtrain.data.vlm_collate import VLMCollator

    assert TextCollator.keeps_columns and VLMCollator.keeps_columns
    data = datasets.Dataset.from_dict({"images": [[]], "texts": [[{"user": "hi", "assistant": "w1"}]]})

    class Whole:
        keeps_columns = True

        def __call__(self, samples):
            raise AssertionError("not called")

    trainer = vlmtrain.Trainer(model=BertForTokenClassification(_bert_config(num_labels=3)),
                               args=_args("ours", tmp_path), data_collator=Whole())
    dataset, collator = trainer._loader_data(data, trainer.data_collator, "Training")
    assert dataset is data and collator is trainer.data_collator
    plain, _ = trainer._loader_data(data.add_column("input_ids", [[5]]), lambda s: s, "Training")
    assert plain.column_names == ["input_ids"]


# -- a model with score heads: its head label columns are its inputs --------------------------------------------------
def _head_rows(n: int) -> list[dict]:
    """Score-only samples (no LM labels): input_ids and one label per head, as `labels_<head>` columns."""
    g = np.random.default_rng(0)
    rows = []
    for _ in range(n):
        ids = [int(t) for t in g.integers(1, 40, int(g.integers(3, 9)))]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels_cls": ids[-1] % 3,
                     "labels_reg": ids[0] / 40})
    return rows


def _train_heads(data, out) -> tuple[list[dict], dict[str, torch.Tensor]]:
    from tiny import tiny_llama

    from vlmtrain.models.objectives.heads import WithHeads

    model = WithHeads(tiny_llama(0), {"cls": {"type": "classification", "num_outputs": 3},
                                      "reg": {"type": "regression", "loss": "mse"}})
    before = {k: v.clone() for k, v in model.heads.state_dict().items()}
    trainer = vlmtrain.Trainer(model=model, args=_args("ours", out, max_steps=2, weight_decay=0.1), train_dataset=data)
    trainer.train()
    moved = {k: (v - before[k]).abs().max() for k, v in model.heads.state_dict().items()}
    return trainer.state.log_history, moved


def test_head_label_columns_kept_for_a_model_with_heads(tmp_path):
    """A datasets.Dataset with `labels_<head>` columns under WithHeads: the columns are the heads' inputs (its
    forward hands them on by keyword), so remove_unused_columns keeps them: the heads train, and every loss is the
    one the same samples give as a list (never trimmed)."""
    rows = _head_rows(8)
    listed, _ = _train_heads(rows, tmp_path / "list")
    history, moved = _train_heads(datasets.Dataset.from_list(rows), tmp_path / "dataset")
    assert all(float(m) > 0 for m in moved.values()), moved
    assert "loss_cls" in history[0] and "loss_reg" in history[0]
    _same_rows(history, listed, rel=1e-6)
