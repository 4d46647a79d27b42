"""A summarization script in transformers' run_summarization idiom (Seq2SeqTrainer, Seq2SeqTrainingArguments,
DataCollatorForSeq2Seq, predict_with_generate, a ROUGE-like metric that decodes the generated ids), run with
transformers' classes and with vlmtrain's (only the import differs): the same metrics, generated ids, predict()
outputs and log_history rows. A tiny random-init Bart and a word-level tokenizer built here: no network."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import BartConfig, BartForConditionalGeneration, GenerationConfig, PreTrainedTokenizerFast

import vlmtrain
from vlmtrain.errors import ConfigError

FRAMEWORKS = {"hf": (transformers.Seq2SeqTrainer, transformers.Seq2SeqTrainingArguments),
              "ours": (vlmtrain.Seq2SeqTrainer, vlmtrain.Seq2SeqTrainingArguments)}
OUR_EVAL_ADDITIONS = {"eval_samples"}  # (vlmtrain's evaluate() adds the number of samples evaluated)
TIMINGS = ("_runtime", "_per_second", "_time")
WORDS = "red green blue cat dog bird runs sleeps eats fast slow big small the a on".split()


def _tokenizer() -> PreTrainedTokenizerFast:
    """Word-level: <pad>=0, <s>=1, </s>=2, <unk>=3, then WORDS."""
    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", *WORDS])}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def _bart(tok: PreTrainedTokenizerFast) -> BartForConditionalGeneration:
    torch.manual_seed(0)
    config = BartConfig(vocab_size=len(tok), d_model=32, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                        decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        decoder_start_token_id=2, forced_eos_token_id=2)
    return BartForConditionalGeneration(config)


def _documents(n: int, seed: int) -> list[dict]:
    """A 'document' of 5-9 words; its 'summary' is its first three words."""
    g = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        words = [WORDS[i] for i in g.integers(0, len(WORDS), int(g.integers(5, 10)))]
        docs.append({"document": " ".join(words), "summary": " ".join(words[:3])})
    return docs


def _preprocess(tok: PreTrainedTokenizerFast, docs: list[dict]) -> list[dict]:
    """What a summarization script's map(preprocess_function) gives: input ids with <s> ... </s>, labels ... </s>."""
    rows = []
    for d in docs:
        source = tok(d["document"], add_special_tokens=False)["input_ids"]
        target = tok(text_target=d["summary"], add_special_tokens=False)["input_ids"]
        ids = [tok.bos_token_id, *source, tok.eos_token_id]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": [*target, tok.eos_token_id]})
    return rows


def _metrics_fn(tok: PreTrainedTokenizerFast):
    def compute_metrics(eval_preds) -> dict:
        preds, labels = eval_preds.predictions, eval_preds.label_ids
        preds = np.where(preds != -100, preds, tok.pad_token_id)
        labels = np.where(labels != -100, labels, tok.pad_token_id)
        decoded_preds = tok.batch_decode(preds, skip_special_tokens=True)
        decoded_labels = tok.batch_decode(labels, skip_special_tokens=True)
        scores = []
        for pred, ref in zip(decoded_preds, decoded_labels):  # unigram-overlap F1 (ROUGE-1-like)
            p, r = pred.split(), ref.split()
            overlap = sum(min(p.count(w), r.count(w)) for w in set(p))
            scores.append(0.0 if not overlap else 2 * overlap / (len(p) + len(r)))
        gen_len = [np.count_nonzero(row != tok.pad_token_id) for row in preds]
        return {"rouge1": round(100 * float(np.mean(scores)), 4), "gen_len": float(np.mean(gen_len))}
    return compute_metrics


