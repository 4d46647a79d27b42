"""GRPO from streamed prompts: `train.objective: grpo` with `data.source: stream` (and vlmtrain.GRPOTrainer given an
iterable dataset) reads its prompts from the stream, every process the whole stream in its order, and trains as
the same prompts in the same order from a JSONL file do (rel 1e-5: the same completions, losses, rewards and
weights, AdamW with weight decay), across an epoch's end; a record that is not a prompt is a counted skip
(`skipped_not_a_prompt`); a source with no prompt at all, or a stream without max_steps, is refused in one line.
Resume and ranks: tests/test_grpo_resume.py and tests/test_grpo_ranks.py (a stream case each)."""

from __future__ import annotations

import pytest
import torch
import yaml
from datasets import Dataset
from transformers import AutoModelForCausalLM

import vlmtrain
from tests.optional_extras import requires
from tests.test_dpo import _tokenizer
from tests.test_grpo import _prompts, _run, length_reward, model_dir, target_reward  # noqa: F401 (model_dir: a fixture)
from tests.test_objective_grpo import FUNCS, GRPO_KEYS, TRAIN, _jsonl, _metrics
from vlmtrain import cli, run
from vlmtrain.config import load_run_config
from vlmtrain.errors import ConfigError

STEPS = 3  # 5 prompts, 2 a generation (the fifth dropped, as TRL drops a partial batch): step 3 in the second epoch
NOT_A_PROMPT = {"question": "no prompt here", "target": "w1"}


def _rows() -> list[dict]:
    good = _prompts(5).to_list()
    return good[:2] + [NOT_A_PROMPT] + good[2:]


def _yaml(tmp_path, model_dir, name: str, data: dict, **train) -> str:  # noqa: F811
    cfg = {"model": {"kind": "causal_lm", "pretrained": str(model_dir)}, "data": data,
           "train": {**TRAIN, "output_dir": str(tmp_path / name), "objective": "grpo", "reward_funcs": FUNCS,
                     "max_steps": STEPS, "shuffle_dataset": False, "save_strategy": "steps", "save_steps": STEPS,
                     **train}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _weights(run_dir) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(run_dir / f"checkpoint-{STEPS}", dtype=torch.float32)
    return dict(model.named_parameters())


def test_grpo_from_a_stream_equals_the_same_prompts_from_a_jsonl_file(model_dir, tmp_path, one_thread):  # noqa: F811
    """One JSONL file, read as data.train_file, as a stream's only source, as WebDataset shards and as a Hugging
    Face dataset (shuffle_dataset false: the file's order each way), trains alike: every logged step's loss, rewards, KL, lengths (rel 1e-5) and the checkpoint's
    weights; the record without a prompt is skipped and counted in the stream's metrics. vlmtrain.GRPOTrainer given
    the good rows as a datasets.IterableDataset trains alike too."""
    train_file = _jsonl(tmp_path / "prompts.jsonl", _rows())
    assert cli.main(["train", "--config", _yaml(tmp_path, model_dir, "file",
                                                {"source": "jsonl", "train_file": train_file})]) == 0
    assert cli.main(["train", "--config", _yaml(tmp_path, model_dir, "stream", {
        "source": "stream", "sources": [{"kind": "jsonl", "path": train_file}]})]) == 0
    # the same records as WebDataset shards (KEY.json each; every sample has an `images` list, empty here)
    assert cli.main(["data", "to-wds", train_file, str(tmp_path / "wds"), "--shard-size", "10"]) == 0
    assert cli.main(["train", "--config", _yaml(tmp_path, model_dir, "wds", {
        "source": "stream", "sources": [{"kind": "wds", "path": str(tmp_path / "wds" / "shard-000000.tar")}]})]) == 0
    # and as a Hugging Face dataset on disk (the record without a prompt: prompt None, its question a column)
    Dataset.from_list(_rows()).save_to_disk(str(tmp_path / "hf"))
    assert cli.main(["train", "--config", _yaml(tmp_path, model_dir, "hf", {
        "source": "stream", "sources": [{"kind": "hf", "path": str(tmp_path / "hf")}]})]) == 0
    runs = {n: [r for r in _metrics(tmp_path / n) if "loss" in r] for n in ("file", "stream", "wds", "hf")}
    from_file = runs.pop("file")
    assert len(from_file) == STEPS and all(len(logs) == STEPS for logs in runs.values())
    for name, logs in runs.items():
        for step, (ours, theirs) in enumerate(zip(logs, from_file, strict=True), 1):
            for key in GRPO_KEYS:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), (name, step, key)
        assert [r.get("skipped_not_a_prompt") for r in logs] == [None, 1, None], name  # (read with batch 2)
    expected = _weights(tmp_path / "file")
    for run_dir in runs:
        for name, weight in _weights(tmp_path / run_dir).items():
            torch.testing.assert_close(weight, expected[name], rtol=1e-5, atol=1e-6)

    args = vlmtrain.GRPOConfig(str(tmp_path / "python"), bf16=False, gradient_checkpointing=False, use_cpu=True,
                               save_strategy="no", **{**TRAIN, "max_steps": STEPS, "shuffle_dataset": False})
    iterable = _prompts(5).to_iterable_dataset()
    trainer = vlmtrain.GRPOTrainer(model=str(model_dir), reward_funcs=[length_reward, target_reward], args=args,
                                   train_dataset=iterable, processing_class=_tokenizer())
    trainer.train()
    python = [e for e in trainer.state.log_history if "loss" in e]
    for step, (ours, theirs) in enumerate(zip(python, from_file, strict=True), 1):
        for key in GRPO_KEYS:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), (step, key)


