"""vlmtrain's DPOTrainer / DPOConfig against TRL 1.16's on a tiny causal LM: the same per-step loss and
rewards/logps metrics, the same final weights, and the metrics in evaluation under TRL's names (also with
precomputed reference log-probs); a resumed DPO run equals the uninterrupted one; bad pairs are errors or
counted skips."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

import vlmtrain
import vlmtrain.errors
from tests.optional_extras import requires
from tests.tiny import tiny_llama
from vlmtrain.models.objectives.dpo import DPOObjective

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


def _run(framework: str, model_dir, out, loss_type: str | list[str], beta: float, conversational: bool, precompute: bool = False,
         padding_free: bool = False):
    if framework == "trl":
        import trl

        config_class, trainer_class = trl.DPOConfig, trl.DPOTrainer
    else:
        config_class, trainer_class = vlmtrain.DPOConfig, vlmtrain.DPOTrainer
    args = config_class(str(out), loss_type=loss_type, beta=beta, max_length=14, per_device_train_batch_size=4,
                        per_device_eval_batch_size=4, num_train_epochs=1, learning_rate=3e-3, weight_decay=0.1,
                        logging_steps=1, seed=7, bf16=False, gradient_checkpointing=False, report_to="none",
                        save_strategy="no", train_sampling_strategy="sequential", use_cpu=True,
                        dataloader_num_workers=0, eval_strategy="no", disable_tqdm=True,
                        precompute_ref_log_probs=precompute, padding_free=padding_free)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = trainer_class(model=model, args=args, train_dataset=_pairs(40, 0, conversational),
                            eval_dataset=_pairs(8, 1, conversational),
                            processing_class=_tokenizer())
    if framework == "ours" and padding_free:  # (TRL 1.16 warns and pads; ours packs each batch into one row)
        assert trainer.data_collator([trainer.train_dataset[i] for i in range(4)])["input_ids"].shape[0] == 1
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    metrics = trainer.evaluate()
    if framework == "ours":  # the policy as a script saves it: loadable with from_pretrained, no reference inside
        trainer.save_model(str(out / "final"))
        model = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32)
    return metrics, model, logs


@requires("trl", "dev")
@pytest.mark.parametrize("loss_type,beta,conversational,precompute,padding_free",
                         [("sigmoid", 0.1, False, False, False), ("ipo", 0.5, False, False, False),
                          ("hinge", 0.3, False, False, False), ("sigmoid", 0.1, True, False, False),
                          ("sigmoid", 0.1, False, True, False), ("ipo", 0.5, True, True, True),
                          (["sigmoid", "sft"], 0.1, False, False, True)],
                         ids=["sigmoid", "ipo", "hinge", "sigmoid-conversational", "sigmoid-precompute_ref_log_probs",
                              "ipo-conversational-precompute-padding_free", "sigmoid+sft-padding_free"])
def test_dpo_equals_trl(model_dir, tmp_path, loss_type, beta, conversational, precompute, padding_free):
    """Per-step loss and metrics, final weights (ours as save_model wrote them), and the evaluation's metrics
    after training (eval_ prefixed); with precompute_ref_log_probs the reference's log-probs of the train and eval
    pairs come from one pass before training (TRL's too); with padding_free ours packs each batch's sequences
    into one row (TRL 1.16 pads)."""
    trl_eval, trl_model, trl_logs = _run("trl", model_dir, tmp_path / "trl", loss_type, beta, conversational,
                                         precompute, padding_free)
    our_eval, our_model, our_logs = _run("ours", model_dir, tmp_path / "ours", loss_type, beta, conversational,
                                         precompute, padding_free)
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


@pytest.mark.parametrize("option,value", [("loss_type", "robust"), ("truncation_mode", "keep_middle")])
def test_dpo_config_refuses_what_is_not_implemented(tmp_path, option, value):
    """One clear error naming the option when the arguments are built, before any model loads."""
    with pytest.raises(vlmtrain.errors.ConfigError, match=option):
        vlmtrain.DPOConfig(str(tmp_path), **{option: value})


@contextlib.contextmanager
def reference_calls() -> Iterator[list[int]]:
    """While active, each call of DPOObjective.reference_logps (the reference's forward) appends to the list."""
    calls: list[int] = []
    original = DPOObjective.reference_logps

    def counted(self, *a, **kw):
        calls.append(1)
        return original(self, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DPOObjective, "reference_logps", counted)
        yield calls


def _resume_run(model_dir, out, scenario: str, resume: str | None = None):
    """A DPO run on 16 shuffled pairs, batch 2 (8 steps), a checkpoint every 3 steps: ``scenario`` full (a frozen
    copy as reference), lora (peft_config: LoRA-off) or precompute (precompute_ref_log_probs); resumed from
    ``resume`` with the original model, as a transformers script resumes. Returns (per-step logs, the trainer,
    the reference's calls: DPOObjective.reference_logps, counted)."""
    from peft import LoraConfig

    args = vlmtrain.DPOConfig(str(out), max_length=14, per_device_train_batch_size=2, per_device_eval_batch_size=4,
                              num_train_epochs=1, learning_rate=3e-3, weight_decay=0.1, logging_steps=1, seed=7,
                              bf16=False, gradient_checkpointing=False, report_to="none", save_strategy="steps",
                              save_steps=3, use_cpu=True, disable_tqdm=True,
                              precompute_ref_log_probs=scenario == "precompute")
    with reference_calls() as calls:
        trainer = vlmtrain.DPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args=args,
            train_dataset=_pairs(16, 3), eval_dataset=_pairs(4, 4), processing_class=_tokenizer(),
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if scenario == "lora" else None)
        trainer.train(resume_from_checkpoint=resume)
    return [e for e in trainer.state.log_history if "loss" in e], trainer, len(calls)


@pytest.fixture(scope="module")
def full_run(model_dir, tmp_path_factory):
    """The uninterrupted full fine-tune, with its checkpoints (shared by the resume tests)."""
    return _resume_run(model_dir, tmp_path_factory.mktemp("full"), "full")


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}


