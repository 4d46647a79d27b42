"""vlmtrain's DPOTrainer / DPOConfig against TRL 1.16's on a tiny causal LM: the same per-step loss and
rewards/logps metrics, the same final weights, and the metrics in evaluation under TRL's names."""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

import vlmtrain
import vlmtrain.errors
from tests.optional_extras import requires
from tests.tiny import tiny_llama

WORDS = [f"w{i}" for i in range(40)] + ["user", "assistant"]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}assistant {% endif %}")
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")


def _tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer written out (no network); "</s>" splits off as a special token."""
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>", chat_template=TEMPLATE)


def _pairs(n: int, seed: int = 0, conversational: bool = False):
    """Pairs with prompts and answers of different lengths (some cut by max_length=14): plain text, or message
    lists rendered by the chat template."""
    from datasets import Dataset

    rng = random.Random(seed)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    rows = [{"prompt": words(2, 8), "chosen": " " + words(1, 6), "rejected": " " + words(1, 6)} for _ in range(n)]
    if conversational:
        rows = [{"prompt": [{"role": "user", "content": r["prompt"]}],
                 "chosen": [{"role": "assistant", "content": r["chosen"].strip()}],
                 "rejected": [{"role": "assistant", "content": r["rejected"].strip()}]} for r in rows]
    return Dataset.from_list(rows)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama(vocab_size=len(SPECIALS) + len(WORDS), pad_token_id=0, eos_token_id=3).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


def _run(framework: str, model_dir, out, loss_type: str, beta: float, conversational: bool):
    if framework == "trl":
        import trl

        config_class, trainer_class = trl.DPOConfig, trl.DPOTrainer
    else:
        config_class, trainer_class = vlmtrain.DPOConfig, vlmtrain.DPOTrainer
    args = config_class(str(out), loss_type=loss_type, beta=beta, max_length=14, per_device_train_batch_size=4,
                        per_device_eval_batch_size=4, num_train_epochs=1, learning_rate=3e-3, weight_decay=0.1,
                        logging_steps=1, seed=7, bf16=False, gradient_checkpointing=False, report_to="none",
                        save_strategy="no", train_sampling_strategy="sequential", use_cpu=True,
                        dataloader_num_workers=0, eval_strategy="no", disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = trainer_class(model=model, args=args, train_dataset=_pairs(40, 0, conversational),
                            eval_dataset=_pairs(8, 1, conversational),
                            processing_class=_tokenizer())
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    metrics = trainer.evaluate()
    if framework == "ours":  # the policy as a script saves it: loadable with from_pretrained, no reference inside
        trainer.save_model(str(out / "final"))
        model = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32)
    return metrics, model, logs


@requires("trl", "dev")
@pytest.mark.parametrize("loss_type,beta,conversational", [("sigmoid", 0.1, False), ("ipo", 0.5, False),
                                                          ("hinge", 0.3, False), ("sigmoid", 0.1, True)],
                         ids=["sigmoid", "ipo", "hinge", "sigmoid-conversational"])
def test_dpo_equals_trl(model_dir, tmp_path, loss_type, beta, conversational):
    """Per-step loss and metrics, final weights (ours as save_model wrote them), and the evaluation's metrics
    after training (eval_ prefixed)."""
    trl_eval, trl_model, trl_logs = _run("trl", model_dir, tmp_path / "trl", loss_type, beta, conversational)
    our_eval, our_model, our_logs = _run("ours", model_dir, tmp_path / "ours", loss_type, beta, conversational)
    assert len(trl_logs) == len(our_logs) == 10
    for step, (theirs, ours) in enumerate(zip(trl_logs, our_logs), 1):
        for key in METRICS:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (step, key)
    assert trl_logs[-1]["rewards/margins"] != pytest.approx(0.0, abs=1e-4)  # (the policy moved off its reference)
    for key in METRICS:
        assert our_eval[f"eval_{key}"] == pytest.approx(trl_eval[f"eval_{key}"], rel=1e-4, abs=1e-6), key
    assert our_eval["eval_rewards/accuracies"] > 0  # (the trained policy tells some held-out pairs apart)
    theirs = dict(trl_model.named_parameters())
    for name, ours in our_model.named_parameters():
        torch.testing.assert_close(ours, theirs[name], rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("option,value", [("precompute_ref_log_probs", True), ("loss_type", "robust"),
                                          ("truncation_mode", "keep_middle")])
def test_dpo_config_refuses_what_is_not_implemented(tmp_path, option, value):
    """One clear error naming the option when the arguments are built, before any model loads."""
    with pytest.raises(vlmtrain.errors.ConfigError, match=option):
        vlmtrain.DPOConfig(str(tmp_path), **{option: value})


def test_dpo_resume_is_refused_and_a_path_is_a_model(model_dir, tmp_path):
    """A model given as a path (its tokenizer loaded from it); resuming a DPO run is one clear error, not a
    checkpoint loaded wrongly."""
    args = vlmtrain.DPOConfig(str(tmp_path), max_steps=1, per_device_train_batch_size=2, save_strategy="steps",
                              save_steps=1, report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
                              disable_tqdm=True)
    vlmtrain.DPOTrainer(model=str(model_dir), args=args, train_dataset=_pairs(4)).train()
    trainer = vlmtrain.DPOTrainer(model=str(model_dir), args=args, train_dataset=_pairs(4))
    with pytest.raises(vlmtrain.errors.ConfigError, match="resume_from_checkpoint"):
        trainer.train(resume_from_checkpoint=True)