def test_a_stream_source_without_prompts_or_a_stream_without_max_steps_is_refused(model_dir, tmp_path):  # noqa: F811
    """A source none of whose records is a prompt: a ConfigError naming it (data.sources[1]) before training; a
    stream without train.max_steps: refused when the config is read; vlmtrain.GRPOTrainer given an iterable
    dataset without max_steps: before the model loads."""
    good = _jsonl(tmp_path / "good.jsonl", _rows())
    bad = _jsonl(tmp_path / "bad.jsonl", [NOT_A_PROMPT, {"texts": [{"user": "w1", "assistant": "w2"}]}])
    data = {"source": "stream", "sources": [{"kind": "jsonl", "path": good}, {"kind": "jsonl", "path": bad}]}
    config = _yaml(tmp_path, model_dir, "bad", data)
    with pytest.raises(ConfigError, match=r"data.sources\[1\]: none of its 2 samples is a GRPO prompt "
                                          r"\({'not_a_prompt': 2}\)"):
        run.train(load_run_config(config))
    with pytest.raises(ConfigError, match=r"train.max_steps=-1: train.objective=grpo with data.source=stream needs"):
        load_run_config(config, {"train.max_steps": -1})
    args = vlmtrain.GRPOConfig(str(tmp_path / "python"), num_generations=4, per_device_train_batch_size=8,
                               use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="set max_steps"):
        vlmtrain.GRPOTrainer(model="no/such-model", reward_funcs=length_reward, args=args,
                             train_dataset=_prompts(5).to_iterable_dataset(), processing_class=_tokenizer())



@requires("trl", "dev")
def test_grpo_on_a_datasets_iterable_dataset_equals_trl(model_dir, tmp_path, one_thread):  # noqa: F811
    """Given a datasets.IterableDataset (12 prompts, 2 a generation: 6 steps an epoch), vlmtrain.GRPOTrainer trains
    as TRL 1.16's GRPOTrainer does with the same completions (rel 1e-4): TRL's buffered shuffle by the seed
    (shuffle_dataset, reshuffled in the second epoch) and TRL's repeat order of the stream."""
    kw = dict(loss_type="dapo", beta=0.1, num_iterations=2, max_steps=8, iterable=True)
    trl_logs, trl_weights = _run("trl", model_dir, tmp_path / "trl", **kw)
    logs, weights = _run("ours", model_dir, tmp_path / "ours", **kw)
    assert len(logs) == len(trl_logs) == 8
    for ours, theirs in zip(logs, trl_logs, strict=True):
        for key in ("loss", "reward", "completions/mean_length", "kl", "entropy"):
            assert (key in ours) == (key in theirs), (key, ours["step"])  # (rollout metrics: steps that generate)
            if key in theirs:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (key, ours["step"])
    for name, value in trl_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5)
