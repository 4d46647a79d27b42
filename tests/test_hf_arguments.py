"""TrainingArguments as transformers 5.x builds them: the same script (HfArgumentParser, derived properties,
serialization, __post_init__ rules and errors, and the arguments vlmtrain now implements) run with transformers'
class and with vlmtrain's, compared."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from tiny import tiny_llama, token_samples

import vlmtrain
import vlmtrain.trainer.step as vstep
from vlmtrain import Trainer, TrainingArguments
from vlmtrain.data.collate import DefaultCollator
from vlmtrain.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

# Arguments a run_*.py script passes on its command line, in transformers' forms.
ARGV = ["--output_dir", "~/vlmtrain-out", "--per_device_train_batch_size", "4", "--learning_rate", "3e-4",
        "--lr_scheduler_type", "cosine", "--lr_scheduler_kwargs", '{"num_cycles": "0.25", "flag": "true"}',
        "--eval_strategy", "steps", "--logging_steps", "0.25", "--save_steps", "10.0", "--report_to", "none",
        "--label_names", "labels", "score_labels", "--gradient_checkpointing", "true", "--bf16", "false",
        "--ddp_find_unused_parameters", "false", "--seed", "7", "--use_cpu"]
COMPARED = ["output_dir", "per_device_train_batch_size", "learning_rate", "lr_scheduler_kwargs", "eval_strategy",
            "do_eval", "eval_steps", "logging_steps", "save_steps", "report_to", "label_names", "gradient_checkpointing",
            "activation_checkpointing", "bf16", "ddp_find_unused_parameters", "seed", "use_cpu", "optim",
            "lr_scheduler_type", "run_name", "include_num_input_tokens_seen", "fsdp", "dataloader_pin_memory"]


def _plain(value):
    return getattr(value, "value", value)  # transformers' enums -> their strings


def _same(ours, hf, names=COMPARED) -> None:
    assert {n: _plain(getattr(ours, n)) for n in names} == {n: _plain(getattr(hf, n)) for n in names}


def test_hf_argument_parser_reads_a_command_line_as_transformers_does():
    ours, = transformers.HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(ARGV)
    hf, = transformers.HfArgumentParser(transformers.TrainingArguments).parse_args_into_dataclasses(ARGV)
    assert isinstance(ours, TrainingArguments)
    _same(ours, hf)
    assert ours.lr_scheduler_kwargs == {"num_cycles": 0.25, "flag": True}  # JSON string, values converted
    assert ours.output_dir.endswith("/vlmtrain-out") and "~" not in ours.output_dir


def test_hf_argument_parser_reads_dicts_and_json_files(tmp_path):
    values = {"output_dir": str(tmp_path), "max_steps": 5, "eval_strategy": "epoch", "report_to": ["tensorboard"],
              "lr_scheduler_kwargs": {"min_lr_rate": 0.1}, "lr_scheduler_type": "cosine_with_min_lr",
              "include_num_input_tokens_seen": True, "use_cpu": True}
    ours, = transformers.HfArgumentParser(TrainingArguments).parse_dict(values)
    hf, = transformers.HfArgumentParser(transformers.TrainingArguments).parse_dict(values)
    _same(ours, hf)
    path = tmp_path / "args.json"
    path.write_text(json.dumps(values))
    from_file, = transformers.HfArgumentParser(TrainingArguments).parse_json_file(str(path))
    assert from_file.to_dict() == ours.to_dict()


def test_derived_properties_and_serialization_equal_transformers(tmp_path):
    kw = dict(output_dir=str(tmp_path), per_device_train_batch_size=3, per_device_eval_batch_size=5, use_cpu=True,
              lr_scheduler_kwargs={"dtype": torch.bfloat16, "inner": {"dtype": torch.float32}})
    ours, hf = TrainingArguments(**kw), transformers.TrainingArguments(**kw)
    for name in ("device", "n_gpu", "world_size", "process_index", "local_process_index", "should_save",
                 "should_log", "train_batch_size", "eval_batch_size", "ddp_timeout_delta", "parallel_mode"):
        assert getattr(ours, name) == getattr(hf, name), name
    assert ours.get_process_log_level() == hf.get_process_log_level()
    with ours.main_process_first(desc="tokenize"):
        pass
    d, hd = ours.to_dict(), hf.to_dict()
    assert set(hd) <= set(d)  # every transformers name (vlmtrain adds its own)
    differ = {k for k in hd if d[k] != hd[k]}
    assert differ == {"accelerator_config"}  # accelerate's config object (vlmtrain: None; refused when set)
    assert d["lr_scheduler_kwargs"] == {"dtype": "bfloat16", "inner": {"dtype": "float32"}} == hd["lr_scheduler_kwargs"]
    assert d["hub_token"] == "<HUB_TOKEN>"
    assert json.loads(ours.to_json_string()) == json.loads(json.dumps(d))
    sd, hsd = ours.to_sanitized_dict(), hf.to_sanitized_dict()
    assert {k: sd[k] for k in hsd if k != "accelerator_config"} == {k: v for k, v in hsd.items()
                                                                    if k != "accelerator_config"}


@pytest.mark.parametrize("kwargs", [
    {},  # defaults: output_dir trainer_output, optim adamw_torch_fused, report_to [], eval_steps None
    {"output_dir": None},
    {"eval_strategy": "steps"},  # do_eval set, eval_steps from logging_steps
    {"eval_strategy": "epoch", "report_to": ["none"]},
    {"output_dir": "~/x", "report_to": "tensorboard", "logging_steps": 10.0},
    {"lr_scheduler_kwargs": '{"power": "2", "lr_end": "1e-7"}', "lr_scheduler_type": "polynomial"},
    {"activation_checkpointing_kwargs": '{"use_reentrant": "false"}', "activation_checkpointing": True},
    {"load_best_model_at_end": True, "eval_strategy": "steps", "save_steps": 10, "eval_steps": 5},
    {"include_num_input_tokens_seen": False, "save_strategy": "no"},
])
def test_post_init_resolves_values_as_transformers(kwargs):
    kwargs = {"use_cpu": True, **kwargs}
    ours, hf = TrainingArguments(**kwargs), transformers.TrainingArguments(**kwargs)
    names = ["output_dir", "optim", "report_to", "do_eval", "eval_steps", "logging_steps", "save_steps",
             "lr_scheduler_kwargs", "activation_checkpointing_kwargs", "metric_for_best_model", "greater_is_better",
             "include_num_input_tokens_seen", "run_name", "dataloader_pin_memory"]
    _same(ours, hf, names)


@pytest.mark.parametrize("kwargs,message", [
    ({"logging_steps": 10.5}, "logging_steps must be an integer if bigger than 1"),
    ({"eval_strategy": "steps", "eval_steps": 2.5}, "eval_steps must be an integer if bigger than 1"),
    ({"save_steps": 100.5}, "save_steps must be an integer if bigger than 1"),
    ({"torch_empty_cache_steps": 0}, "torch_empty_cache_steps` must be an integer bigger than 0"),
])
def test_refused_values_are_refused_by_both(kwargs, message):
    with pytest.raises(ValueError, match=message):
        transformers.TrainingArguments(use_cpu=True, **kwargs)
    with pytest.raises(ConfigError, match=message.replace("`", "")):
        TrainingArguments(**kwargs)


def test_save_strategy_best_needs_metric_for_best_model_in_both(tmp_path):
    kw = dict(output_dir=str(tmp_path), save_strategy="best", eval_strategy="steps", use_cpu=True)
    with pytest.raises(ValueError, match="metric_for_best_model"):  # (transformers: when the Trainer is built)
        transformers.Trainer(model=tiny_llama(), args=transformers.TrainingArguments(**kw),
                             eval_dataset=token_samples(4))
    with pytest.raises(ConfigError, match="save_strategy='best' needs metric_for_best_model"):
        TrainingArguments(**kw)


# -- arguments vlmtrain implements now: the same run under both trainers ------------------------------------------
DATA = token_samples(16, seed=3)  # 4..12 tokens: padded batches


def _run(framework: str, out, **kw):
    base = dict(output_dir=str(out), report_to="none", disable_tqdm=True, per_device_train_batch_size=4,
                learning_rate=1e-3, logging_steps=1, max_steps=4, save_strategy="no", seed=0, use_cpu=True,
                train_sampling_strategy="sequential")
    base.update(kw)
    if framework == "hf":
        trainer = transformers.Trainer(model=tiny_llama(0), args=transformers.TrainingArguments(**base),
                                       train_dataset=DATA, data_collator=DefaultCollator(0))
    else:
        trainer = Trainer(tiny_llama(0), TrainingArguments(**base), train_dataset=DATA)
    trainer.train()
    return trainer


def _rows(trainer, key: str) -> dict[int, float]:
    return {h["step"]: h[key] for h in trainer.state.log_history if key in h and "loss" in h}  # step rows


def test_label_smoothing_losses_equal_transformers(tmp_path):
    hf, ours = (_run(f, tmp_path / f, label_smoothing_factor=0.1) for f in ("hf", "ours"))
    plain = _run("ours", tmp_path / "plain")
    assert list(_rows(ours, "loss")) == [1, 2, 3, 4]
    assert _rows(ours, "loss") == pytest.approx(_rows(hf, "loss"), rel=1e-6)
    assert abs(_rows(ours, "loss")[1] - _rows(plain, "loss")[1]) > 1e-4  # smoothing changed the loss (by 6e-4)


@pytest.mark.parametrize("mode", ["all", "non_padding", True])
def test_num_input_tokens_seen_equals_transformers(tmp_path, mode):
    hf, ours = (_run(f, tmp_path / f, include_num_input_tokens_seen=mode, gradient_accumulation_steps=2)
                for f in ("hf", "ours"))
    assert _rows(ours, "num_input_tokens_seen") == _rows(hf, "num_input_tokens_seen")
    assert ours.state.num_input_tokens_seen == hf.state.num_input_tokens_seen > 0
    assert "num_input_tokens_seen" not in _run("ours", tmp_path / "off").state.log_history[0]


def test_torch_empty_cache_steps_empties_at_the_steps_transformers_does(tmp_path, monkeypatch):
    calls = {"hf": [], "ours": []}
    monkeypatch.setattr(transformers.trainer, "clear_device_cache", lambda *a, **k: calls["hf"].append(1))
    monkeypatch.setattr(vstep, "empty_device_cache", lambda: calls["ours"].append(1))
    for framework in calls:
        _run(framework, tmp_path / framework, torch_empty_cache_steps=2, gradient_accumulation_steps=2, max_steps=3)
    assert len(calls["ours"]) == len(calls["hf"]) == 4  # the micro-batches of steps 1 and 3 (global_step 0 and 2)


def test_use_cpu_trains_on_the_cpu_without_pinned_memory(tmp_path):
    trainer = _run("ours", tmp_path, max_steps=1)
    assert trainer.device == trainer.args.device == torch.device("cpu")
    assert trainer.args.dataloader_pin_memory is False and trainer.args.n_gpu == 0


def test_logging_steps_as_a_ratio_of_max_steps(tmp_path):
    hf, ours = (_run(f, tmp_path / f, logging_steps=0.5, max_steps=4) for f in ("hf", "ours"))
    assert list(_rows(ours, "loss")) == list(_rows(hf, "loss")) == [2, 4]


def test_unsupported_sampling_strategies_name_the_alternative():
    with pytest.raises(ConfigError, match="train_sampling_strategy='group_by_length' is not supported by vlmtrain; "
                                          "use data.packing"):
        TrainingArguments(train_sampling_strategy="group_by_length")
    assert vlmtrain.TrainingArguments(train_sampling_strategy="sequential").train_sampling_strategy == "sequential"


# -- the migration guide's table ---------------------------------------------------------------------------------
def _gen_migrating():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "gen_migrating.py"
    spec = importlib.util.spec_from_file_location("gen_migrating", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_migrating"] = module
    spec.loader.exec_module(module)
    return module


def test_migration_table_lists_every_transformers_argument_and_is_current():
    import dataclasses

    from vlmtrain.compat.arguments import DIFFERENT, IGNORED, REFUSED, ImplementedArguments

    gen = _gen_migrating()
    page = gen.PAGE.read_text()
    assert gen.render(page) == page, "docs/migrating.md is stale: run python scripts/gen_migrating.py"
    names = [f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init]
    rows = [line.split("`")[1] for line in page.split(gen.BEGIN)[1].split(gen.END)[0].splitlines()
            if line.startswith("| `")]
    assert rows == names  # every transformers field, once, in transformers' order
    implemented = {f.name for f in dataclasses.fields(ImplementedArguments)}
    assert set(DIFFERENT) <= implemented and not (set(REFUSED) | set(IGNORED)) & implemented
    # a refused argument's row says what to do instead, as its error does
    with pytest.raises(ConfigError, match="fp16=True is not supported by vlmtrain; use bf16=True"):
        TrainingArguments(fp16=True)
    assert gen.status("fp16") == ("refused", f"Default only; otherwise an error: {REFUSED['fp16']}.")


class BatchAccuracy:
    """A compute_metrics for batch_eval_metrics: next-token accuracy summed over batches, and every call's rows."""

    def __init__(self) -> None:
        self.calls, self.right, self.total = [], 0, 0

    def __call__(self, prediction, compute_result: bool):
        preds, labels = torch.as_tensor(prediction.predictions), torch.as_tensor(prediction.label_ids)
        self.calls.append((type(prediction.predictions).__name__, len(preds), compute_result))
        mask = labels[:, 1:] != -100
        self.right += int(((preds[:, :-1] == labels[:, 1:]) & mask).sum())
        self.total += int(mask.sum())
        if compute_result:
            return {"accuracy": self.right / self.total}


def test_batch_eval_metrics_calls_compute_metrics_per_batch_as_transformers(tmp_path):
    evals = token_samples(10, seed=4, min_len=8, max_len=8)  # batches of 4, 4, 2
    kw = dict(output_dir=str(tmp_path), report_to="none", disable_tqdm=True, per_device_eval_batch_size=4,
              batch_eval_metrics=True, use_cpu=True)
    results = {}
    for name, trainer_cls, args_cls in (("hf", transformers.Trainer, transformers.TrainingArguments),
                                        ("ours", Trainer, TrainingArguments)):
        metric = BatchAccuracy()
        trainer = trainer_cls(model=tiny_llama(0), args=args_cls(**kw), eval_dataset=evals, compute_metrics=metric,
                              preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1))
        results[name] = (trainer.evaluate()["eval_accuracy"], metric.calls)
    assert results["ours"] == results["hf"]
    assert results["ours"][1] == [("Tensor", 4, False), ("Tensor", 4, False), ("Tensor", 2, True)]
    with pytest.raises(ValueError, match="must take a `compute_result` boolean argument"):
        Trainer(tiny_llama(0), TrainingArguments(**kw), compute_metrics=lambda prediction: {})
