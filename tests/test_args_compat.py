"""Drop-in TrainingArguments: every transformers 5.24 argument name is accepted; the ones vlmtrain implements
behave as in transformers, the rest refuse a non-default value with a message naming the key."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import transformers
import yaml
from tiny import TwoLossModel, tiny_llama, token_samples

import vlmtrain.trainer.distributed as vdist
from vlmtrain import Trainer, TrainingArguments
from vlmtrain.compat.arguments import IGNORED, REFUSED, WHEN_USED, ImplementedArguments
from vlmtrain.compat.arguments_fields import TransformersOnlyArguments
from vlmtrain.config import load_run_config, parse_run_config
from vlmtrain.errors import ConfigError

TRANSFORMERS_FIELDS = [f for f in dataclasses.fields(transformers.TrainingArguments) if f.init]
TRANSFORMERS_ONLY = dataclasses.fields(TransformersOnlyArguments)


def _transformers_default(f: dataclasses.Field) -> object:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _non_default(f: dataclasses.Field) -> object:
    """A value other than the field's default that its type accepts."""
    d = f.default
    if isinstance(d, bool):
        return not d
    if isinstance(d, (int, float)):
        return d + 1
    if isinstance(d, str):
        return "all" if d == "no" else f"{d}_x" if d else "underflow_overflow"
    hint = str(f.type)
    if "bool" in hint and "str" not in hint:
        return True
    return 3 if hint.startswith(("int", "float")) else "x"


def _args(tmp_path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path), save_strategy="no", disable_tqdm=True, logging_steps=1, max_grad_norm=0.0,
                learning_rate=1e-3, report_to="none")
    return TrainingArguments(**{**base, **kw})


# -- every name is accepted ----------------------------------------------------------------------------------------
def test_every_transformers_name_is_a_keyword_and_each_is_implemented_or_in_one_table():
    ours = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert {f.name for f in TRANSFORMERS_FIELDS} - ours == set()
    implemented = {f.name for f in dataclasses.fields(ImplementedArguments)}
    only = {f.name for f in TRANSFORMERS_ONLY}
    assert implemented & only == set()  # a name in both would silently take the second default
    assert set(REFUSED) | set(IGNORED) == only and set(REFUSED) & set(IGNORED) == set()
    # Every transformers default constructs, all names at once.
    args = TrainingArguments(**{f.name: _transformers_default(f) for f in TRANSFORMERS_FIELDS})
    hf = transformers.TrainingArguments(use_cpu=True)  # (the same defaults: output_dir None, report_to 'none')
    assert args.output_dir == hf.output_dir == "trainer_output" and args.report_to == hf.report_to == []
    assert args.fsdp is hf.fsdp is None


def test_every_transformers_name_is_a_yaml_train_key_and_a_cli_option(tmp_path):
    train = {f.name: _transformers_default(f) for f in TRANSFORMERS_FIELDS}
    train.update(output_dir=str(tmp_path / "out"), max_steps=2)
    doc = {"model": {"kind": "causal_lm", "config": {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1}},
           "data": {"source": "addition", "num_train": 16, "num_eval": 4}, "train": train}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    cfg = load_run_config(path)
    assert cfg.train.max_steps == 2 and cfg.train.label_names is None and cfg.train.push_to_hub is False
    cfg = parse_run_config(["--config", str(path), "--train.gradient_checkpointing", "true",
                            "--train.do_eval", "true", "--train.ddp_find_unused_parameters", "false"])
    assert cfg.train.activation_checkpointing is True and cfg.train.ddp_find_unused_parameters is False
    with pytest.raises(ConfigError, match=r"fp16=True is not supported by vlmtrain; use bf16"):
        load_run_config(path, {"train.fp16": True})


def test_seed_000_arguments_construct():
    seed_args = dict(
        output_dir="runs/scorer", per_device_train_batch_size=4, per_device_eval_batch_size=4, logging_steps=100,
        save_steps=2000, save_strategy="steps", eval_steps=2000, eval_strategy="steps", metric_for_best_model="loss",
        greater_is_better=False, report_to="wandb", max_steps=100000, learning_rate=1e-5,
        ddp_find_unused_parameters=False, optim="adamw_torch", lr_scheduler_type="polynomial",
        lr_scheduler_kwargs={"power": 3.0}, warmup_steps=500, save_total_limit=5, weight_decay=0.02,
        label_names=["score_labels", "type_labels"])
    args = TrainingArguments(**seed_args)  # unchanged, wandb included
    assert args.report_to == ["wandb"]
    assert args.label_names == ["score_labels", "type_labels"]
    assert args.ddp_kwargs() == {"find_unused_parameters": False}