def _summarization_script(framework: str, out, num_beams: int, **args_kw):
    trainer_cls, args_cls = FRAMEWORKS[framework]
    tok = _tokenizer()
    model = _bart(tok)
    # (eval sets of whole batches: transformers weights the last batch's mean loss as a full batch's, vlmtrain by
    # its targets, so the two eval_loss agree when every batch is full)
    train, evaluation = _preprocess(tok, _documents(8, 0)), _preprocess(tok, _documents(8, 1))
    extra = {"use_cpu": True} if framework == "hf" else {}
    kw = dict(output_dir=str(out / framework), report_to="none", disable_tqdm=True, learning_rate=1e-2,
              per_device_train_batch_size=8, per_device_eval_batch_size=4, optim="adamw_torch",
              train_sampling_strategy="sequential", logging_steps=2, max_steps=8, eval_strategy="steps",
              eval_steps=4, save_strategy="no", predict_with_generate=True, generation_max_length=8,
              generation_num_beams=num_beams)
    args = args_cls(**{**kw, **args_kw}, **extra)
    collator = transformers.DataCollatorForSeq2Seq(tok, model=model, label_pad_token_id=-100)
    trainer = trainer_cls(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                          data_collator=collator, processing_class=tok, compute_metrics=_metrics_fn(tok))
    result = trainer.train()
    metrics = trainer.evaluate(max_length=6, num_beams=num_beams, metric_key_prefix="eval")
    predictions = trainer.predict(evaluation, metric_key_prefix="predict")
    return trainer, result.metrics, metrics, predictions


# total_flos is 0 with a collator that returns a BatchEncoding (DataCollatorForSeq2Seq): issue 45 item 5, fixed on
# its own branch; its key is still compared.
UNCOMPARED = OUR_EVAL_ADDITIONS | {"total_flos"}


def _untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith(TIMINGS) and k not in UNCOMPARED}


@pytest.mark.parametrize("num_beams", [1, 2])
def test_summarization_script_as_transformers(tmp_path, num_beams):
    hf, hf_train, hf_eval, hf_pred = _summarization_script("hf", tmp_path, num_beams)
    ours, train, evaluation, pred = _summarization_script("ours", tmp_path, num_beams)
    assert set(train) == set(hf_train) and _untimed(train) == pytest.approx(_untimed(hf_train), rel=1e-5)
    # log_history: training rows and the evaluations during training (generation_max_length 8), same keys/values
    assert len(ours.state.log_history) == len(hf.state.log_history)
    for mine, theirs in zip(ours.state.log_history, hf.state.log_history):
        assert set(mine) - set(theirs) <= OUR_EVAL_ADDITIONS and set(theirs) <= set(mine)
        assert _untimed(mine) == pytest.approx(_untimed(theirs), rel=1e-5)
    assert any("eval_rouge1" in h for h in ours.state.log_history)
    assert evaluation["eval_rouge1"] > 0  # (the metric sees real words)
    # evaluate(max_length=6, num_beams=...): the call's generation kwargs over the arguments'
    assert set(evaluation) - set(hf_eval) == OUR_EVAL_ADDITIONS and set(hf_eval) <= set(evaluation)
    assert evaluation["eval_loss"] == pytest.approx(hf_eval["eval_loss"], rel=1e-5)
    assert evaluation["eval_rouge1"] == hf_eval["eval_rouge1"] and evaluation["eval_gen_len"] == hf_eval["eval_gen_len"]
    # predict(): generated ids padded as transformers pads them (to the generation config's max_length, then -100
    # across batches), the labels likewise, and the same metrics keys
    assert set(pred.metrics) == set(hf_pred.metrics)
    assert _untimed(pred.metrics) == pytest.approx(_untimed(hf_pred.metrics), rel=1e-5)
    np.testing.assert_array_equal(pred.predictions, hf_pred.predictions)
    np.testing.assert_array_equal(pred.label_ids, hf_pred.label_ids)
    assert pred.predictions.shape[1] == hf.model.generation_config.max_length  # (20: padded past max_length 8)