@requires("peft", "lora")
@pytest.mark.parametrize("scenario", ["full", "lora", "precompute"])
def test_dpo_resume_equals_the_uninterrupted_run(model_dir, tmp_path, full_run, scenario):
    """Resumed from the run's checkpoint-3 by a new DPOTrainer given the original model: steps 4-8's
    losses and the final weights are the uninterrupted run's (policy, optimizer, scheduler, RNG and data position
    from the checkpoint; the reference rebuilt as at the start, or its precomputed log-probs read from the
    checkpoint, not recomputed: the reference never runs after the pass before training). The checkpoint's model
    files are the policy alone."""
    logs, trainer, first_calls = full_run if scenario == "full" else _resume_run(model_dir, tmp_path / "run", scenario)
    assert len(logs) == 8
    checkpoint = trainer.args.output_dir + "/checkpoint-3"
    resumed_logs, resumed, calls = _resume_run(model_dir, tmp_path / "resumed", scenario, resume=checkpoint)
    assert [e["step"] for e in resumed_logs] == list(range(1, 9))  # (steps 1-3 from the checkpoint's state)
    for theirs, ours in zip(logs[3:], resumed_logs[3:]):
        for key in ("loss", "rewards/margins", "logps/chosen"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-7), (ours["step"], key)
    expected = _weights(trainer)
    for name, value in _weights(resumed).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    if scenario == "lora":
        assert "model.safetensors" not in os.listdir(checkpoint)  # the adapter alone, in peft's layout
        assert os.path.isfile(os.path.join(checkpoint, "adapter_model.safetensors"))
    else:  # the policy alone, loadable with from_pretrained
        saved = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        assert saved.state_dict().keys() == full_run[1].policy.state_dict().keys()
    if scenario == "precompute":  # one pass before training (8 batches of train pairs, 1 of eval pairs), then none
        assert first_calls == 8 + 1 and "ref_chosen_logps" in trainer.train_dataset.column_names
        assert calls == 0  # read from checkpoint-3: the reference did not run again
        assert trainer.ref_model is None and resumed.ref_model is None  # (a full fine-tune keeps no second copy)
        for theirs, ours in zip(full_run[0], logs):  # equal to the run whose reference runs beside the policy
            assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5), ours["step"]
        for name, value in _weights(trainer).items():
            torch.testing.assert_close(value, _weights(full_run[1])[name], rtol=1e-5, atol=1e-6)


