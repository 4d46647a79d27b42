"""vlmtrain.GRPOTrainer equals TRL 1.16's GRPOTrainer on a tiny causal LM given the same completions (a rollout
that both sides share: TRL's ``rollout_func``, vlmtrain's ``generator``), and refuses bad input clearly."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

import vlmtrain
from tests.optional_extras import requires
from tests.test_dpo import SPECIALS, WORDS, _tokenizer
from tests.tiny import tiny_llama
from vlmtrain.errors import ConfigError

EOS, VOCAB = 3, len(SPECIALS) + len(WORDS)


def _prompts(n: int = 12, seed: int = 0, conversational: bool = False):
    from datasets import Dataset

    rng = random.Random(seed)
    rows = [{"prompt": " ".join(rng.choice(WORDS[:40]) for _ in range(rng.randint(2, 6))),
             "target": f"w{rng.randint(0, 9)}"} for _ in range(n)]
    if conversational:
        rows = [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows]
    return Dataset.from_list(rows)


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


class FixedCompletions:
    """Deterministic completions per call and row (some end with EOS, others run to the limit)."""

    def __init__(self, limit: int) -> None:
        self.calls, self.limit = 0, limit

    def completions(self, count: int) -> list[list[int]]:
        rng = random.Random(self.calls)
        self.calls += 1
        rows = []
        for _ in range(count):
            n = rng.randint(1, self.limit)
            row = [rng.randrange(4, 4 + 12) for _ in range(n)]
            if n < self.limit and rng.random() < 0.7:
                row[-1] = EOS
            rows.append(row)
        return rows

    def __call__(self, model, prompt_ids):  # vlmtrain's Generator
        return self.completions(len(prompt_ids))

    def trl(self, prompts, trainer):  # TRL's rollout_func
        tok = trainer.processing_class
        ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
               for p in prompts] if isinstance(prompts[0], list) else tok(text=prompts)["input_ids"]
        return {"prompt_ids": ids, "completion_ids": self.completions(len(prompts)), "logprobs": None}


COMPLETION_TYPES: set[type] = set()  # what length_reward was given (messages for conversational prompts)


def length_reward(completions, **kwargs):
    COMPLETION_TYPES.add(type(completions[0]))
    return [float(len(_text(c).split()) % 3) for c in completions]


def target_reward(completions, target, **kwargs):
    return [1.0 if t in _text(c).split() else 0.0 for c, t in zip(completions, target, strict=True)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_grpo")
    tiny_llama(vocab_size=VOCAB, pad_token_id=0, eos_token_id=EOS).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


def _config(cls, out, **kw):
    base = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=6, max_steps=4,
                learning_rate=1e-3, weight_decay=0.1, logging_steps=1, seed=7, bf16=False,
                gradient_checkpointing=False, report_to="none", save_strategy="no", use_cpu=True,
                dataloader_num_workers=0, disable_tqdm=True, reward_weights=[1.0, 0.5])
    return cls(str(out), **{**base, **kw})


def _run(framework: str, model_dir, out, conversational: bool = False, peft_config=None, funcs=None,
         reward_processing_classes=None, iterable: bool = False, **kw):
    rollout = FixedCompletions(6)
    funcs = funcs(framework) if funcs else [length_reward, target_reward]
    rpc = dict(reward_processing_classes=reward_processing_classes) if reward_processing_classes else {}
    prompts = _prompts(conversational=conversational)
    prompts = prompts.to_iterable_dataset() if iterable else prompts  # (a stream: tests/test_grpo_stream.py)
    if framework == "trl":
        import trl

        trainer = trl.GRPOTrainer(model=str(model_dir), reward_funcs=funcs, args=_config(trl.GRPOConfig, out, **kw),
                                  train_dataset=prompts, processing_class=_tokenizer(),
                                  rollout_func=rollout.trl, peft_config=peft_config, **rpc)
    else:
        trainer = vlmtrain.GRPOTrainer(model=str(model_dir), reward_funcs=funcs,
                                       args=_config(vlmtrain.GRPOConfig, out, **kw),
                                       train_dataset=prompts,
                                       processing_class=_tokenizer(), generator=rollout, peft_config=peft_config, **rpc)
    trainer.train()
    policy = trainer.model if framework == "trl" else trainer.policy
    return [e for e in trainer.state.log_history if "loss" in e], {k: v.detach().clone() for k, v in
                                                                   policy.state_dict().items()}


CASES = [("dapo", 0.0, 1, 1, False), ("grpo", 0.0, 2, 1, False), ("dr_grpo", 0.0, 1, 1, True),
         ("dapo", 0.1, 2, 1, False), ("grpo", 0.1, 1, 1, True), ("dr_grpo", 0.1, 2, 1, False),
         ("dapo", 0.0, 1, 2, False), ("grpo", 0.0, 1, 2, False),
         # steps_per_generation != gradient_accumulation_steps: a generation batch feeds several optimizer steps
         ("dapo", 0.1, 1, 1, False, 2), ("dapo", 0.0, 2, 2, False, 4), ("grpo", 0.0, 1, 1, False, 2)]


@requires("trl", "dev")
@pytest.mark.parametrize("loss_type,beta,num_iterations,accum,conversational,spg",
                         [(*case, None)[:6] for case in CASES],
                         ids=[f"{t}-beta{b}-mu{m}-accum{a}" + ("-conversational" if c else "")
                              + (f"-spg{rest[0]}" if rest else "") for t, b, m, a, c, *rest in CASES])
def test_grpo_equals_trl(model_dir, tmp_path, monkeypatch, loss_type, beta, num_iterations, accum, conversational, spg):
    """(With 2 accumulation steps TRL shuffles the generation batch before splitting it: each micro-batch's loss
    differs, the step's loss and weights do not.) ``spg``: steps_per_generation (default: the accumulation
    steps), the generation batch 8 rows either way."""
    if spg is not None:  # (TRL also shuffles a generation batch's rows before splitting it into the steps it
        # feeds; vlmtrain keeps them in order, each group's rows together: compared with TRL's order kept too)
        import trl.trainer.grpo_trainer

        monkeypatch.setattr(trl.trainer.grpo_trainer, "shuffle_sequence_dict", lambda batch: batch)
    spg = spg or accum
    kw = dict(loss_type=loss_type, beta=beta, num_iterations=num_iterations, gradient_accumulation_steps=accum,
              per_device_train_batch_size=8 // spg, steps_per_generation=spg)
    trl_logs, trl_weights = _run("trl", model_dir, tmp_path / "trl", conversational, **kw)
    COMPLETION_TYPES.clear()
    logs, weights = _run("ours", model_dir, tmp_path / "ours", conversational, **kw)
    assert COMPLETION_TYPES == {list if conversational else str}
    assert len(logs) == len(trl_logs) == 4
    keys = ["loss", "reward", "reward_std", "rewards/length_reward/mean", "rewards/target_reward/mean",
            "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio", "clip_ratio/region_mean",
            "entropy"] + (["kl"] if beta else [])
    for ours, theirs in zip(logs, trl_logs, strict=True):
        for key in keys:
            assert (key in ours) == (key in theirs), (key, ours["step"])  # (rollout metrics: steps that generate)
            if key not in theirs:
                continue
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (key, ours["step"])
    for name, value in trl_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    first = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert any(not torch.equal(first[k], weights[k]) for k in first)  # (it trained)


@requires("trl", "dev")
def test_grpo_lora_reference_is_the_policy_without_adapters_as_in_trl(model_dir, tmp_path):
    """With peft_config and beta > 0 no copy is made: the reference is the policy with its adapters off."""
    from peft import LoraConfig

    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    kw = dict(loss_type="dapo", beta=0.1, num_iterations=2, max_steps=3, learning_rate=1e-2)
    trl_logs, trl_weights = _run("trl", model_dir, tmp_path / "trl", peft_config=LoraConfig(**lora), **kw)
    logs, weights = _run("ours", model_dir, tmp_path / "ours", peft_config=LoraConfig(**lora), **kw)
    assert logs[-1]["kl"] > 0
    for ours, theirs in zip(logs, trl_logs, strict=True):
        for key in ("loss", "kl", "entropy"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (key, ours["step"])
    assert any("lora_A" in k for k in trl_weights)
    for name, value in trl_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A tiny random-init sequence-classification model with one label and its tokenizer, saved (TRL loads such a
    reward_funcs entry with AutoModelForSequenceClassification, num_labels=1)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    path = tmp_path_factory.mktemp("tiny_rm") / "tiny-rm"
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_labels=1,
                         attention_dropout=0.1,  # (scored in eval mode, as TRL: no dropout)
                         pad_token_id=0)
    LlamaForSequenceClassification(config).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


@requires("trl", "dev")
@pytest.mark.parametrize("mixed,conversational", [(False, False), (True, True)], ids=["alone-path", "mixed-module"])
def test_grpo_with_a_reward_model_equals_trl(model_dir, reward_model_dir, tmp_path, mixed, conversational):
    """A sequence-classification reward model in reward_funcs, as TRL scores it (prompt + completion, the chat
    template for messages, right padding, its logit; named after its path): alone as a path, or as a model object
    with its reward_processing_classes tokenizer beside a weighted function: rewards, loss, metrics and final
    weights equal TRL's GRPOTrainer's. (The model object is given to vlmtrain in training mode: it scores in eval
    mode, without its dropout, as TRL's from_pretrained model does.)"""
    from transformers import AutoModelForSequenceClassification

    def funcs(framework):
        if not mixed:
            return [str(reward_model_dir)]
        model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir)  # (eval mode, for TRL)
        return [model.train() if framework == "ours" else model, length_reward]  # (ours: put in eval mode)

    kw = dict(loss_type="grpo", beta=0.1, max_steps=2, reward_weights=[1.0, 0.5] if mixed else None, funcs=funcs,
              reward_processing_classes=[_tokenizer(), None] if mixed else None)
    trl_logs, trl_weights = _run("trl", model_dir, tmp_path / "trl", conversational, **kw)
    logs, weights = _run("ours", model_dir, tmp_path / "ours", conversational, **kw)
    keys = ["loss", "reward", "reward_std", "rewards/tiny-rm/mean", "rewards/tiny-rm/std", "frac_reward_zero_std",
            "kl", "entropy"] + (["rewards/length_reward/mean"] if mixed else [])
    assert len(logs) == len(trl_logs) == 2
    for ours, theirs in zip(logs, trl_logs, strict=True):
        for key in keys:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (key, ours["step"])
    assert logs[0]["rewards/tiny-rm/std"] > 0  # (the model scores the completions differently)
    for name, value in trl_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def _trainer(model_dir, out, funcs, dataset=None, generator=None, eval_dataset=None, **kw):
    return vlmtrain.GRPOTrainer(model=str(model_dir), reward_funcs=funcs,
                                args=_config(vlmtrain.GRPOConfig, out, **{"max_steps": 1, "reward_weights": None, **kw}),
                                train_dataset=dataset or _prompts(), eval_dataset=eval_dataset,
                                processing_class=_tokenizer(),
                                generator=generator or FixedCompletions(6))