def test_generation_kwargs_reach_generate(tmp_path):
    """evaluate(max_length=, num_beams=) beats generation_max_length / generation_num_beams; without them the
    arguments' values are used; predict(**gen_kwargs) likewise; generate gets them (the same under both)."""
    seen = {}
    for framework in FRAMEWORKS:
        calls = []
        trainer, *_ = _summarization_script(framework, tmp_path / "run", 1, max_steps=1, eval_strategy="no")
        generate = trainer.model.generate

        def spy(*a, calls=calls, generate=generate, **kw):
            calls.append({k: kw[k] for k in ("max_length", "num_beams", "max_new_tokens") if k in kw})
            return generate(*a, **kw)

        trainer.model.generate = spy
        data = _preprocess(_tokenizer(), _documents(4, 2))
        trainer.evaluate(data)
        trainer.evaluate(data, max_length=5, num_beams=2)
        trainer.predict(data, max_new_tokens=3)
        seen[framework] = calls
    assert seen["ours"] == seen["hf"]
    assert seen["ours"][0] == {"max_length": 8, "num_beams": 1} and seen["ours"][1] == {"max_length": 5, "num_beams": 2}
    assert seen["ours"][-1] == {"max_new_tokens": 3, "num_beams": 1}


def test_generation_config_from_a_path_or_an_object(tmp_path):
    """generation_config (a folder, a file, or a GenerationConfig) replaces the model's, as in transformers."""
    GenerationConfig(max_length=7, num_beams=1, decoder_start_token_id=2).save_pretrained(tmp_path / "gen")
    for value in (str(tmp_path / "gen"), str(tmp_path / "gen" / "generation_config.json"),
                  GenerationConfig(max_length=7)):
        models = {}
        for framework, (trainer_cls, args_cls) in FRAMEWORKS.items():
            extra = {"use_cpu": True} if framework == "hf" else {}
            args = args_cls(output_dir=str(tmp_path / framework), report_to="none", generation_config=value, **extra)
            models[framework] = trainer_cls(model=_bart(_tokenizer()), args=args).model
        assert models["ours"].generation_config.max_length == models["hf"].generation_config.max_length == 7


def test_seq2seq_arguments_fields_to_dict_and_bad_values(tmp_path):
    ours = vlmtrain.Seq2SeqTrainingArguments(output_dir=str(tmp_path), generation_max_length=12,
                                             generation_num_beams=3, predict_with_generate=True,
                                             generation_config=GenerationConfig(max_length=9), sortish_sampler=True)
    hf = transformers.Seq2SeqTrainingArguments(output_dir=str(tmp_path), generation_max_length=12,
                                               generation_num_beams=3, predict_with_generate=True,
                                               generation_config=GenerationConfig(max_length=9), sortish_sampler=True)
    assert isinstance(ours, vlmtrain.TrainingArguments)
    names = ("sortish_sampler", "predict_with_generate", "generation_max_length", "generation_num_beams",
             "generation_config")
    mine, theirs = ours.to_dict(), hf.to_dict()
    for name in names:
        assert mine[name] == theirs[name], name
    assert mine["generation_config"]["max_length"] == 9  # a GenerationConfig becomes its dict
    json.loads(ours.to_json_string())
    # transformers fails at the first evaluation (num_beams 0: a ZeroDivisionError inside generate); vlmtrain
    # refuses it at construction, naming the argument
    for bad in ({"generation_num_beams": 0}, {"generation_max_length": 0}, {"generation_num_beams": -2}):
        name = next(iter(bad))
        with pytest.raises(ConfigError, match=name):
            vlmtrain.Seq2SeqTrainingArguments(output_dir=str(tmp_path), **bad)
    with pytest.raises(ZeroDivisionError):
        _summarization_script("hf", tmp_path / "bad", 0, max_steps=1, eval_strategy="no")


