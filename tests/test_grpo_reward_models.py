"""Reward models in a GRPO run config: a `train.reward_funcs` entry that is a directory is a reward model, the
output of a `train.objective: reward` run (a checkpoint with a reward head) or a sequence-classification model
with one label, checked when the config is read; anything else there is one line naming the entry."""

from __future__ import annotations

import json

import pytest
import yaml

import vlmtrain
from tests.test_grpo import _prompts, _trainer, model_dir, reward_model_dir  # noqa: F401 (model_dir, reward_model_dir: fixtures)
from tests.test_objective_grpo import _metrics, _yaml
from tests.test_reward_head import _reward_yaml
from vlmtrain import cli
from vlmtrain.config import load_run_config
from vlmtrain.errors import ConfigError


def test_grpo_scores_with_the_reward_model_a_reward_run_trained(model_dir, tiny_hub, tmp_path, one_thread):  # noqa: F811
    """A reward run (a tiny Qwen3-VL's reward head, 2 steps) then a GRPO run of a causal LM whose
    train.reward_funcs is that run's directory, both through `vlmtrain train`: each logged completion's reward
    is the reward head's score of its prompt and completion (load_for_inference(...).score), logged under
    rewards/<directory name>/mean; the same in Python with the loaded checkpoint in reward_funcs."""
    reward_config = _reward_yaml(tmp_path, tiny_hub("qwen3_vl")[1])
    cfg = yaml.safe_load(open(reward_config))
    del cfg["data"]["eval_file"]  # (no evaluation needed here)
    (tmp_path / "reward.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["train", "--config", reward_config]) == 0
    run = str(tmp_path / "run")
    config = _yaml(tmp_path, model_dir, _prompts(4).to_list(), reward_funcs=[run], reward_weights=None,
                   max_steps=1, log_completions=True)
    assert cli.main(["train", "--config", config]) == 0
    [log] = [r for r in _metrics(tmp_path / "grpo") if "loss" in r]
    table = log["completions"]
    assert len(table) == 8 and "rewards/run/mean" in log
    scorer = vlmtrain.load_for_inference(run, device="cpu")
    want = scorer.score([{"texts": [{"user": r["prompt"], "assistant": r["completion"]}]} for r in table])
    assert [r["reward"] for r in table] == pytest.approx([w["reward"] for w in want], abs=1e-5)
    assert log["rewards/run/mean"] == pytest.approx(sum(w["reward"] for w in want) / 8, abs=1e-5)
    assert len({round(w["reward"], 6) for w in want}) > 1  # (the head tells the completions apart)

    # in Python: the checkpoint loaded with load_for_inference is the reward_funcs entry (its path is refused,
    # naming that), the same scores
    with pytest.raises(ConfigError, match=r"is a vlmtrain checkpoint with a reward head: pass "
                                          r"vlmtrain.load_for_inference\("):
        _trainer(model_dir, tmp_path / "python", [run])
    trainer = _trainer(model_dir, tmp_path / "python", [scorer], log_completions=True)
    trainer.train()
    [log] = [e for e in trainer.state.log_history if "loss" in e]
    want = scorer.score([{"texts": [{"user": r["prompt"], "assistant": r["completion"]}]} for r in log["completions"]])
    assert [r["reward"] for r in log["completions"]] == pytest.approx([w["reward"] for w in want], abs=1e-5)
    assert "rewards/run/mean" in log  # (named after the run, not its checkpoint-N)


def test_a_reward_funcs_directory_must_hold_a_reward_model(model_dir, reward_model_dir, tmp_path,  # noqa: F811
                                                             monkeypatch):
    """Checked when the config is read, without loading it: a sequence-classification model with one label
    passes; a causal LM, or a directory without a model, is one ConfigError naming the entry and what was
    expected (the same in Python's GRPOTrainer)."""
    from vlmtrain.compat import grpo_reward_models

    config = _yaml(tmp_path, model_dir, _prompts(4).to_list())
    with monkeypatch.context() as patch:
        patch.setattr(grpo_reward_models, "load_reward_model", None)  # (reading the config loads no model)
        load_run_config(config, {"train.reward_funcs": [str(reward_model_dir)], "train.reward_weights": None})
    (tmp_path / "empty").mkdir()
    expected = "holds a sequence-classification model with one label"
    for entry, found in ((model_dir, "found LlamaForCausalLM with 2 labels"), (tmp_path / "empty", "found no model")):
        with pytest.raises(ConfigError, match=f"train.reward_funcs '{entry}': a reward model directory {expected}.*"
                                              f"{found}"):
            load_run_config(config, {"train.reward_funcs": [str(entry)], "train.reward_weights": None})
    with pytest.raises(ConfigError, match=f"reward function '{model_dir}': a reward model directory {expected}"):
        vlmtrain.GRPOTrainer(model=str(model_dir), reward_funcs=str(model_dir), train_dataset=_prompts(4),
                             args=vlmtrain.GRPOConfig(str(tmp_path / "out"), num_generations=4,
                                                      per_device_train_batch_size=8, use_cpu=True))
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
