"""Loss scale across accumulation, multi-loss logging, optimizer groups, schedules and the collator."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny import TwoLossModel, tiny_llama, token_samples

from vlmtrain import Trainer, TrainerCallback, TrainingArguments
from vlmtrain.data.collate import DefaultCollator
from vlmtrain.trainer import ConfigError
from vlmtrain.trainer.optim import build_param_groups, create_scheduler


def _args(tmp_path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path), save_strategy="no", disable_tqdm=True, logging_steps=1, max_grad_norm=0.0,
                learning_rate=1e-3)
    base.update(kw)
    return TrainingArguments(**base)


class GradRecorder(TrainerCallback):
    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


class CountingLlama(torch.nn.Module):
    """Wraps a Llama: loss is the mean over target tokens and num_items their count."""

    def __init__(self, seed=0):
        super().__init__()
        self.lm = tiny_llama(seed)

    def forward(self, input_ids, attention_mask, labels):
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        return {"loss": out.loss, "num_items": (labels[:, 1:] != -100).sum()}


@pytest.mark.parametrize("make_model", [CountingLlama, TwoLossModel], ids=["llama", "two-loss"])
def test_accumulation_matches_one_big_batch(tmp_path, make_model):
    if make_model is TwoLossModel:
        g = torch.Generator().manual_seed(0)
        data = [{"x": torch.randn(3, 4, generator=g), "y": torch.randn(3, 2, generator=g),
                 "mask": (torch.arange(3) < (i % 3) + 1).float()} for i in range(32)]
    else:
        data = token_samples(32, seed=1)
    results = []
    for bs, accum in [(8, 1), (2, 4)]:
        rec = GradRecorder()
        args = _args(tmp_path / f"{bs}x{accum}", max_steps=3, per_device_train_batch_size=bs,
                     gradient_accumulation_steps=accum, optim="sgd")
        trainer = Trainer(make_model(0), args, train_dataset=data, callbacks=[rec])
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        results.append((rec.grads, losses))
    (g1, l1), (g2, l2) = results
    assert len(g1) == len(g2) == 3
    for step1, step2 in zip(g1, g2):
        for name in step1:
            torch.testing.assert_close(step1[name], step2[name], atol=1e-6, rtol=0)
    assert l1 == pytest.approx(l2, abs=1e-6)


def test_every_loss_is_logged_weighted_by_num_items(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(3, 4, generator=g), "y": torch.randn(3, 2, generator=g),
             "mask": (torch.arange(3) < (i % 3) + 1).float()} for i in range(16)]
    args = _args(tmp_path, max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                 logging_steps=2, eval_strategy="steps", eval_steps=2, learning_rate=0.0 + 1e-9)
    model = TwoLossModel(0)
    trainer = Trainer(model, args, train_dataset=data, eval_dataset=data[:5])
    # Expected training log: weighted by num_items over the whole window (2 steps x 2 micro-batches).
    order = list(trainer.get_train_dataloader().sampler)
    trainer.train()
    logs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    train_log = next(r for r in logs if "loss" in r)
    eval_log = next(r for r in logs if "eval_loss" in r)
    assert {"loss_a", "loss_b", "grad_norm", "learning_rate", "samples_per_second", "data_wait_fraction"} <= set(
        train_log)
    assert {"eval_loss", "eval_loss_a", "eval_loss_b"} <= set(eval_log)

    def weighted(samples, net):
        # The model is (almost) unchanged (lr ~ 0), so recompute the expected means by hand.
        totals, n = torch.zeros(2), 0.0
        with torch.no_grad():
            for s in samples:
                pred = net(s["x"])
                totals[0] += (((pred[:, 0] - s["y"][:, 0]) ** 2) * s["mask"]).sum()
                totals[1] += ((pred[:, 1] - s["y"][:, 1]).abs() * s["mask"]).sum()
                n += float(s["mask"].sum())
        return (totals / n).tolist()

    a, b = weighted([data[i] for i in order[:8]], TwoLossModel(0).net)
    assert train_log["loss_a"] == pytest.approx(a, rel=1e-4)
    assert train_log["loss_b"] == pytest.approx(b, rel=1e-4)
    assert train_log["loss"] == pytest.approx(a + b, rel=1e-4)
    ea, eb = weighted(data[:5], model.net)
    assert eval_log["eval_loss_a"] == pytest.approx(ea, rel=1e-5)
    assert eval_log["eval_loss_b"] == pytest.approx(eb, rel=1e-5)


def test_module_learning_rates_freeze_and_no_decay(tmp_path):
    model = tiny_llama()
    args = _args(tmp_path, max_steps=1, weight_decay=0.1,
                 module_learning_rates={"embed_tokens": 0.0, "layers.1": 5e-3, "lm_head": 5e-5})
    groups = build_param_groups(model, args)
    assert not model.model.embed_tokens.weight.requires_grad
    in_groups = {id(p) for g in groups for p in g["params"]}
    assert id(model.model.embed_tokens.weight) not in in_groups
    by_name = {(g["name"], g["weight_decay"] > 0): g for g in groups}
    layer1 = {id(p) for p in model.model.layers[1].parameters()}
    assert {id(p) for p in by_name[("layers.1", True)]["params"]} | {
        id(p) for p in by_name[("layers.1", False)]["params"]} == layer1
    assert by_name[("layers.1", True)]["lr"] == 5e-3
    norm_ids = {id(m.weight) for n, m in model.named_modules() if "norm" in type(m).__name__.lower()}
    for g in groups:
        if g["weight_decay"] > 0:
            assert not norm_ids & {id(p) for p in g["params"]}
            assert all(p.ndim >= 2 for p in g["params"])
    # Trains, freezes and logs the per-module learning rates.
    before = model.model.embed_tokens.weight.clone()
    trainer = Trainer(model, args, train_dataset=token_samples(8))
    trainer.train()
    assert torch.equal(before, model.model.embed_tokens.weight)
    log = trainer.state.log_history[0]
    assert log["learning_rate_layers.1"] > 0 and "learning_rate_lm_head" in log


def test_unknown_module_learning_rate_key_is_an_error(tmp_path):
    args = _args(tmp_path, max_steps=1, module_learning_rates={"projectr": 1e-3})
    with pytest.raises(ConfigError, match="projectr.*top-level modules"):
        build_param_groups(tiny_llama(), args)


@pytest.mark.parametrize("kind,kwargs,expected", [
    ("constant", None, [1, 1, 1, 1, 1]),
    ("constant_with_warmup", None, [0, 0.5, 1, 1, 1]),
    ("linear", None, [0, 0.5, 1, 2 / 3, 1 / 3]),
    ("cosine", None, [0, 0.5, 1, 0.75, 0.25]),
    ("cosine_with_min_lr", {"min_lr_rate": 0.1}, [0, 0.5, 1, 0.775, 0.325]),
    ("polynomial", {"power": 2.0, "lr_end": 0.0}, [0, 0.5, 1, 4 / 9, 1 / 9]),
])
def test_schedules_match_transformers_curves(tmp_path, kind, kwargs, expected):
    args = _args(tmp_path, max_steps=5, lr_scheduler_type=kind, lr_scheduler_kwargs=kwargs, warmup_steps=2,
                 learning_rate=1.0)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = create_scheduler(opt, args, num_training_steps=5)
    got = []
    for _ in range(5):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert got == pytest.approx(expected, abs=1e-9)
    # And the same numbers as transformers' own schedules.
    from transformers import get_scheduler
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    hf = get_scheduler(kind, opt2, num_warmup_steps=2 if kind != "constant" else None,
                       num_training_steps=5, scheduler_specific_kwargs=kwargs or {})
    ref = []
    for _ in range(5):
        ref.append(opt2.param_groups[0]["lr"])
        opt2.step()
        hf.step()
    assert got == pytest.approx(ref, abs=1e-9)


@pytest.mark.parametrize("kwargs,message", [
    ({"optim": "adam"}, "optim='adam'.*adamw_torch"),
    ({"lr_scheduler_type": "cosine_with_min_lr"}, "min_lr_rate"),
    ({"load_best_model_at_end": True}, "eval_strategy"),
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 3, "save_steps": 4},
     "multiple of eval_steps"),
    ({"save_strategy": "best"}, "needs evaluation"),
    ({"warmup_ratio": 1.5}, "warmup_ratio"),
    ({"max_steps": 0}, "max_steps"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
])
def test_invalid_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TrainingArguments(**kwargs)


def test_best_model_defaults():
    args = TrainingArguments(eval_strategy="steps", load_best_model_at_end=True, eval_steps=100, save_steps=200)
    assert args.metric_for_best_model == "loss" and args.greater_is_better is False
    args = TrainingArguments(eval_strategy="epoch", save_strategy="epoch", metric_for_best_model="accuracy")
    assert args.greater_is_better is True


def test_default_collator_pads_and_stacks():
    batch = DefaultCollator(pad_token_id=7)([
        {"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "attention_mask": [1, 1, 1], "x": torch.ones(2),
         "name": "a"},
        {"input_ids": [4], "labels": [4], "attention_mask": [1], "x": torch.zeros(2), "name": "b"},
    ])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 7, 7]]
    assert batch["labels"].tolist() == [[-100, 2, 3], [4, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["x"].shape == (2, 2) and batch["name"] == ["a", "b"]


def test_eval_dataset_dict_and_predict(tmp_path):
    data = token_samples(12)
    trainer = Trainer(tiny_llama(), _args(tmp_path, max_steps=1), train_dataset=data,
                      eval_dataset={"a": data[:4], "b": data[4:10]}, compute_metrics=lambda p: {"n": len(p[0])})
    metrics = trainer.evaluate()
    assert {"eval_a_loss", "eval_b_loss", "eval_a_n", "eval_b_n"} <= set(metrics)
    # Combined over the sets: sample-weighted means, summed sample counts.
    assert metrics["eval_a_samples"] == 4 and metrics["eval_b_samples"] == 6 and metrics["eval_samples"] == 10
    assert metrics["eval_n"] == pytest.approx((4 * 4 + 6 * 6) / 10)
    assert metrics["eval_loss"] == pytest.approx((4 * metrics["eval_a_loss"] + 6 * metrics["eval_b_loss"]) / 10)
    assert trainer.state.log_history[-1]["eval_n"] == metrics["eval_n"]
    out = trainer.predict(data[:5])
    assert out.predictions.shape[0] == 5 and out.label_ids.shape[0] == 5
    assert math.isfinite(out.metrics["test_loss"])