def test_dpo_model_as_a_path(model_dir, tmp_path):
    """A model given as a path (its tokenizer loaded from it)."""
    args = vlmtrain.DPOConfig(str(tmp_path), max_steps=1, per_device_train_batch_size=2, save_strategy="no",
                              report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
                              disable_tqdm=True)
    trainer = vlmtrain.DPOTrainer(model=str(model_dir), args=args, train_dataset=_pairs(4))
    assert trainer.train().global_step == 1


def _trainer(model_dir, out, train_dataset, **config):
    args = vlmtrain.DPOConfig(str(out), per_device_train_batch_size=2, report_to="none", use_cpu=True, bf16=False,
                              gradient_checkpointing=False, disable_tqdm=True, save_strategy="no", **config)
    return vlmtrain.DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args=args,
                               train_dataset=train_dataset, processing_class=_tokenizer())


def test_dpo_a_pair_without_an_answer_is_an_error_naming_it(model_dir, tmp_path):
    """Which pair (its index and id) and the keys it has, before training."""
    from datasets import Dataset

    rows = [{"id": f"p{i}", "prompt": "w1 w2", "chosen": " w3", "rejected": " w4"} for i in range(4)]
    rows[2]["rejected"] = None
    with pytest.raises(vlmtrain.errors.ConfigError,
                       match=r"pair 2 \(id 'p2'\) has no 'rejected' \(its keys: \['chosen', 'id', 'prompt'\]\)"):
        _trainer(model_dir, tmp_path, Dataset.from_list(rows))
    del rows[1]["chosen"]
    with pytest.raises(vlmtrain.errors.ConfigError, match=r"pair 1 \(id 'p1'\) has no 'chosen'"):
        _trainer(model_dir, tmp_path, rows)  # (a list of dicts too)


@pytest.mark.parametrize("truncation_mode,kept", [("keep_start", 3), ("keep_end", 5)])
def test_dpo_pairs_that_cannot_train_are_skipped_counted(model_dir, tmp_path, truncation_mode, kept):
    """Identical chosen and rejected (also when max_length cuts them to the same tokens) and, under keep_start, a
    prompt that fills max_length: skipped, counted in one warning. keep_end keeps the long prompt's pair: its
    answer is the end of the row, so it keeps answer tokens."""
    long_prompt = " ".join(["w1"] * 12)
    rows = [{"prompt": "w1 w2", "chosen": " w3 w4", "rejected": " w5"},
            {"prompt": "w1 w2", "chosen": " w3", "rejected": " w3"},  # identical
            {"prompt": "w1 w2 w3 w4 w5 w6 w7", "chosen": " w8 w9", "rejected": " w8 w5"},  # the same within 8 tokens
            {"prompt": long_prompt, "chosen": " w2", "rejected": " w3"},  # 12 prompt tokens
            {"prompt": "w6", "chosen": " w7", "rejected": " w8 w9"},
            {"prompt": "w6 w7", "chosen": " w7", "rejected": " w9"}]
    with pytest.warns(UserWarning, match=r"DPO: \d of 6 train pairs skipped") as caught:
        trainer = _trainer(model_dir, tmp_path, rows, max_length=8, truncation_mode=truncation_mode)
    message = str(next(w.message for w in caught if "DPO:" in str(w.message)))
    assert len(trainer.train_dataset) == kept
    if truncation_mode == "keep_start":
        assert "3 of 6" in message and "2 whose chosen and rejected are the same" in message
        assert "1 whose prompt fills max_length=8" in message
    else:  # keep_end cuts the start: row 2's answers differ in what is kept; the long prompt (now row 2) keeps
        # its answer
        assert "1 of 6" in message and "fills" not in message
        batch = trainer.data_collator([trainer.train_dataset[2]])
        assert batch["completion_mask"].sum(dim=1).tolist() == [2, 2]  # (" w2" + "</s>", " w3" + "</s>")


