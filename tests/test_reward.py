"""vlmtrain's RewardTrainer / RewardConfig against TRL 1.16's on a tiny Llama sequence-classification model: the
same per-step loss and metrics, the same final weights, the same evaluation metrics (with a per-pair margin
column and center_rewards_coefficient in one case)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

import vlmtrain
import vlmtrain.errors
from tests.optional_extras import requires
from tests.test_dpo import SPECIALS, WORDS, _tokenizer

METRICS = ("loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens")


def _pairs(n: int, seed: int, layout: str, margin: bool = False, longest: int = 8):
    """Reward pairs of different lengths: ``implicit`` (chosen / rejected hold the whole text), ``explicit``
    (a prompt column), ``conversational`` (message lists, explicit prompt); with ``longest=8`` some are longer
    than max_length=16 (dropped), with 4 none (evaluation batches of equal size: TRL averages per batch)."""
    from datasets import Dataset

    rng = random.Random(seed)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS[:40]) for _ in range(rng.randint(lo, hi)))

    rows = []
    for _ in range(n):
        prompt, chosen, rejected = words(2, longest), words(1, longest - 1), words(1, longest - 1)
        if layout == "implicit":
            row = {"chosen": f"{prompt} {chosen}", "rejected": f"{prompt} {rejected}"}
        elif layout == "explicit":
            row = {"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected}
        else:
            row = {"prompt": [{"role": "user", "content": prompt}],
                   "chosen": [{"role": "assistant", "content": chosen}],
                   "rejected": [{"role": "assistant", "content": rejected}]}
        if margin:
            row["margin"] = round(rng.uniform(0.0, 2.0), 3)
        rows.append(row)
    return Dataset.from_list(rows)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama with a 1-output score head, saved (both trainers load the same head)."""
    path = tmp_path_factory.mktemp("tiny_llama_rm")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(SPECIALS) + len(WORDS), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=0, eos_token_id=3, num_labels=1)
    LlamaForSequenceClassification(config).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


def _run(framework: str, model_dir, out, layout: str, margin: bool, center: float | None, as_path: bool):
    if framework == "trl":
        import trl

        config_class, trainer_class = trl.RewardConfig, trl.RewardTrainer
    else:
        config_class, trainer_class = vlmtrain.RewardConfig, vlmtrain.RewardTrainer
    args = config_class(str(out), center_rewards_coefficient=center, max_length=16, per_device_train_batch_size=4,
                        per_device_eval_batch_size=4, num_train_epochs=1, learning_rate=3e-3, weight_decay=0.1,
                        logging_steps=1, seed=7, bf16=False, gradient_checkpointing=False, report_to="none",
                        save_strategy="no", train_sampling_strategy="sequential", use_cpu=True,
                        dataloader_num_workers=0, eval_strategy="no", disable_tqdm=True)
    model = str(model_dir) if as_path else AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32)
    trainer = trainer_class(model=model, args=args, train_dataset=_pairs(48, 0, layout, margin),
                            eval_dataset=_pairs(8, 1, layout, margin, longest=4), processing_class=_tokenizer())
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    metrics = trainer.evaluate()
    if framework == "ours":  # the model as a script saves it: loadable with from_pretrained
        trainer.save_model(str(out / "final"))
        model = AutoModelForSequenceClassification.from_pretrained(out / "final", dtype=torch.float32)
    return metrics, trainer.model if framework == "trl" else model, logs


@requires("trl", "dev")
@pytest.mark.parametrize("layout,margin,center,as_path", [
    ("implicit", False, None, False), ("explicit", True, 0.01, True), ("conversational", True, None, False)],
    ids=["implicit", "explicit-margin-center-path", "conversational-margin"])