def test_grpo_reward_returning_nan_or_the_wrong_length_is_an_error_naming_it(model_dir, tmp_path):
    def nan_reward(completions, **kw):
        return [float("nan")] * len(completions)

    def short_reward(completions, **kw):
        return [1.0]

    for func, match in ((nan_reward, "'nan_reward' returned nan"), (short_reward, "'short_reward' returned 1 ")):
        with pytest.raises(ValueError, match=match):
            _trainer(model_dir, tmp_path, [func]).train()


def test_grpo_a_reward_raising_on_a_sample_skips_it_counted(model_dir, tmp_path):
    def picky_reward(completions, **kw):
        if any(len(c.split()) == 1 for c in completions):
            raise RuntimeError("one word")
        return [1.0] * len(completions)

    trainer = _trainer(model_dir, tmp_path, [picky_reward, length_reward])
    trainer.train()
    log = next(e for e in trainer.state.log_history if "loss" in e)
    assert log["rewards/picky_reward/skipped"] > 0

    def broken_reward(completions, **kw):
        raise TypeError("bad signature")

    with pytest.raises(RuntimeError, match="'broken_reward' raised on every completion"):
        _trainer(model_dir, tmp_path, [broken_reward]).train()


@pytest.mark.parametrize("kw,match", [
    (dict(num_generations=3), r"generation_batch_size \(8.*divisible by num_generations \(3\)"),
    (dict(use_vllm=True), "use_vllm=True not supported"),
    (dict(loss_type="cispo"), "loss_type='cispo'"),
])
def test_grpo_config_refuses_what_cannot_run(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        _config(vlmtrain.GRPOConfig, tmp_path, **kw)


def test_grpo_a_prompt_leaving_no_room_for_the_completion_is_an_error(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="max_completion_length=62"):
        _trainer(model_dir, tmp_path, [length_reward], max_completion_length=62).train()


def test_grpo_samples_with_the_policy_generate(model_dir, tmp_path):
    """The default rollout: the policy's own generate (sampling), every completion within the limit."""
    trainer = vlmtrain.GRPOTrainer(model=str(model_dir), reward_funcs="tests.test_grpo:length_reward",
                                   args=_config(vlmtrain.GRPOConfig, tmp_path, max_steps=1, reward_weights=None,
                                                log_completions=True),
                                   train_dataset=_prompts(), processing_class=_tokenizer())
    trainer.train()
    log = next(e for e in trainer.state.log_history if "loss" in e)
    assert 1 <= log["completions/max_length"] <= 6
    assert len(log["completions"]) == 8 and {"prompt", "completion", "reward", "advantage"} <= set(log["completions"][0])


EVAL_KEYS = ["eval_loss", "eval_reward", "eval_reward_std", "eval_rewards/length_reward/mean",
             "eval_rewards/target_reward/mean", "eval_frac_reward_zero_std", "eval_completions/mean_length",
             "eval_completions/clipped_ratio", "eval_kl", "eval_entropy", "eval_clip_ratio/region_mean"]


def _num_samples(trainer) -> list:
    """The evaluation loop's num_samples (what transformers' evaluate() divides by for eval_samples_per_second)."""
    seen, loop = [], trainer.evaluation_loop

    def counted(*args, **kwargs):
        output = loop(*args, **kwargs)
        seen.append(output.num_samples)
        return output

    trainer.evaluation_loop = counted
    return seen


@requires("trl", "dev")
@pytest.mark.parametrize("iterable", [False, True], ids=["dataset", "iterable"])
def test_grpo_evaluate_equals_trl(model_dir, tmp_path, iterable):
    """eval_dataset: evaluate() rolls out num_generations completions per eval prompt (TRL's seeded order, eval
    batches of whole groups) and reports TRL's metrics with the eval_ prefix: the loss, rewards, lengths, KL and
    entropy equal TRL's GRPOTrainer.evaluate() on the same completions (each eval batch's loss averaged over the
    batches, as TRL's evaluation loop does, whatever the loss type). (8 eval prompts: with a count that is not a
    multiple of per_device_eval_batch_size, accelerate's gather_for_metrics in TRL's loop cuts the last batch's
    loss weight to len(eval_dataset) % batch size rows, a weighting vlmtrain does not copy.) The samples evaluated
    (eval_samples, the count eval_samples_per_second divides) are the eval prompts, as TRL's len(eval_dataset).
    An iterable eval set (a datasets.IterableDataset) is read in TRL's order (shuffled by seed in datasets'
    buffer, each prompt num_generations times): the same metrics as TRL's."""
    results, samples = {}, {}
    for framework in ("trl", "ours"):
        rollout, funcs = FixedCompletions(6), [length_reward, target_reward]
        kw = dict(loss_type="dapo", beta=0.1, per_device_eval_batch_size=8, max_steps=1)
        evals = _prompts(8, seed=1)
        evals = evals.to_iterable_dataset(num_shards=2) if iterable else evals
        if framework == "trl":
            import trl

            trainer = trl.GRPOTrainer(model=str(model_dir), reward_funcs=funcs,
                                      args=_config(trl.GRPOConfig, tmp_path / "trl", **kw),
                                      train_dataset=_prompts(), eval_dataset=evals,
                                      processing_class=_tokenizer(), rollout_func=rollout.trl)
        else:
            trainer = vlmtrain.GRPOTrainer(model=str(model_dir), reward_funcs=funcs,
                                           args=_config(vlmtrain.GRPOConfig, tmp_path / "ours", **kw),
                                           train_dataset=_prompts(), eval_dataset=evals,
                                           processing_class=_tokenizer(), generator=rollout)
        seen = _num_samples(trainer)
        results[framework] = trainer.evaluate()
        samples[framework] = seen
        assert rollout.calls == 4  # (32 completions in eval batches of 8)
    for key in EVAL_KEYS:
        assert results["ours"][key] == pytest.approx(results["trl"][key], rel=1e-4, abs=1e-6), key
    assert results["ours"]["eval_kl"] == pytest.approx(0.0, abs=1e-6)  # (the policy is still its reference)
    assert samples["ours"] == [results["ours"]["eval_samples"]] == [8]  # (the prompts, not the 4 batches)
    if not iterable:  # (TRL counts an iterable set's samples by find_batch_size, which finds no tensor: 0)
        assert samples["trl"] == [8]


class _Listed(torch.utils.data.IterableDataset):
    """A torch iterable of rows, read as it comes."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def test_grpo_evaluates_a_streaming_dataset_read_whole(model_dir, tmp_path):
    """A StreamingDataset of one JSONL source as eval_dataset is read whole, in its order, its record without a
    prompt skipped: the eval metrics equal those of the same good prompts as a torch iterable, and eval_samples
    counts the 5 prompts; a StreamingDataset mixing two sources (endless) is refused before the model loads."""
    import json

    from vlmtrain.data.sources import JsonlSource, StreamingDataset

    good = _prompts(5, seed=1).to_list()
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in good[:2] + [{"question": "no prompt"}] + good[2:]))
    results = []
    for evals in (StreamingDataset([JsonlSource(str(path))], shuffle=False), _Listed(good)):
        trainer = _trainer(model_dir, tmp_path, [length_reward, target_reward], eval_dataset=evals,
                           per_device_eval_batch_size=8)
        results.append(trainer.evaluate())
    assert results[0]["eval_samples"] == results[1]["eval_samples"] == 5
    timing = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_model_preparation_time")
    assert results[0].keys() == results[1].keys() and "eval_rewards/target_reward/mean" in results[1]
    for key in results[1].keys() - set(timing):
        assert results[0][key] == pytest.approx(results[1][key], rel=1e-5, abs=1e-7), key
    mixture = StreamingDataset([JsonlSource(str(path)), JsonlSource(str(path))])
    with pytest.raises(ConfigError, match="eval_dataset: a StreamingDataset mixing 2 sources never ends"):
        vlmtrain.GRPOTrainer(model="no/such-model", reward_funcs=[length_reward, target_reward], eval_dataset=mixture,
                             args=_config(vlmtrain.GRPOConfig, tmp_path), train_dataset=_prompts(),
                             processing_class=_tokenizer())


@pytest.fixture(scope="module")
def logged_run(model_dir, tmp_path_factory):
    """Two logged steps with log_completions: the run directory."""
    out = tmp_path_factory.mktemp("grpo_logged")
    _trainer(model_dir, out, [length_reward], max_steps=2, log_completions=True).train()
    return out


def _rows_logged(run_dir) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_logs_the_completions_it_trains_on_per_second(logged_run):
    """samples_per_second counts the completions trained on and tokens_per_second the tokens of their training
    forwards (each prompt's and completion's real tokens), as vlmtrain's SFT counts a batch's: their ratio is a
    step's mean prompt + completion length."""
    tok = _tokenizer()
    logs = [r for r in _rows_logged(logged_run) if "loss" in r]  # (the per-step figures: metrics.jsonl)
    assert len(logs) == 2
    for log in logs:
        prompts = [len(tok(text=row["prompt"])["input_ids"]) for row in log["completions"]]
        expected = sum(prompts) / len(prompts) + log["completions/mean_length"]
        assert log["samples_per_second"] > 0
        assert log["tokens_per_second"] / log["samples_per_second"] == pytest.approx(expected, rel=1e-2)


def test_grpo_report_page_shows_the_completions_table_per_logged_step(logged_run):
    """`vlmtrain report` of a run with log_completions: a table per logged step, each row a prompt, its
    completion, its reward and advantage (HTML-escaped)."""
    import html

    from vlmtrain import cli

    assert cli.main(["report", str(logged_run)]) == 0
    page = (logged_run / "report.html").read_text()
    for log in [r for r in _rows_logged(logged_run) if "completions" in r]:
        assert f"Completions at step {log['step']}" in page
        row = log["completions"][-1]
        assert html.escape(row["prompt"]) in page and html.escape(row["completion"]) in page
        assert f"{row['reward']:.4g}" in page


def test_grpo_completions_table_as_trl_logs_it(model_dir, tmp_path):
    """log_completions as TRL's: every logged step shows the last generation's table (num_iterations 2: step 2
    trains on step 1's generation and shows its table again), a column per reward function beside the weighted
    reward, and num_completions_to_print rows of it drawn at random, kept in the table's order."""
    trainer = _trainer(model_dir, tmp_path, [length_reward, target_reward], max_steps=2, num_iterations=2,
                       log_completions=True, num_completions_to_print=3, reward_weights=[1.0, 0.5])
    trainer.train()
    first, second = [e["completions"] for e in trainer.state.log_history if "loss" in e]
    assert first == second and len(first) == 3
    assert [list(row) for row in first] == [["prompt", "completion", "reward", "length_reward", "target_reward",
                                             "advantage"]] * 3
    for row in first:
        assert row["reward"] == pytest.approx(row["length_reward"] + 0.5 * row["target_reward"])
    assert len({row["prompt"] for row in first}) > 1  # (a random sample spans the groups, not the first rows)


def test_grpo_completions_table_of_unique_prompts(model_dir, tmp_path):
    """log_unique_prompts (TRL's option): the table keeps each prompt's first row (8 rows: 2 groups of 4)."""
    trainer = _trainer(model_dir, tmp_path, [length_reward], log_completions=True, log_unique_prompts=True)
    trainer.train()
    table = next(e["completions"] for e in trainer.state.log_history if "loss" in e)
    assert len(table) == 2 and table[0]["prompt"] != table[1]["prompt"]


def test_grpo_evaluating_during_training_keeps_each_rollouts_metrics_apart(model_dir, tmp_path):
    """eval_strategy steps: every training row logs its own rollout's reward, every evaluation row its eval
    rollouts' (the rollout after an evaluation is a training one again, the policy back in training mode)."""
    trainer = _trainer(model_dir, tmp_path, [length_reward], eval_dataset=_prompts(2, seed=1), max_steps=2,
                       eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4)
    trainer.train()
    train = [e for e in trainer.state.log_history if "loss" in e]
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert [e["step"] for e in train] == [e["step"] for e in evals] == [1, 2]
    assert all("reward" in e and "completions/mean_length" in e for e in train)
    assert all("eval_reward" in e and "reward" not in e for e in evals)
