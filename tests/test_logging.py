"""metrics.jsonl schema, TensorBoard, progress output, bf16 and torch.compile runs."""

from __future__ import annotations

import json
import math

import pytest
import torch
from optional_extras import requires
from tiny import tiny_llama, token_samples

from vlmtrain import Trainer, TrainingArguments


def _train(tmp_path, **kw):
    args = dict(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, logging_steps=2,
                save_strategy="no", learning_rate=1e-3, disable_tqdm=True)
    args.update(kw)
    trainer = Trainer(tiny_llama(), TrainingArguments(**args), train_dataset=token_samples(16),
                      eval_dataset=token_samples(8, seed=3))
    return trainer, trainer.train()


def test_metrics_jsonl_schema(tmp_path):
    _train(tmp_path, eval_strategy="steps", eval_steps=2)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    eval_rows = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in train_rows] == [2, 4] and [r["step"] for r in eval_rows] == [2, 4]
    for r in train_rows:
        assert {"step", "epoch", "loss", "learning_rate", "grad_norm", "samples_per_second", "tokens_per_second",
                "data_wait_fraction"} <= set(r)
        assert 0 <= r["data_wait_fraction"] <= 1 and r["tokens_per_second"] > 0 and math.isfinite(r["loss"])
    assert rows[-1]["train_runtime"] > 0 and "train_loss" in rows[-1]


@requires("tensorboard", "tensorboard")
def test_tensorboard_when_requested(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _train(tmp_path, report_to="tensorboard", run_name="tb", eval_strategy="steps", eval_steps=2)
    acc = EventAccumulator(str(tmp_path / "runs" / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/learning_rate", "eval/loss"} <= set(tags)
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4]


def test_progress_bar_and_printer(tmp_path, capsys):
    _train(tmp_path / "bar", disable_tqdm=False)
    err = capsys.readouterr().err
    assert "train" in err and "loss=" in err and "lr=" in err
    _train(tmp_path / "print", disable_tqdm=True)
    out = capsys.readouterr().out
    assert "'loss'" in out and "'learning_rate'" in out


def _linear_output_dtypes(trainer) -> dict[bool, set]:
    """The dtypes a Linear (the first MLP's down_proj) outputs, by module.training (True: training steps)."""
    seen: dict[bool, set] = {True: set(), False: set()}
    linear = trainer.model.model.layers[0].mlp.down_proj
    linear.register_forward_hook(lambda module, args, output: seen[module.training].add(output.dtype))
    return seen


@pytest.mark.parametrize("bf16", [True, False])
def test_bf16_autocast_trains(tmp_path, bf16):
    """bf16: the training steps' and the evaluation's matmuls compute in bfloat16 (autocast) from float32 master
    weights; without it they stay float32."""
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, logging_steps=2,
                             save_strategy="no", learning_rate=1e-3, disable_tqdm=True, bf16=bf16,
                             eval_strategy="steps", eval_steps=2)
    trainer = Trainer(tiny_llama(), args, train_dataset=token_samples(8), eval_dataset=token_samples(4, seed=3))
    seen = _linear_output_dtypes(trainer)
    out = trainer.train()
    expected = torch.bfloat16 if bf16 else torch.float32
    assert seen == {True: {expected}, False: {expected}}  # training steps and the evaluation
    assert math.isfinite(out.training_loss)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # master weights stay fp32


class _ModelRecordingTrainer(Trainer):
    """Records the type of the model each training step runs."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.step_models.append(type(model))
        return super().training_step(model, inputs, num_items_in_batch)


@pytest.mark.slow
@pytest.mark.parametrize("compile", [True, False])
def test_torch_compile_trains(tmp_path, compile):
    """torch_compile: the training steps run the torch.compile wrapper of the model, and dynamo captured its
    graphs (inductor, the default backend); without it the steps run the model itself and nothing is compiled."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, logging_steps=2,
                             save_strategy="no", learning_rate=1e-3, disable_tqdm=True, torch_compile=compile)
    trainer = _ModelRecordingTrainer(tiny_llama(), args, train_dataset=token_samples(8))
    trainer.step_models = []
    out = trainer.train()
    assert out.global_step == 2 and math.isfinite(out.training_loss)
    compiled = torch._dynamo.eval_frame.OptimizedModule
    assert trainer.step_models == [compiled if compile else type(trainer.model)] * 2
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0 if compile else graphs == 0
    torch._dynamo.reset()


def test_torch_compile_without_the_compile_model_part_compiles_the_whole_model(tmp_path):
    """The trainer core's own torch_compile, where the compile_model part (models/speed/training_prep.py) is the core's
    default: torch.compile of the whole model, even of one marked for compilation layer by layer."""
    import dataclasses

    from vlmtrain.models.protocol import REGIONAL_COMPILE_ATTR
    from vlmtrain.trainer import TrainerParts

    torch._dynamo.reset()
    model = tiny_llama()
    setattr(model, REGIONAL_COMPILE_ATTR, True)  # (the part would compile its decoder layers in place instead)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4,
                             save_strategy="no", disable_tqdm=True, torch_compile_backend="eager")
    core_compile = dataclasses.replace(_ModelRecordingTrainer.parts, compile_model=TrainerParts().compile_model)
    trainer = _ModelRecordingTrainer(model, args, train_dataset=token_samples(4), parts=core_compile)
    trainer.step_models = []
    trainer.train()
    assert trainer.step_models == [torch._dynamo.eval_frame.OptimizedModule]
    torch._dynamo.reset()


def test_a_windows_rates_come_from_the_logging_layer():
    """The window_stats part (logging/throughput.py's Throughput) counts samples and skipped samples; the rates
    (here the pack fill of collated rows) come from its WindowRates, and without them are not logged."""
    from vlmtrain import Trainer
    from vlmtrain.logging.throughput import Throughput

    assert Trainer.parts.window_stats is Throughput
    batch = {"skipped": {"bad_image": 1},
             "pack_stats": {"samples": 3, "tokens": 30, "rows": 2, "capacity": 40, "images": 4}}
    throughput = Throughput()
    throughput.add_batch(batch, 0.0)
    figures = throughput.compute()
    assert (figures["pack_fill"], figures["padding_fraction"], figures["images_per_pack"]) == (0.75, 0.25, 2.0)
    assert figures["tokens_per_second"] > 0 and figures["skipped_bad_image"] == 1 and throughput.samples == 3
    bare = Throughput(make_rates=None)
    bare.add_batch(batch, 0.0)
    assert bare.compute() == {"skipped_bad_image": 1} and bare.samples == 3