def test_reward_trainer_equals_trl(model_dir, tmp_path, layout, margin, center, as_path):
    """Per-step loss and metrics, final weights (ours as save_model wrote them), and the evaluation's metrics
    after training (eval_ prefixed), AdamW with weight decay, fp32."""
    trl_eval, trl_model, trl_logs = _run("trl", model_dir, tmp_path / "trl", layout, margin, center, as_path)
    our_eval, our_model, our_logs = _run("ours", model_dir, tmp_path / "ours", layout, margin, center, as_path)
    assert len(trl_logs) == len(our_logs) >= 10
    for step, (theirs, ours) in enumerate(zip(trl_logs, our_logs), 1):
        for key in METRICS:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (step, key)
    initial = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    assert not torch.allclose(initial.score.weight, trl_model.score.weight, atol=1e-3)  # (training moved it)
    for key in METRICS:
        assert our_eval[f"eval_{key}"] == pytest.approx(trl_eval[f"eval_{key}"], rel=1e-4, abs=1e-6), key
    theirs = dict(trl_model.named_parameters())
    for name, ours in our_model.named_parameters():
        torch.testing.assert_close(ours, theirs[name], rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_reward_trainer_refuses_a_model_with_several_outputs(model_dir, tmp_path):
    """As TRL: a model object whose score head has num_labels != 1 is one clear error naming num_labels."""
    model = LlamaForSequenceClassification(LlamaConfig.from_pretrained(model_dir, num_labels=2))
    args = vlmtrain.RewardConfig(str(tmp_path), report_to="none", use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="num_labels"):
        vlmtrain.RewardTrainer(model=model, args=args, train_dataset=_pairs(4, 0, "implicit"),
                               processing_class=_tokenizer())


@pytest.mark.parametrize("option,value", [("pad_to_multiple_of", 8), ("activation_offloading", True),
                                          ("chat_template_path", "Qwen/Qwen3-0.6B")])
def test_reward_config_refuses_what_is_not_available(tmp_path, option, value):
    """One clear error naming the option when the arguments are built, before any model loads."""
    with pytest.raises(vlmtrain.errors.ConfigError, match=option):
        vlmtrain.RewardConfig(str(tmp_path), **{option: value})


@pytest.mark.parametrize("vision", [False, True], ids=["text", "vlm"])
def test_reward_trainer_resume_equals_the_uninterrupted_run(model_dir, tiny_hub, tmp_path, vision):
    """trainer.train(resume_from_checkpoint=...) from step 2 of 4, the trainer built as the first was: steps 3-4
    log the uninterrupted run's metrics (num_tokens too: counted on from the checkpoint) and end at its weights
    (1e-6; AdamW with weight decay), for a sequence-classification model and a Hub VLM with a reward head."""
    from transformers import AutoModelForImageTextToText

    from tests.test_reward_head import _color_pairs

    def trainer(out):
        args = vlmtrain.RewardConfig(str(out), per_device_train_batch_size=2, max_steps=4, save_strategy="steps",
                                     save_steps=2, logging_steps=1, learning_rate=3e-3, weight_decay=0.1, seed=7,
                                     bf16=False, gradient_checkpointing=False, report_to="none", use_cpu=True,
                                     dataloader_num_workers=0, disable_tqdm=True)
        if vision:
            _, path, processor = tiny_hub("qwen3_vl")
            model, pairs = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32), _color_pairs()
        else:
            model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
            pairs, processor = _pairs(12, 0, "explicit", margin=True), _tokenizer()
        return vlmtrain.RewardTrainer(model=model, args=args, train_dataset=pairs, processing_class=processor)

    full, resumed = trainer(tmp_path / "full"), trainer(tmp_path / "resumed")
    full.train()
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    logs = {name: [e for e in t.state.log_history if "loss" in e] for name, t in (("full", full),
                                                                                   ("resumed", resumed))}
    assert [e["step"] for e in logs["resumed"]] == [1, 2, 3, 4]  # (steps 1-2: the checkpoint's log history)
    keys = ("loss", "loss_reward", "num_tokens") if vision else METRICS
    for mine, theirs in zip(logs["resumed"][2:], logs["full"][2:]):
        for key in keys:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-8), (mine["step"], key)
    weights = dict(full.model.named_parameters())
    for name, weight in resumed.model.named_parameters():
        torch.testing.assert_close(weight, weights[name], rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