def test_without_predict_with_generate_evaluation_returns_logits(tmp_path):
    """predict_with_generate off: Seq2SeqTrainer evaluates as Trainer does (the loss, logits as predictions)."""
    outputs = {}
    for framework, (trainer_cls, args_cls) in FRAMEWORKS.items():
        tok = _tokenizer()
        extra = {"use_cpu": True} if framework == "hf" else {}
        args = args_cls(output_dir=str(tmp_path / framework), report_to="none", per_device_eval_batch_size=3,
                        **extra)  # (whole eval batches: see _summarization_script)
        data = _preprocess(tok, _documents(6, 3))
        model = _bart(tok)
        trainer = trainer_cls(model=model, args=args, processing_class=tok,
                              data_collator=transformers.DataCollatorForSeq2Seq(tok, model=model))
        outputs[framework] = trainer.predict(data)
    assert outputs["ours"].metrics["test_loss"] == pytest.approx(outputs["hf"].metrics["test_loss"], rel=1e-5)


def test_an_encoder_decoder_loss_counts_every_label():
    """Bart's loss averages over all its labels (unshifted, though its loss_type is the causal LM's): the
    Trainer weights it by that count across micro-batches and eval batches."""
    from vlmtrain.trainer.stats import num_items_of

    tok = _tokenizer()
    model = _bart(tok)
    batch = transformers.DataCollatorForSeq2Seq(tok, model=model)(_preprocess(tok, _documents(3, 4)))
    batch["labels"][0, -1] = -100
    outputs = model(**batch)
    count = vlmtrain.Trainer.parts.loss_targets
    assert float(num_items_of(outputs, model, dict(batch), count)) == int((batch["labels"] != -100).sum()) == 11


def test_migration_guide_lists_every_seq2seq_field_and_method():
    """docs/migrating.md's Seq2Seq rows (scripts/gen_migrating.py, current: tests/test_hf_arguments.py) cover every
    field and method transformers' Seq2Seq classes add, and vlmtrain's classes have each with its default."""
    import dataclasses

    from vlmtrain.compat.seq2seq import SEQ2SEQ_FIELDS, SEQ2SEQ_METHODS

    base = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    theirs = {f.name: f.default for f in dataclasses.fields(transformers.Seq2SeqTrainingArguments)
              if f.name not in base}
    ours = {f.name: f.default for f in dataclasses.fields(vlmtrain.Seq2SeqTrainingArguments)}
    assert set(SEQ2SEQ_FIELDS) == set(theirs) and all(ours[name] == theirs[name] for name in theirs)
    methods = {n for n, v in vars(transformers.Seq2SeqTrainer).items() if not n.startswith("_") and callable(
        getattr(v, "__func__", v))}
    assert set(SEQ2SEQ_METHODS) == methods and all(n in vars(vlmtrain.Seq2SeqTrainer) for n in methods)
    assert "missing" not in open(__file__.replace("tests/test_seq2seq_dropin.py", "docs/migrating.md")).read()


def test_t5_predict_with_generate_as_transformers(tmp_path):
    """Another encoder-decoder (T5, untrained): predict()'s generated ids, labels and loss as transformers'."""
    tok = _tokenizer()
    data = _preprocess(tok, _documents(6, 5))
    outputs = {}
    for framework, (trainer_cls, args_cls) in FRAMEWORKS.items():
        torch.manual_seed(0)
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=len(tok), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, dropout_rate=0.0,
            pad_token_id=0, eos_token_id=2, decoder_start_token_id=0))
        extra = {"use_cpu": True} if framework == "hf" else {}
        args = args_cls(output_dir=str(tmp_path / framework), report_to="none", per_device_eval_batch_size=3,
                        predict_with_generate=True, generation_num_beams=2, **extra)
        trainer = trainer_cls(model=model, args=args, processing_class=tok,
                              data_collator=transformers.DataCollatorForSeq2Seq(tok, model=model))
        outputs[framework] = trainer.predict(data, max_new_tokens=5, suppress_tokens=[0])  # (any generate kwarg)
    ours, hf = outputs["ours"], outputs["hf"]
    assert ours.predictions.shape == (6, 20) and (ours.predictions[:, 1:6] != 0).any()  # 5 new tokens, padded
    np.testing.assert_array_equal(ours.predictions, hf.predictions)
    np.testing.assert_array_equal(ours.label_ids, hf.label_ids)
    assert ours.metrics["test_loss"] == pytest.approx(hf.metrics["test_loss"], rel=1e-5)