# -- names vlmtrain does not implement ---------------------------------------------------------------------------
@pytest.mark.parametrize("f", [f for f in TRANSFORMERS_ONLY if f.name in REFUSED and f.name not in WHEN_USED],
                         ids=lambda f: f.name)
def test_a_refused_name_at_a_non_default_value_names_the_key_and_what_to_do(f):
    """(WHEN_USED names, refused only while their feature is on: test_args_when_used.py)"""
    value = _non_default(f)
    with pytest.raises(ConfigError) as e:
        TrainingArguments(**{f.name: value})
    assert str(e.value).startswith(f"{f.name}={value!r} is not supported by vlmtrain; {REFUSED[f.name]}")


@pytest.mark.parametrize("f", [f for f in TRANSFORMERS_ONLY if f.name in IGNORED], ids=lambda f: f.name)
def test_an_ignored_name_takes_any_value(f):
    value = _non_default(f)
    assert getattr(TrainingArguments(**{f.name: value}), f.name) == value


def test_values_that_leave_a_feature_off_count_as_its_default():
    args = TrainingArguments(hub_private_repo=False, debug=[], fsdp_config={}, trackio_static_space_id=False)
    assert args.hub_private_repo is False and args.debug == []


@pytest.mark.parametrize("value,on", [("full_shard auto_wrap", True), (["full_shard"], True), ("", False),
                                      (None, None), (True, True)])
def test_fsdp_accepts_transformers_values(value, on):
    assert TrainingArguments(fsdp=value).fsdp is on


@pytest.mark.parametrize("value,message", [("offload", "'offload' is not supported by vlmtrain; CPU offload"),
                                           ("full_shard shard_grad_op", "reshards parameters after forward"),
                                           ("full_shardd", "unknown option 'full_shardd'")])
def test_fsdp_refuses_options_vlmtrain_lacks(value, message):
    with pytest.raises(ConfigError, match=rf"^fsdp={value!r}: .*{message}"):
        TrainingArguments(fsdp=value)


@pytest.mark.parametrize("name", ["neptune", "comet_ml", "clearml"])
def test_report_to_trackers_vlmtrain_lacks_are_refused_with_the_implemented_ones(name):
    with pytest.raises(ConfigError, match=rf"report_to='{name}' is not implemented .* none, jsonl, tensorboard, "
                                          r"wandb, mlflow, trackio, all"):
        TrainingArguments(report_to=["tensorboard", name])


def test_tracker_fields_are_accepted():
    args = TrainingArguments(report_to=["wandb", "mlflow", "trackio"], project="p", trackio_space_id="u/s",
                             trackio_bucket_id="u/b", trackio_static_space_id=False)
    assert args.report_to == ["wandb", "mlflow", "trackio"] and args.project == "p"


def test_report_to_and_torch_compile_forms():
    assert TrainingArguments(report_to=None).report_to == []  # (transformers: [None])
    assert TrainingArguments(report_to="none").report_to == transformers.TrainingArguments(report_to="none").report_to
    assert TrainingArguments(report_to=["none"]).report_to == []
    assert TrainingArguments(report_to="tensorboard").report_to == ["tensorboard"]
    with pytest.raises(ConfigError, match="Did you mean 'tensorboard'"):
        TrainingArguments(report_to="tensorbord")
    assert TrainingArguments(torch_compile_backend="aot_eager").torch_compile is True
    assert TrainingArguments(torch_compile_mode="max-autotune").torch_compile is True


def test_include_for_metrics_is_refused_until_implemented():
    with pytest.raises(ConfigError, match=r"include_for_metrics=\['loss'\] is not supported by vlmtrain yet"):
        TrainingArguments(include_for_metrics=["loss"])
    with pytest.raises(ConfigError, match="include_for_metrics='logits' is not one of"):
        TrainingArguments(include_for_metrics=["logits"])


