"""`train.objective: dpo` from a YAML config: preference pairs (vlmtrain's own pair schema and TRL's layout, in a
JSONL file or an HF dataset) train a tiny causal LM with the same per-step loss as vlmtrain.DPOTrainer (itself
equal to TRL's), TRL's metrics land in metrics.jsonl, the checkpoint holds the policy alone; bad settings fail
before any work, naming the key; `vlmtrain data inspect` shows a pair's tokens."""

from __future__ import annotations

import json
import random

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

import vlmtrain
from tests.test_dpo import WORDS, _tokenizer, model_dir  # noqa: F401 (model_dir: the tiny Llama, a fixture)
from vlmtrain import cli, run
from vlmtrain.config import load_run_config
from vlmtrain.errors import ConfigError

DPO_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected")


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _trl_pairs(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": _words(rng, 2, 8), "chosen": " " + _words(rng, 1, 6), "rejected": " " + _words(rng, 1, 6)}
            for _ in range(n)]


def _own_pairs(n: int, seed: int) -> list[dict]:
    """vlmtrain's pair schema: the_cauldron turns, the last one the question alone, then `chosen` / `rejected`;
    every other pair has an earlier turn."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        earlier = [{"user": _words(rng, 1, 3), "assistant": _words(rng, 1, 2)}] if i % 2 else []
        rows.append({"texts": [*earlier, {"user": _words(rng, 1, 5)}], "chosen": _words(rng, 1, 5),
                     "rejected": _words(rng, 1, 5)})
    return rows


def _own_tokens(row: dict, tok) -> dict:
    """The documented tokens of an own-schema pair (as SFT lays out a conversation): BOS, each turn's user text
    and a newline, each earlier answer and EOS; each answer and EOS."""
    def enc(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    prompt = [tok.bos_token_id]
    for turn in row["texts"][:-1]:
        prompt += enc(turn["user"] + "\n") + enc(turn["assistant"]) + [tok.eos_token_id]
    prompt += enc(row["texts"][-1]["user"] + "\n")
    return {"prompt_ids": prompt, "chosen_ids": enc(row["chosen"]) + [tok.eos_token_id],
            "rejected_ids": enc(row["rejected"]) + [tok.eos_token_id]}


TRAIN = {"beta": 0.2, "per_device_eval_batch_size": 4, "learning_rate": 3e-3, "weight_decay": 0.1, "logging_steps": 1, "seed": 7, "report_to": "none",
         "dataloader_num_workers": 0, "disable_tqdm": True}


def _write(tmp_path, rows: list[dict], eval_rows: list[dict], name: str = "pairs") -> tuple:
    train, evals = tmp_path / f"{name}.jsonl", tmp_path / f"{name}-eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals.write_text("".join(json.dumps(r) + "\n" for r in eval_rows))
    return train, evals


def _config(tmp_path, model_path, data: dict, steps: int = 5, **train) -> str:
    cfg = {"model": {"kind": "causal_lm", "pretrained": str(model_path)},
           "data": {"max_length": 14, **data},
           "train": {"output_dir": str(tmp_path / "run"), "objective": "dpo", "save_strategy": "steps",
                     "max_steps": steps, "save_steps": steps, "per_device_train_batch_size": 4, **TRAIN, **train}}
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def config_with(path: str, settings: dict) -> None:
    """Merge ``settings`` (section -> keys) into the YAML config at ``path``."""
    with open(path) as f:
        cfg = yaml.safe_load(f)
    for section, keys in settings.items():
        cfg[section] = {**cfg.get(section, {}), **keys}
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)


def _dpo_trainer(model_path, out, train_rows, eval_rows, peft_config, **settings):
    args = vlmtrain.DPOConfig(str(out), max_length=14, bf16=False, gradient_checkpointing=False,
                              save_strategy="no", use_cpu=True, **TRAIN, **settings)
    trainer = vlmtrain.DPOTrainer(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), args=args,
                                  train_dataset=train_rows, eval_dataset=eval_rows, processing_class=_tokenizer(),
                                  peft_config=peft_config)
    trainer.train()
    return trainer, [e for e in trainer.state.log_history if "loss" in e], trainer.evaluate()


def _hf_dir(tmp_path, rows: list[dict]) -> str:
    from datasets import Dataset

    path = tmp_path / "hf_pairs"
    Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize("layout,loss_type,batch,steps,lora,packing", [
    ("own", "sigmoid", 4, 5, False, False), ("trl", "ipo", 4, 5, False, False), ("trl_hf", "sigmoid", 20, 3, False, False),
    ("own", "sigmoid", 4, 5, True, False), ("trl", "sigmoid", 4, 3, False, True)],
    ids=["own", "trl-ipo", "trl-hf", "own-lora", "trl-packed"])
def test_dpo_from_yaml_equals_dpo_trainer(model_dir, tmp_path, one_thread, layout, loss_type, batch, steps, lora,  # noqa: F811 (the fixture)
                                          packing):
    """`vlmtrain train` with train.objective dpo: per-step loss and rewards/logps equal vlmtrain.DPOTrainer's on the
    same pairs (rel 1e-5), TRL's metric names in metrics.jsonl (eval_ prefixed in evaluation), the checkpoint holds
    the policy alone with DPOTrainer's final weights (with model.lora: the adapter alone, the reference being the
    model with its adapters off, as DPOTrainer's peft_config), `vlmtrain generate` answers from it and `vlmtrain
    eval` of it gives the run's final evaluation again. (The HF dataset is read as a stream, in its own order: a
    batch of all 20 pairs makes each step's loss independent of it.) With data.packing: true each batch's pairs are
    packed into one row (DPOConfig's padding_free) and train as the padded batches of DPOTrainer."""
    rows = _own_pairs(20, 0) if layout == "own" else _trl_pairs(20, 0)
    eval_rows = _own_pairs(8, 1) if layout == "own" else _trl_pairs(8, 1)
    train_file, eval_file = _write(tmp_path, rows, eval_rows)
    if layout == "trl_hf":  # TRL's layout as an HF dataset, unchanged, read by a stream source
        data = {"source": "stream", "sources": [{"kind": "hf", "path": _hf_dir(tmp_path, rows)}],
                "eval_file": str(eval_file)}
    else:
        data = {"source": "jsonl", "train_file": str(train_file), "eval_file": str(eval_file)}
    config = _config(tmp_path, model_dir, data, steps, loss_type=loss_type, per_device_train_batch_size=batch)
    if packing:
        from vlmtrain.models.kinds import get_kind

        packed = get_kind("causal_lm").pairs(load_run_config(config, {"data.packing": True}), _tokenizer())(rows[:4])
        assert packed["input_ids"].shape[0] == 1 and "sequence_index" in packed  # (the 8 sequences in one row)
        config_with(config, {"data": {"packing": True}})
    if lora:
        with open(config) as f:
            settings = yaml.safe_load(f)
        settings["model"]["lora"] = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
        with open(config, "w") as f:
            yaml.safe_dump(settings, f)
    assert cli.main(["train", "--config", config]) == 0

    tok = _tokenizer()
    theirs_rows = [_own_tokens(r, tok) for r in rows] if layout == "own" else rows
    theirs_eval = [_own_tokens(r, tok) for r in eval_rows] if layout == "own" else eval_rows
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer, logs, evaluation = _dpo_trainer(model_dir, tmp_path / "dpo_trainer", theirs_rows, theirs_eval,
                                             peft_config, loss_type=loss_type, per_device_train_batch_size=batch,
                                             max_steps=steps)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    ours = [r for r in lines if "loss" in r]
    assert len(ours) == len(logs) == steps
    for step, (mine, theirs) in enumerate(zip(ours, logs), 1):
        for key in ("loss", *DPO_KEYS):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), (step, key)
    assert ours[-1]["rewards/margins"] != pytest.approx(0.0, abs=1e-4)  # (the policy moved off its reference)
    final_eval = [r for r in lines if "eval_loss" in r][-1]
    for key in ("loss", *DPO_KEYS):
        assert final_eval[f"eval_{key}"] == pytest.approx(evaluation[f"eval_{key}"], rel=1e-5, abs=1e-7), key

    checkpoint = tmp_path / "run" / f"checkpoint-{steps}"
    if lora:  # the adapter alone, as DPOTrainer's policy holds it
        from peft import get_peft_model_state_dict
        from safetensors.torch import load_file

        saved, expected = load_file(checkpoint / "adapter_model.safetensors"), get_peft_model_state_dict(trainer.policy)
        assert not (checkpoint / "model.safetensors").exists() and saved and saved.keys() == expected.keys()
    else:
        saved = dict(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).named_parameters())
        expected = dict(trainer.policy.named_parameters())
    for name, weight in saved.items():
        torch.testing.assert_close(weight, expected[name], rtol=1e-4, atol=1e-5)  # (as tests/test_dpo.py)
    assert cli.main(["generate", "--checkpoint", str(checkpoint), "--prompt", "w1 w2",
                     "--max-new-tokens", "2"]) == 0
    if layout == "own":  # `vlmtrain eval` of the checkpoint: its policy against the reference as configured
        again = run.evaluate(load_run_config(config, {"train.output_dir": str(tmp_path / "eval")}), str(checkpoint))
        for key in ("loss", *DPO_KEYS):
            assert again[f"eval_{key}"] == pytest.approx(final_eval[f"eval_{key}"], rel=1e-5, abs=1e-7), key


@pytest.fixture
def dpo_yaml(tmp_path, model_dir):  # noqa: F811
    train_file, eval_file = _write(tmp_path, _trl_pairs(4, 0), _trl_pairs(2, 1))
    return _config(tmp_path, model_dir, {"source": "jsonl", "train_file": str(train_file),
                                         "eval_file": str(eval_file)})


@pytest.mark.parametrize("overrides,message", [
    ({"train.objective": "ppo"}, "train.objective"),
    ({"train.objective": "sft"}, "train.beta is an option of train.objective: dpo"),
    ({"train.loss_type": "robust"}, r"train.loss_type=\['robust'\]"),
    ({"train.loss_type": ["sigmoid", "ipo"], "train.loss_weights": [1.0]}, "train.loss_weights has 1 weights"),
    ({"train.precompute_ref_log_probs": True, "data.source": "stream", "data.sources": [{"kind": "jsonl", "path": "x.jsonl"}]},
     "train.precompute_ref_log_probs is not available"),
    ({"model.kind": "vlm"}, "train.objective=dpo is not supported for model.kind=vlm yet"),
    ({"data.source": "addition"}, "data.source='addition' has none"),
    ({"data.packing": True, "data.pack_length": 64}, "data.pack_length is not available with train.objective=dpo"),
    ({"train.objective": "reward", "train.beta": 0.1, "model.kind": "hub_vlm", "model.pretrained": "x",
      "model.heads": {"reward": {"type": "reward"}}, "data.packing": True},
     "data.packing is not available with train.objective=reward"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_bad_dpo_settings_fail_before_any_work_naming_the_key(dpo_yaml, overrides, message):
    """One ConfigError when the config is read (no model, no data yet), naming the key. (The config sets
    train.beta 0.2: with train.objective sft that is the key named.)"""
    with pytest.raises(ConfigError, match=message):
        load_run_config(dpo_yaml, overrides)


def test_bad_pairs_are_counted_skips(dpo_yaml):
    """A pair without an answer, with both answers the same, with images (a text model), with an answer in its
    last turn, or whose prompt alone fills data.max_length (keep_start) is skipped and counted by reason; under
    keep_end that prompt is cut from the left and the pair trains."""
    from vlmtrain.models.kinds import get_kind

    long_prompt = {"prompt": " ".join(["w1"] * 20), "chosen": " w2", "rejected": " w3"}
    bad = [{"prompt": "w1", "chosen": " w2"}, {"prompt": "w1", "chosen": " w2", "rejected": " w2"},
           {"prompt": "w1", "chosen": " w2", "rejected": " w3", "images": ["x.png"]},
           {"texts": [{"user": "w1", "assistant": "w2"}], "chosen": "w2", "rejected": "w3"}, long_prompt]
    good = {"texts": [{"user": "w1 w2"}], "chosen": "w3", "rejected": "w4 w5"}
    collate = get_kind("causal_lm").pairs(load_run_config(dpo_yaml), _tokenizer())
    batch = collate([good, *bad])
    assert batch["skipped"] == {"not_a_pair": 1, "identical_answers": 1, "images_for_text_model": 1,
                                "malformed_text": 1, "prompt_fills_max_length": 1}
    assert batch["input_ids"].shape == (2, 6)  # <s> w1 w2 | w4 w5 </s> (the longer answer)
    assert batch["completion_mask"].tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    keep_end = get_kind("causal_lm").pairs(load_run_config(dpo_yaml, {"train.truncation_mode": "keep_end"}),
                                           _tokenizer())
    batch = keep_end([long_prompt])
    assert batch["skipped"] == {} and batch["input_ids"].shape == (2, 14)
    assert batch["completion_mask"][:, -2:].tolist() == [[1, 1], [1, 1]]


def test_data_inspect_shows_a_pairs_tokens(dpo_yaml, tmp_path, capsys):
    """`vlmtrain data inspect` on a pair file: with a DPO run's config, each pair's prompt / chosen / rejected tokens
    as its training tokenizes them; without one, pairs are checked as pairs (an own-schema pair's last turn holds
    the question alone) and a bad pair is counted by its reason. The pairs written as WebDataset shards read the
    same."""
    rows = [{"texts": [{"user": "w1 w2"}], "chosen": "w3", "rejected": "w4 w5"},
            {"prompt": "w6", "chosen": " w7", "rejected": " w7"}]
    path, _ = _write(tmp_path, rows, [], name="inspect")
    assert cli.main(["data", "inspect", str(path)]) == 0
    plain = capsys.readouterr().out
    assert "bad samples: {'identical_answers': 1}" in plain and "malformed" not in plain
    assert cli.main(["data", "inspect", str(path), "--config", dpo_yaml]) == 0
    out = capsys.readouterr().out
    assert "bad samples: {'identical_answers': 1}" in out
    assert "prompt (3): <s> w1 w2" in out and "chosen (2): w3 </s>" in out and "rejected (3): w4 w5 </s>" in out
    assert cli.main(["data", "to-wds", str(path), str(tmp_path / "shards")]) == 0
    assert cli.main(["data", "inspect", str(tmp_path / "shards" / "shard-000000.tar"), "--config", dpo_yaml]) == 0
    shards = capsys.readouterr().out
    assert "bad samples: {'identical_answers': 1}" in shards and "rejected (3): w4 w5 </s>" in shards


def test_dpo_yaml_precompute_and_resume_equal_the_plain_run(model_dir, tmp_path, one_thread):  # noqa: F811
    """train.precompute_ref_log_probs gives the per-step losses and metrics of the run whose reference runs beside
    the policy (rel 1e-6); a run stopped at step 2 and resumed with --train.resume_from_checkpoint gives the
    uninterrupted run's steps 3-4 and final weights, with and without precomputed log-probs (the resumed one reads
    them from the checkpoint's ref_logps.pt)."""
    train_file, eval_file = _write(tmp_path, _own_pairs(16, 0), _own_pairs(4, 1))
    data = {"source": "jsonl", "train_file": str(train_file), "eval_file": str(eval_file)}
    config = _config(tmp_path, model_dir, data, steps=4, save_steps=2)

    def losses(out) -> list[dict]:
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r for r in lines if "loss" in r]

    runs = {}
    for precompute in (False, True):
        out = tmp_path / f"run-{precompute}"
        settings = ["--train.output_dir", str(out), "--train.precompute_ref_log_probs", str(precompute).lower()]
        assert cli.main(["train", "--config", config, *settings]) == 0
        resumed = tmp_path / f"resumed-{precompute}"
        assert cli.main(["train", "--config", config, *settings, "--train.output_dir", str(resumed),
                         "--train.resume_from_checkpoint", str(out / "checkpoint-2")]) == 0
        runs[precompute] = losses(out)
        assert len(runs[precompute]) == 4
        assert [r["step"] for r in losses(resumed)] == [3, 4]
        for mine, theirs in zip(losses(resumed), runs[precompute][2:]):
            for key in ("loss", *DPO_KEYS):
                assert mine[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-8), (mine["step"], key)
        final = AutoModelForCausalLM.from_pretrained(out / "checkpoint-4", dtype=torch.float32).state_dict()
        again = AutoModelForCausalLM.from_pretrained(resumed / "checkpoint-4", dtype=torch.float32).state_dict()
        for name, weight in final.items():
            torch.testing.assert_close(again[name], weight, rtol=1e-6, atol=1e-7)
        assert (out / "checkpoint-2" / "ref_logps.pt").exists() == precompute
    for mine, theirs in zip(runs[True], runs[False]):
        for key in ("loss", *DPO_KEYS):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-8), (mine["step"], key)