def test_dpo_precompute_refuses_a_stream_before_the_model_loads(tmp_path):
    """A stream has no pairs to attach the log-probs to: one error, before the model (a path that does not exist)
    would load."""
    args = vlmtrain.DPOConfig(str(tmp_path), precompute_ref_log_probs=True, report_to="none", use_cpu=True)
    with pytest.raises(vlmtrain.errors.ConfigError, match="precompute_ref_log_probs=True is not supported with an "
                                                          "IterableDataset"):
        vlmtrain.DPOTrainer(model=str(tmp_path / "no-model"), args=args,
                            train_dataset=_pairs(4).to_iterable_dataset())


@requires("trl", "dev")
@requires("peft", "lora")
def test_dpo_ref_model_with_peft_config_is_the_reference_as_in_trl(model_dir, tmp_path):
    """ref_model given together with peft_config: TRL 1.16 takes ref_model as the reference (no warning), not
    the LoRA-off base; so does vlmtrain. Evaluated before training the rewards are then the policy's (= the
    base's) log-ratio to that other model: nonzero, and equal to TRL's."""
    import trl
    from peft import LoraConfig

    metrics = {}
    for name, (config_class, trainer_class) in {"trl": (trl.DPOConfig, trl.DPOTrainer),
                                                "ours": (vlmtrain.DPOConfig, vlmtrain.DPOTrainer)}.items():
        args = config_class(str(tmp_path / name), per_device_eval_batch_size=4, bf16=False, report_to="none",
                            use_cpu=True, gradient_checkpointing=False, disable_tqdm=True, max_length=14)
        ref_model = tiny_llama(seed=5, vocab_size=len(SPECIALS) + len(WORDS), pad_token_id=0, eos_token_id=3)
        trainer = trainer_class(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                ref_model=ref_model, args=args, train_dataset=_pairs(4), eval_dataset=_pairs(8, 1),
                                processing_class=_tokenizer(), peft_config=LoraConfig(r=4, target_modules=["q_proj"]))
        assert trainer.ref_model is ref_model
        metrics[name] = trainer.evaluate()
    assert abs(metrics["ours"]["eval_rewards/chosen"]) > 1e-3  # (LoRA-off as the reference: exactly 0)
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "loss"):
        assert metrics["ours"][f"eval_{key}"] == pytest.approx(metrics["trl"][f"eval_{key}"], rel=1e-4), key


def test_dpo_precompute_evaluates_a_new_dataset_only_while_the_policy_is_its_reference(model_dir, tmp_path):
    """precompute_ref_log_probs on a full fine-tune without ref_model: a dataset given to evaluate() gets its
    reference log-probs from the policy before training (rewards exactly 0: the policy is its own reference);
    after a step the policy no longer is the reference: one clear error, as TRL's."""
    trainer = _trainer(model_dir, tmp_path, _pairs(4), precompute_ref_log_probs=True, max_steps=1,
                       learning_rate=1e-2)
    assert trainer.evaluate(_pairs(4, 5))["eval_rewards/margins"] == 0.0
    trainer.train()
    with pytest.raises(vlmtrain.errors.ConfigError, match="precompute_ref_log_probs: the eval pairs have no "
                                                          "reference log-probs"):
        trainer.evaluate(_pairs(4, 5))