def test_gradient_checkpointing_is_transformers_alias_of_activation_checkpointing():
    args = TrainingArguments(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    assert args.activation_checkpointing is True
    assert args.activation_checkpointing_kwargs == {"use_reentrant": False}
    args = TrainingArguments(activation_checkpointing=True, gradient_checkpointing=False)  # the new name wins
    assert args.activation_checkpointing is args.gradient_checkpointing is True
    assert dataclasses.replace(args).activation_checkpointing is True


def test_the_trainers_own_arguments_get_transformers_defaults_refusals_and_derived_values():
    # vlmtrain.compat fills them in; what a script sees on vlmtrain.TrainingArguments is transformers' behaviour
    from vlmtrain import TrainingArguments as CoreArguments
    from vlmtrain.compat import arguments_methods

    ours, hf = CoreArguments(use_cpu=True), transformers.TrainingArguments(use_cpu=True)
    assert (ours.gradient_checkpointing, ours.do_eval) == (hf.gradient_checkpointing, hf.do_eval) == (False, False)
    assert CoreArguments(use_cpu=True, eval_strategy="epoch").do_eval is True
    assert (ours.n_gpu, ours.world_size, ours.should_save, ours.to_dict()["use_cpu"]) == (0, 1, True, True)
    for sampler in ("group_by_length", "batch_rebalance"):
        with pytest.raises(ConfigError, match=f"train_sampling_strategy='{sampler}' is not supported by vlmtrain; "
                                              "use data.packing"):
            CoreArguments(train_sampling_strategy=sampler)

    class Own:  # a class's own definition of a transformers name is kept
        world_size = 5
    arguments_methods.add_to(Own)
    assert Own.world_size == 5 and callable(Own.to_json_string)


# -- names vlmtrain implements -------------------------------------------------------------------------------------
def test_gradient_checkpointing_enables_checkpointing_and_keeps_the_losses(tmp_path, one_thread):
    data = token_samples(24, seed=2)
    runs = {}
    for on in (False, True):
        args = _args(tmp_path / str(on), max_steps=4, per_device_train_batch_size=4, gradient_checkpointing=on)
        trainer = Trainer(tiny_llama(0), args, train_dataset=data)
        assert trainer.model.is_activation_checkpointing is on
        trainer.train()
        runs[on] = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert len(runs[True]) == 4
    assert runs[True] == pytest.approx(runs[False], rel=1e-5, abs=1e-6)


def test_gradient_checkpointing_reaches_a_transformers_model_inside_a_wrapper(tmp_path):
    class WithHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm, self.head = tiny_llama(0), torch.nn.Linear(32, 1)

    model = WithHead()
    Trainer(model, _args(tmp_path, gradient_checkpointing=True))
    assert model.lm.is_activation_checkpointing


def test_gradient_checkpointing_on_a_model_without_support_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="needs a model with activation_checkpointing_enable.*TwoLossModel"):
        Trainer(TwoLossModel(), _args(tmp_path, gradient_checkpointing=True))

    class NoCheckpointing(transformers.LlamaForCausalLM):
        supports_gradient_checkpointing = False

    model = NoCheckpointing(tiny_llama(0).config)
    with pytest.raises(ConfigError, match="NoCheckpointing does not support activation checkpointing"):
        Trainer(model, _args(tmp_path, activation_checkpointing=True))


def test_eval_on_start_logs_an_evaluation_at_step_0(tmp_path, one_thread):
    data = token_samples(16, seed=3)
    args = _args(tmp_path, max_steps=2, per_device_train_batch_size=4, eval_on_start=True)
    trainer = Trainer(tiny_llama(0), args, train_dataset=data, eval_dataset=data[:8])
    trainer.train()
    history = trainer.state.log_history
    assert "eval_loss" in history[0] and history[0]["step"] == 0
    assert [h["step"] for h in history if "eval_loss" in h] == [0]  # eval_strategy='no': only the start
    assert any("loss" in h and h["step"] == 1 for h in history[1:])
    with pytest.raises(ValueError, match="eval_on_start=True needs an eval_dataset"):
        Trainer(tiny_llama(0), args, train_dataset=data)


def test_dataloader_worker_options_pass_through(tmp_path):
    data = token_samples(8)
    args = _args(tmp_path, dataloader_num_workers=1, dataloader_persistent_workers=True,
                 dataloader_prefetch_factor=3, dataloader_multiprocessing_context="spawn")
    loader = Trainer(tiny_llama(0), args, train_dataset=data).get_train_dataloader()
    assert loader.persistent_workers is True and loader.prefetch_factor == 3
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    # Without workers torch refuses these options: they are left out (persistent_workers) or refused early.
    args = _args(tmp_path, dataloader_persistent_workers=True)
    assert Trainer(tiny_llama(0), args, train_dataset=data).get_train_dataloader().persistent_workers is False
    with pytest.raises(ConfigError, match="dataloader_prefetch_factor needs dataloader_num_workers > 0"):
        _args(tmp_path, dataloader_num_workers=0, dataloader_prefetch_factor=2)
    # 'auto' (a YAML config's default) has no workers on this CPU machine: the worker options are left out there
    args = _args(tmp_path, dataloader_num_workers="auto", dataloader_prefetch_factor=2,
                 dataloader_persistent_workers=True)
    loader = Trainer(tiny_llama(0), args, train_dataset=data).get_train_dataloader()
    assert (loader.num_workers, loader.prefetch_factor, loader.persistent_workers) == (0, None, False)


