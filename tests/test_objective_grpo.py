"""`train.objective: grpo` from a YAML config: prompts in a JSONL file (a `prompt` string, or vlmtrain's `texts`
turns whose last one is the question) train a tiny causal LM with the same per-step loss, rollout metrics and final
weights as vlmtrain.GRPOTrainer (itself equal to TRL's) given the same seed, so the same sampled completions; TRL's
metric names land in metrics.jsonl; bad settings fail before any work, naming the key."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

import vlmtrain
from tests.test_dpo import _tokenizer
from tests.test_grpo import _prompts, length_reward, model_dir, target_reward  # noqa: F401 (model_dir: a fixture)
from vlmtrain import cli
from vlmtrain.config import load_run_config
from vlmtrain.errors import ConfigError

FUNCS = ["tests.test_grpo:length_reward", "tests.test_grpo:target_reward"]
TRAIN = {"num_generations": 4, "per_device_train_batch_size": 8, "max_completion_length": 6, "max_steps": 3,
         "learning_rate": 1e-3, "weight_decay": 0.1, "logging_steps": 1, "seed": 7, "report_to": "none",
         "dataloader_num_workers": 0, "disable_tqdm": True, "reward_weights": [1.0, 0.5], "beta": 0.1}
GRPO_KEYS = ("loss", "reward", "reward_std", "rewards/length_reward/mean", "rewards/target_reward/mean",
             "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio", "kl", "entropy",
             "clip_ratio/region_mean")


def _jsonl(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _yaml(tmp_path, model_path, rows: list[dict], name: str = "grpo", eval_rows: list[dict] | None = None,
          **train) -> str:
    data = {"source": "jsonl", "train_file": _jsonl(tmp_path / f"{name}.jsonl", rows)}
    if eval_rows:
        data["eval_file"] = _jsonl(tmp_path / f"{name}-eval.jsonl", eval_rows)
    cfg = {"model": {"kind": "causal_lm", "pretrained": str(model_path)}, "data": data,
           "train": {"output_dir": str(tmp_path / name), "objective": "grpo", "reward_funcs": FUNCS,
                     "save_strategy": "steps", "save_steps": TRAIN["max_steps"], **TRAIN, **train}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_steps_equal_python(runs: dict[str, list[dict]], model, processor, rows, reward, train: dict, out) -> None:
    """YAML runs' logged training rows (name -> rows) against vlmtrain.GRPOTrainer's on ``model`` (a Hub VLM,
    float32) with ``processor``, the same prompts (``rows``, TRL's VLM layout), reward function and ``train``
    options: the same per-step loss, reward, completion length, KL and entropy (rel 1e-5)."""
    args = vlmtrain.GRPOConfig(str(out / "python"), bf16=False, gradient_checkpointing=False, save_strategy="no",
                               use_cpu=True, **train)
    trainer = vlmtrain.GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=rows,
                                   processing_class=processor)
    trainer.train()
    theirs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(theirs) == train["max_steps"]
    for name, logged in runs.items():
        assert len(logged) == len(theirs), name
        for step, (mine, log) in enumerate(zip(logged, theirs, strict=True), 1):
            for key in ("loss", "reward", "completions/mean_length", "kl", "entropy"):
                assert mine[key] == pytest.approx(log[key], rel=1e-5, abs=1e-7), (name, step, key)


@pytest.fixture(scope="module")
def python_run(model_dir, tmp_path_factory):  # noqa: F811 (the fixture)
    """The job through vlmtrain.GRPOTrainer in Python: its logs, its policy and its final evaluation."""
    args = vlmtrain.GRPOConfig(str(tmp_path_factory.mktemp("python")), bf16=False, gradient_checkpointing=False,
                               save_strategy="no", use_cpu=True, **TRAIN)
    trainer = vlmtrain.GRPOTrainer(model=str(model_dir), reward_funcs=[length_reward, target_reward], args=args,
                                   train_dataset=_prompts().to_list(), eval_dataset=_prompts(2, seed=1).to_list(),
                                   processing_class=_tokenizer())
    trainer.train()
    return [e for e in trainer.state.log_history if "loss" in e], trainer.policy, trainer.evaluate()


def test_grpo_from_yaml_equals_grpo_trainer(model_dir, tmp_path, one_thread, python_run):  # noqa: F811
    """`vlmtrain train` with train.objective grpo samples the same completions as vlmtrain.GRPOTrainer (same seed,
    same prompts: the policy's own generate), so per-step loss, rewards, KL, lengths and clip ratios equal (rel
    1e-5) under TRL's names in metrics.jsonl, the checkpoint holds the same policy, and the final evaluation on
    data.eval_file (TRL's eval_ metrics, rolled out on the eval prompts) equals GRPOTrainer.evaluate()'s."""
    config = _yaml(tmp_path, model_dir, _prompts().to_list(), eval_rows=_prompts(2, seed=1).to_list())
    assert cli.main(["train", "--config", config]) == 0
    logs, policy, evaluation = python_run
    ours = [r for r in _metrics(tmp_path / "grpo") if "loss" in r]
    assert len(ours) == len(logs) == TRAIN["max_steps"]
    for step, (mine, theirs) in enumerate(zip(ours, logs, strict=True), 1):
        for key in GRPO_KEYS:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), (step, key)
    assert ours[-1]["kl"] > 0  # (the policy moved off its reference)
    final = [r for r in _metrics(tmp_path / "grpo") if "eval_loss" in r][-1]
    for key in GRPO_KEYS:
        assert final[f"eval_{key}"] == pytest.approx(evaluation[f"eval_{key}"], rel=1e-5, abs=1e-7), key
    saved = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "grpo" / f"checkpoint-{TRAIN['max_steps']}",
                                                      dtype=torch.float32).named_parameters())
    for name, weight in policy.named_parameters():
        torch.testing.assert_close(saved[name], weight, rtol=1e-5, atol=1e-6)


@pytest.fixture
def grpo_yaml(tmp_path, model_dir):  # noqa: F811
    return _yaml(tmp_path, model_dir, _prompts(4).to_list())


@pytest.mark.parametrize("overrides,message", [
    ({"train.reward_funcs": ["tests.no_such_module:reward"]},
     r"train.reward_funcs: 'tests.no_such_module:reward' does not import \(ModuleNotFoundError"),
    ({"train.reward_funcs": ["tests.test_grpo:no_such_reward"]}, r"'tests.test_grpo:no_such_reward' does not import "
                                                                   r"\(AttributeError"),
    ({"train.reward_funcs": None}, "train.objective=grpo needs train.reward_funcs"),
    ({"data.packing": True}, "data.packing is not available with train.objective=grpo: set data.packing: false"),
    ({"train.predict_with_generate": True}, "train.predict_with_generate is not available with train.objective=grpo"),
    ({"train.num_generations": 3}, r"divisible by num_generations \(3\)"),
    ({"data.eval_file": "EVAL", "train.per_device_eval_batch_size": 6}, r"global eval batch size \(6 \* 1\) must be "
                                                                       r"divisible by the number of generations"),
    ({"train.loss_type": "sigmoid"}, "loss_type='sigmoid'"),
    ({"train.truncation_mode": "keep_end"}, "train.truncation_mode is an option of train.objective: dpo"),
    ({"train.objective": "sft"}, r"train.reward_\w+ is an option of train.objective: grpo, but train.objective is .sft."),
    ({"model.kind": "vlm"}, "train.objective=grpo is not supported for model.kind=vlm"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_bad_grpo_settings_fail_before_any_work_naming_the_key(grpo_yaml, overrides, message):
    """One ConfigError when the config is read (no model, no data yet), naming the key (a reward function that
    does not import: naming it and the import error)."""
    if overrides.get("data.eval_file") == "EVAL":
        overrides = {**overrides, "data.eval_file": grpo_yaml.replace(".yaml", ".jsonl")}
    with pytest.raises(ConfigError, match=message):
        load_run_config(grpo_yaml, overrides)


SEEN: list = []  # what texts_reward was given


def texts_reward(prompts, completions, target, **kwargs):
    SEEN.extend(zip(prompts, target, strict=True))
    return [float(len(c)) for c in completions]


def test_grpo_prompts_in_both_layouts_and_data_inspect(model_dir, tmp_path, capsys):  # noqa: F811
    """A `prompt` string and vlmtrain's `texts` turns (the last one the question alone, laid out as SFT lays out a
    conversation: BOS, each user text and a newline, each earlier answer and EOS) train side by side, the other
    columns reaching the reward function; a record that is neither is a counted skip. `vlmtrain data inspect
    --config` shows each prompt's tokens as the run tokenizes them."""
    rows = [{"texts": [{"user": "w1 w2", "assistant": "w3"}, {"user": "w4"}], "target": "w5"},
            {"prompt": "w6 w7", "target": "w8"},
            {"texts": [{"user": "w1", "assistant": "w2"}], "target": "w9"}]  # (the last turn has its answer)
    config = _yaml(tmp_path, model_dir, rows * 4, reward_funcs=["tests.test_objective_grpo:texts_reward"],
                   reward_weights=None, max_steps=1, per_device_train_batch_size=8)
    assert cli.main(["data", "inspect", str(tmp_path / "grpo.jsonl"), "--config", config]) == 0
    out = capsys.readouterr().out
    assert "bad samples: {'not_a_prompt': 4}" in out
    assert "prompt (6): <s> w1 w2 w3 </s> w4" in out  # (the tiny word-level tokenizer has no newline token)
    assert "prompt (2): w6 w7" in out
    import tests.test_objective_grpo as imported  # (the module the config names: maybe not pytest's own)

    imported.SEEN.clear()
    assert cli.main(["train", "--config", config]) == 0
    assert dict(imported.SEEN) == {"w1 w2 w3 w4": "w5", "w6 w7": "w8"}  # (the prompt's text, special tokens off)


def test_exact_answer_reward_compares_stripped_texts():
    """The shipped reward function (configs/smollm2-grpo.yaml): a string or a conversational completion against
    the prompt's `answer` column."""
    from vlmtrain.evaluation.rewards import exact_answer

    completions = [" 4\n", [{"role": "assistant", "content": "7 "}], "5"]
    assert exact_answer(completions, answer=["4", "7", "6"], prompts=["a", "b", "c"]) == [1.0, 1.0, 0.0]


OPENED: list = []  # (whether each image vision_reward was given is an opened PIL image: as the prompts' rows hold it)


def vision_reward(completions, target, images=None, **kwargs):
    from PIL import Image

    OPENED.extend(isinstance(i, Image.Image) for row in images or [] for i in row)
    return [float(t in (c[0]["content"] if isinstance(c, list) else c)) + 0.1 * len(str(c)) % 3
            for c, t in zip(completions, target, strict=True)]


@pytest.mark.parametrize("family", ["qwen3_vl", "idefics3", "gemma3"])
def test_grpo_from_yaml_on_a_hub_vlm_equals_grpo_trainer(tiny_hub, tmp_path, one_thread, capsys, family):
    """model.kind hub_vlm (a tiny Qwen3-VL, Idefics3 or Gemma 3): prompts with images in a JSONL file, in
    vlmtrain's `texts` layout and TRL's conversational one, train as vlmtrain.GRPOTrainer trains the same rows as
    TRL's VLM layout (messages and PIL images), same seed: the same per-step loss, rewards and KL (rel 1e-5); so
    does the file read as a stream (data.source: stream, its images opened by the process that takes their rows).
    `vlmtrain data inspect --config` shows each prompt's tokens as the processor makes them, image tokens
    expanded."""
    import random

    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from vlmtrain.data.preference_vision import image_token_id

    _, path, processor = tiny_hub(family)
    image_token = processor.tokenizer.convert_ids_to_tokens(image_token_id(processor))
    rng, rows, python_rows = random.Random(0), [], []
    for i, n in enumerate([1, 0, 2, 1]):
        images = []
        for j in range(n):
            image = tmp_path / f"img{i}-{j}.png"
            Image.new("RGB", (32, 32), tuple(rng.randrange(256) for _ in range(3))).save(image)
            images.append(str(image))
        question, target = f"what {rng.choice(['red', 'blue'])}", rng.choice(["red", "blue", "green"])
        own = i % 2 == 0
        rows.append({"texts": [{"user": question}], "images": images, "target": target} if own else
                    {"prompt": [{"role": "user", "content": question}], "images": images, "target": target})
        python_rows.append({"prompt": [{"role": "user", "content": question}],
                            "images": [Image.open(p).convert("RGB") for p in images], "target": target})
    train = {"num_generations": 2, "per_device_train_batch_size": 4, "max_completion_length": 4, "max_steps": 2,
             "learning_rate": 3e-3, "weight_decay": 0.1, "logging_steps": 1, "seed": 7, "report_to": "none",
             "dataloader_num_workers": 0, "disable_tqdm": True, "beta": 0.1, "shuffle_dataset": False}
    config = {"model": {"kind": "hub_vlm", "pretrained": str(path)},
              "data": {"source": "jsonl", "train_file": _jsonl(tmp_path / "vlm.jsonl", rows)},
              "train": {"output_dir": str(tmp_path / "run"), "objective": "grpo", "save_strategy": "no",
                        "reward_funcs": ["tests.test_objective_grpo:vision_reward"], **train}}
    (tmp_path / "vlm.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["data", "inspect", str(tmp_path / "vlm.jsonl"), "--config", str(tmp_path / "vlm.yaml")]) == 0
    shown = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("prompt (")]
    assert len(shown) == 4 and [line.count(image_token) > 0 for line in shown] == [True, False, True, True]
    assert cli.main(["train", "--config", str(tmp_path / "vlm.yaml")]) == 0
    ours = [r for r in _metrics(tmp_path / "run") if "loss" in r]
    # the same JSONL file as a stream's source (data.source: stream; the file's order, shuffle_dataset false)
    config["data"] = {"source": "stream", "sources": [{"kind": "jsonl", "path": str(tmp_path / "vlm.jsonl")}]}
    config["train"]["output_dir"] = str(tmp_path / "stream")
    (tmp_path / "stream.yaml").write_text(yaml.safe_dump(config))
    import tests.test_objective_grpo as imported  # (the module the config names: maybe not pytest's own)

    imported.OPENED.clear()
    assert cli.main(["train", "--config", str(tmp_path / "stream.yaml")]) == 0
    assert imported.OPENED and all(imported.OPENED)
    streamed = [r for r in _metrics(tmp_path / "stream") if "loss" in r]

    assert_steps_equal_python({"yaml": ours, "stream": streamed},
                              AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32), processor,
                              python_rows, vision_reward, train, tmp_path)