@pytest.mark.filterwarnings("ignore:`broadcast_buffers` is deprecated")
def test_ddp_arguments_reach_distributed_data_parallel(tmp_path, monkeypatch):
    args = _args(tmp_path, max_steps=1, ddp_find_unused_parameters=True, ddp_bucket_cap_mb=5,
                 ddp_broadcast_buffers=False, ddp_static_graph=False)
    # The Trainer hands them to wrap_model ...
    seen = {}
    real_wrap = vdist.wrap_model

    def recording_wrap(model, device, fsdp=False, bf16=False, ddp_kwargs=None, sharding=None):
        seen.update(ddp_kwargs)
        return real_wrap(model, device, fsdp, bf16, ddp_kwargs, sharding)

    monkeypatch.setattr(vdist, "wrap_model", recording_wrap)
    Trainer(tiny_llama(0), args, train_dataset=token_samples(8)).train()
    assert seen == {"find_unused_parameters": True, "bucket_cap_mb": 5, "broadcast_buffers": False,
                    "static_graph": False}
    # ... and wrap_model hands them to DDP (a real one, over a one-process gloo group posing as two).
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        monkeypatch.setattr(vdist, "world_size", lambda: 2)
        ddp = vdist.wrap_model(torch.nn.Linear(2, 2), torch.device("cpu"), ddp_kwargs=args.ddp_kwargs())
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
        assert ddp.find_unused_parameters is True and ddp.broadcast_buffers is False
        assert ddp.bucket_bytes_cap == 5 * 1024 * 1024
    finally:
        torch.distributed.destroy_process_group()


def test_tf32_without_a_gpu_warns_and_trains(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(tiny_llama(0), _args(tmp_path, tf32=True))
    assert any("tf32=True has no effect without a CUDA device" in str(w.message) for w in caught)


# Each range-checked argument, a value outside its range and the exact message (one table in trainer/args.py)
OUT_OF_RANGE = [
    ("per_device_train_batch_size", 0, "per_device_train_batch_size must be >= 1, got 0."),
    ("per_device_eval_batch_size", 0, "per_device_eval_batch_size must be >= 1, got 0."),
    ("gradient_accumulation_steps", 0, "gradient_accumulation_steps must be >= 1, got 0."),
    ("learning_rate", -1.0, "learning_rate must be >= 0, got -1.0."),
    ("warmup_ratio", 1.0, "warmup_ratio must be in [0, 1), got 1.0."),
    ("warmup_steps", -1, "warmup_steps must be >= 0, got -1."),
    ("max_grad_norm", -0.5, "max_grad_norm must be >= 0 (0 disables clipping), got -0.5."),
    ("save_total_limit", 0, "save_total_limit must be >= 1, or None to keep every checkpoint."),
    ("max_eval_batches", 0, "max_eval_batches must be >= 1, or None for the whole eval set."),
    ("peak_tflops", 0.0, "peak_tflops must be > 0 (the device's peak TFLOP/s), or None; got 0.0."),
    ("preemption_grace_s", 0, "preemption_grace_s must be >= 1 second, got 0."),
    ("ddp_timeout", 0, "ddp_timeout must be >= 1 second, got 0."),
    ("max_consecutive_nonfinite_steps", -1, "max_consecutive_nonfinite_steps must be >= 0 (0: never stop)."),
    ("max_bad_sample_fraction", 0.0, "max_bad_sample_fraction must be in (0, 1], got 0.0."),
    ("label_smoothing_factor", 1.0, "label_smoothing_factor must be in [0, 1), got 1.0."),
]


@pytest.mark.parametrize("name,value,message", OUT_OF_RANGE, ids=[case[0] for case in OUT_OF_RANGE])
def test_an_argument_out_of_its_range_is_one_message_naming_it(name, value, message):
    with pytest.raises(ConfigError) as e:
        TrainingArguments(output_dir="x", report_to="none", **{name: value})
    assert str(e.value) == message


def test_the_range_checks_are_one_table():
    from vlmtrain.trainer import args

    assert [name for section in args.RANGES.values() for name in section] == [name for name, _, _ in OUT_OF_RANGE]
