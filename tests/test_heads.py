"""Score heads (WithHeads over a tiny Llama) and the multi-loss contract through the Trainer."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from optional_extras import requires
from tiny import VOCAB, tiny_llama
from torch import nn
from transformers.utils import ModelOutput

from vlmtrain import Trainer, TrainingArguments
from vlmtrain.data.processing import SkipSample
from vlmtrain.errors import ConfigError
from vlmtrain.models.files.head_files import load_heads, read_head_configs, save_heads
from vlmtrain.models.objectives.heads import (
    HeadConfig,
    WithHeads,
    check_head_labels,
    compute_head_metrics,
    head_label_tensors,
    parse_heads,
    pool_last_token,
)

HEADS = {"cls": {"type": "classification", "num_outputs": 3, "weight": 0.5},
         "reg": {"type": "regression", "loss": "mse", "weight": 2.0}}


def heads_model(seed: int = 0) -> WithHeads:
    return WithHeads(tiny_llama(seed), HEADS)


def samples(n: int = 24, seed: int = 0) -> list[dict]:
    """Token sequences of 3..14 tokens; some with LM targets (long ones: many), head labels sometimes missing."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 3 + int(torch.randint(0, 12, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        labels = {"cls": int(ids[-1]) % 3 if i % 4 != 1 else None, "reg": float(ids[0]) / VOCAB}
        if i % 5 == 2:
            del labels["reg"]
        sample = {"input_ids": ids, "labels": labels}
        if length > 8:
            sample["lm_labels"] = [-100] * 2 + ids[2:]
        out.append(sample)
    return out


class Collate:
    """Pads input_ids/attention_mask (either side) with position ids from the mask, LM labels if any sample has
    them, and head labels through head_label_tensors."""

    def __init__(self, head_configs: dict[str, HeadConfig], side: str = "right") -> None:
        self.head_configs, self.side = head_configs, side

    def __call__(self, batch: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(s["input_ids"]) for s in batch)

        def pad(row: list[int], value: int) -> list[int]:
            fill = [value] * (longest - len(row))
            return fill + row if self.side == "left" else row + fill

        out = {"input_ids": torch.tensor([pad(s["input_ids"], 0) for s in batch]),
               "attention_mask": torch.tensor([pad([1] * len(s["input_ids"]), 0) for s in batch])}
        out["position_ids"] = (out["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        if any("lm_labels" in s for s in batch):
            out["labels"] = torch.tensor([pad(s.get("lm_labels", [-100] * len(s["input_ids"])), -100) for s in batch])
        out.update(head_label_tensors(self.head_configs, [s.get("labels") for s in batch]))
        return out


def per_sample_outputs(model: WithHeads, data: list[dict]) -> list[dict]:
    collate = Collate(model.head_configs)
    with torch.no_grad():
        return [model(**collate([s])) for s in data]


# -- config, labels ------------------------------------------------------------------------------------
def test_parse_heads_defaults_and_errors_name_the_key():
    heads = parse_heads({"kind": {"num_outputs": 4}, "score": {"type": "regression"}})
    assert heads["kind"] == HeadConfig("classification", 4, "ce", 1.0)
    assert heads["score"] == HeadConfig("regression", 1, "mse", 1.0)
    with pytest.raises(ConfigError, match=r"model\.heads\.score\.loss: 'ce' .*\['mse', 'huber'\]"):
        parse_heads({"score": {"type": "regression", "loss": "ce"}})
    with pytest.raises(ConfigError, match=r"model\.heads\.kind\.loss: 'focal'"):
        parse_heads({"kind": {"num_outputs": 3, "loss": "focal"}})
    with pytest.raises(ConfigError, match=r"model\.heads\.kind\.num_output: unknown key"):
        parse_heads({"kind": {"num_output": 3}})
    with pytest.raises(ConfigError, match=r"model\.heads\.kind\.type: 'ranking'"):
        parse_heads({"kind": {"type": "ranking"}})
    with pytest.raises(ConfigError, match=r"model\.heads\.kind\.num_outputs: a classification head needs"):
        parse_heads({"kind": {"type": "classification"}})


def test_head_label_tensors_and_bad_labels_skipped():
    heads = parse_heads({"c": {"num_outputs": 3}, "r": {"type": "regression"},
                         "m": {"num_outputs": 2, "loss": "bce"}, "v": {"type": "regression", "num_outputs": 2}})
    raw = [{"c": 2, "r": 0.5, "m": [1, 0], "v": [1.0, 2.0]}, None, {"c": 0, "extra": "ignored"}]
    for r in raw:
        check_head_labels(heads, r)
    t = head_label_tensors(heads, raw)
    assert t["labels_c"].tolist() == [2, -100, 0] and t["labels_c"].dtype == torch.long
    assert t["labels_r"].shape == (3,) and t["labels_r"][0] == 0.5 and t["labels_r"][1:].isnan().all()
    assert t["labels_m"].shape == (3, 2) and t["labels_m"][0].tolist() == [1.0, 0.0] and t["labels_m"][1].isnan().all()
    assert t["labels_v"].shape == (3, 2) and t["labels_v"][0].tolist() == [1.0, 2.0]
    for bad in ({"c": 3}, {"c": -1}, {"c": 1.5}, {"c": "2"}, {"c": True}, {"r": "high"}, {"r": math.inf},
                {"m": [1]}, {"m": [0, 2]}, {"v": 1.0}, ["c", 1]):
        with pytest.raises(SkipSample) as err:
            check_head_labels(heads, bad)
        assert err.value.reason == "bad_head_label"


# -- the model ----------------------------------------------------------------------------------------
def test_pool_last_token_by_mask_any_padding_side(one_thread):
    hidden = torch.arange(2 * 4 * 1.0).reshape(2, 4, 1)
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert pool_last_token(hidden, right).flatten().tolist() == [1.0, 7.0]
    assert pool_last_token(hidden, left).flatten().tolist() == [3.0, 7.0]

    model, data = heads_model().eval(), samples(6)
    alone = per_sample_outputs(model, data)
    with torch.no_grad():
        by_side = {side: model(**Collate(model.head_configs, side)(data)) for side in ("left", "right")}
    for name in ("logits_cls", "logits_reg"):
        torch.testing.assert_close(by_side["left"][name], by_side["right"][name], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(by_side["left"][name], torch.cat([o[name] for o in alone]), atol=1e-5, rtol=1e-5)


def test_loss_is_weighted_sum_missing_labels_skipped_and_counted(one_thread):
    model, data = heads_model(), samples(8)
    batch = Collate(model.head_configs)(data)
    out = model(**batch)
    cls, reg = batch["labels_cls"], batch["labels_reg"]
    has_cls, has_reg = cls != -100, ~reg.isnan()
    assert 0 < int(has_cls.sum()) < len(data) and 0 < int(has_reg.sum()) < len(data)
    want_cls = F.cross_entropy(out["logits_cls"][has_cls], cls[has_cls])
    want_reg = F.mse_loss(out["logits_reg"][has_reg, 0], reg[has_reg])
    torch.testing.assert_close(out["loss_cls"], want_cls)
    torch.testing.assert_close(out["loss_reg"], want_reg)
    assert out["num_items_cls"] == has_cls.sum() and out["num_items_reg"] == has_reg.sum()
    # LM loss: the mean over shifted targets, as the base's own loss computes it
    base = model.base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                      position_ids=batch["position_ids"], labels=batch["labels"])
    torch.testing.assert_close(out["loss_lm"], base.loss)
    assert out["num_items_lm"] == out["num_items"] == (batch["labels"][:, 1:] != -100).sum()
    torch.testing.assert_close(out["loss"], base.loss + 0.5 * want_cls + 2.0 * want_reg)
    # score-only batch: no LM loss and no LM logits; num_items is the batch size; a head without any label adds
    # 0, counted 0
    score_only = Collate(model.head_configs)([{"input_ids": [5, 6, 7], "labels": {"reg": 0.25}}] * 2)
    out = model(**score_only)
    assert "loss_lm" not in out and out["num_items"] == 2 and "logits" not in out
    assert out["loss_cls"] == 0 and out["num_items_cls"] == 0
    torch.testing.assert_close(out["loss"], 2.0 * out["loss_reg"])
    out["loss"].backward()
    assert model.heads.layer("reg").weight.grad.abs().sum() > 0


def test_heads_stay_fp32_outside_autocast(one_thread):
    model = heads_model().to(torch.bfloat16)
    assert model.heads.layer("cls").weight.dtype == torch.float32
    assert model.base.model.embed_tokens.weight.dtype == torch.bfloat16
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**Collate(model.head_configs)(samples(2)))
    assert out["logits_cls"].dtype == torch.float32 and out["loss_cls"].dtype == torch.float32


def test_save_and_load_heads(tmp_path, one_thread):
    model = heads_model(seed=1)
    save_heads(model, str(tmp_path))
    assert read_head_configs(str(tmp_path)) == model.head_configs
    other = heads_model(seed=2)
    assert not torch.equal(other.heads.layer("cls").weight, model.heads.layer("cls").weight)
    load_heads(other, str(tmp_path))
    for key, value in model.heads.state_dict().items():
        assert torch.equal(other.heads.state_dict()[key], value)
    with pytest.raises(ValueError, match="differ"):
        load_heads(WithHeads(tiny_llama(), {"cls": {"num_outputs": 4}}), str(tmp_path))


@requires("peft", "lora")
def test_with_heads_around_peft_model(one_thread):
    import peft

    base = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    model = WithHeads(base, HEADS)
    out = model(**Collate(model.head_configs)(samples(4)))
    out["loss"].backward()
    assert model.heads.layer("cls").weight.grad is not None
    assert all(p.grad is None for n, p in model.base.named_parameters() if "lora" not in n)


# -- metrics --------------------------------------------------------------------------------------------
def test_head_metrics_by_hand():
    heads = parse_heads({"c": {"num_outputs": 3}, "r": {"type": "regression"}})
    logits_c = np.eye(3)[[0, 1, 1, 2, 0]]  # predicted 0 1 1 2 0
    labels_c = np.array([0, 1, 2, 2, -100])  # the last one is missing
    pred_r = np.array([[1.0], [2.0], [2.0], [5.0], [9.0]])
    labels_r = np.array([1.0, 3.0, 2.0, 4.0, np.nan])
    m = compute_head_metrics(heads, {"c": logits_c, "r": pred_r}, {"c": labels_c, "r": labels_r})
    assert m["c_accuracy"] == pytest.approx(0.75)
    # class 0: tp 1 -> f1 1; class 1: tp 1, fp 1 -> 2/3; class 2: tp 1, fn 1 -> 2/3
    assert m["c_f1"] == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)
    assert m["r_mae"] == pytest.approx((0 + 1 + 0 + 1) / 4)
    assert m["r_rmse"] == pytest.approx(math.sqrt(2 / 4))
    assert m["r_pearson"] == pytest.approx(np.corrcoef([1, 2, 2, 5], [1, 3, 2, 4])[0, 1])
    # ranks: predictions 1, 2.5, 2.5, 4 (a tie); labels 1, 3, 2, 4
    assert m["r_spearman"] == pytest.approx(np.corrcoef([1, 2.5, 2.5, 4], [1, 3, 2, 4])[0, 1])


# -- through the Trainer ------------------------------------------------------------------------------------
def _args(tmp_path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path), report_to="none", disable_tqdm=True, save_strategy="no", seed=0)
    return TrainingArguments(**{**base, **kw})


def _per_item_means(outputs: list[dict]) -> dict[str, float]:
    means = {}
    for name in ("cls", "reg", "lm"):
        n = [float(o.get(f"num_items_{name}", 0)) for o in outputs]
        loss = [float(o.get(f"loss_{name}", 0)) for o in outputs]
        means[name] = sum(a * b for a, b in zip(n, loss)) / sum(n)
    return means


def test_every_head_loss_logged_and_averaged_over_its_own_items(tmp_path, one_thread):
    data = samples(24)
    model = heads_model()
    want = _per_item_means(per_sample_outputs(model, data))
    # what weighting every loss by the batch's LM target count would give for the eval batches of 4
    collate = Collate(model.head_configs)
    with torch.no_grad():
        batches = [model(**collate(data[i:i + 4])) for i in range(0, len(data), 4)]
    token_weighted = (sum(float(b["loss_cls"] * b["num_items"]) for b in batches)
                      / sum(float(b["num_items"]) for b in batches))
    assert abs(token_weighted - want["cls"]) > 0.01  # far more than the tolerance below: tells the two apart

    args = _args(tmp_path, learning_rate=1e-12, per_device_train_batch_size=3, gradient_accumulation_steps=2,
                 per_device_eval_batch_size=4, num_train_epochs=1, logging_steps=4, eval_strategy="steps",
                 eval_steps=4)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data, data_collator=collate)
    trainer.train()
    train_log = next(h for h in trainer.state.log_history if "loss_cls" in h)
    eval_log = next(h for h in trainer.state.log_history if "eval_loss_cls" in h)
    for name in ("cls", "reg", "lm"):  # lr ~0: one window over the whole epoch = every sample once
        assert train_log[f"loss_{name}"] == pytest.approx(want[name], rel=1e-4)
        assert eval_log[f"eval_loss_{name}"] == pytest.approx(want[name], rel=1e-4)
    assert {"eval_cls_accuracy", "eval_cls_f1", "eval_reg_mae", "eval_reg_rmse", "eval_reg_pearson",
            "eval_reg_spearman"} <= set(eval_log)


def test_automatic_head_metrics_and_predict_outputs(tmp_path, one_thread):
    data = samples(20, seed=3)
    model = heads_model(seed=3)
    alone = per_sample_outputs(model, data)
    logits_cls = torch.cat([o["logits_cls"] for o in alone]).numpy()
    logits_reg = torch.cat([o["logits_reg"] for o in alone]).numpy()[:, 0]
    raw = [s["labels"] for s in data]
    has_cls = np.array([r.get("cls") is not None for r in raw])
    truth_cls = np.array([r["cls"] for r in raw if r.get("cls") is not None])
    has_reg = np.array([r.get("reg") is not None for r in raw])
    truth_reg = np.array([r["reg"] for r in raw if r.get("reg") is not None])
    pred_cls, pred_reg = logits_cls[has_cls].argmax(-1), logits_reg[has_reg]
    f1s = [2 * np.sum((pred_cls == c) & (truth_cls == c))
           / (np.sum(pred_cls == c) + np.sum(truth_cls == c)) for c in np.union1d(pred_cls, truth_cls)]

    trainer = Trainer(model=model, args=_args(tmp_path, per_device_eval_batch_size=6), eval_dataset=data,
                      data_collator=Collate(model.head_configs, side="left"))
    m = trainer.evaluate()
    assert m["eval_cls_accuracy"] == pytest.approx(np.mean(pred_cls == truth_cls))
    assert m["eval_cls_f1"] == pytest.approx(np.mean(f1s))
    assert m["eval_reg_mae"] == pytest.approx(np.mean(np.abs(pred_reg - truth_reg)), rel=1e-4)
    assert m["eval_reg_rmse"] == pytest.approx(np.sqrt(np.mean((pred_reg - truth_reg) ** 2)), rel=1e-4)
    assert m["eval_reg_pearson"] == pytest.approx(np.corrcoef(pred_reg, truth_reg)[0, 1], rel=1e-4)
    rank = lambda x: np.argsort(np.argsort(x))  # noqa: E731 (no ties among these floats)
    assert m["eval_reg_spearman"] == pytest.approx(np.corrcoef(rank(pred_reg), rank(truth_reg))[0, 1], rel=1e-4)

    seen = []
    trainer.compute_metrics = lambda p: seen.append(p) or {}
    out = trainer.predict(data)
    np.testing.assert_allclose(out.heads["cls"], logits_cls, atol=1e-5)
    np.testing.assert_allclose(out.heads["reg"][:, 0], logits_reg, atol=1e-5)
    (p_cls, p_reg), (l_cls, l_reg) = seen[0].predictions, seen[0].label_ids
    np.testing.assert_allclose(p_reg, out.heads["reg"])
    np.testing.assert_allclose(p_cls, logits_cls, atol=1e-5)
    assert l_cls[has_cls].tolist() == truth_cls.tolist() and (l_cls[~has_cls] == -100).all()
    np.testing.assert_allclose(l_reg[has_reg], truth_reg, rtol=1e-6)
    assert "test_cls_accuracy" in out.metrics


# -- a client written for transformers' Trainer (seed 000), only the import changed -------------------------
@dataclass
class ScorerOutput(ModelOutput):
    loss: torch.FloatTensor | None = None
    loss_1: torch.FloatTensor | None = None
    loss_2: torch.FloatTensor | None = None
    logits_score: torch.FloatTensor | None = None
    logits_type: torch.FloatTensor | None = None


class Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Tanh())
        self.score_head, self.type_head = nn.Linear(16, 1), nn.Linear(16, 3)

    def forward(self, x, score_labels=None, type_labels=None):
        h = self.body(x)
        score, kind = self.score_head(h).squeeze(-1), self.type_head(h)
        loss_1 = F.mse_loss(score, score_labels)
        loss_2 = F.cross_entropy(kind, type_labels)
        return ScorerOutput(loss=loss_1 + loss_2, loss_1=loss_1, loss_2=loss_2, logits_score=score, logits_type=kind)


def seed_samples(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return [{"x": x[i], "score_labels": float(x[i].sum()), "type_labels": int(x[i, 0] > 0) + int(x[i, 1] > 0)}
            for i in range(n)]


def test_seed_000_client_runs_unchanged(tmp_path, one_thread):
    train, val = seed_samples(64, 0), seed_samples(16, 1)
    got = []

    def compute_metrics(eval_prediction):
        got.append(eval_prediction)
        preds, (score_labels, type_labels) = eval_prediction.predictions, eval_prediction.label_ids
        return {"seed_loss_1": np.mean(preds[0]), "score_mae": np.mean(np.abs(preds[2] - score_labels)),
                "type_accuracy": np.mean(preds[3].argmax(-1) == type_labels)}

    training_args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, per_device_eval_batch_size=8, logging_steps=2,
        save_steps=2000, save_strategy="steps", eval_steps=4, eval_strategy="steps", metric_for_best_model="loss",
        greater_is_better=False, report_to="none", max_steps=8, learning_rate=1e-2,
        ddp_find_unused_parameters=False, optim="adamw_torch", lr_scheduler_type="polynomial",
        lr_scheduler_kwargs={"power": 3.0}, warmup_steps=2, save_total_limit=5, weight_decay=0.02,
        label_names=["score_labels", "type_labels"], disable_tqdm=True)
    trainer = Trainer(model=Scorer(), args=training_args, train_dataset=train, eval_dataset=val,
                      compute_metrics=compute_metrics)
    trainer.train()
    logs = trainer.state.log_history
    assert all("loss_1" in h and "loss_2" in h for h in logs if "loss" in h)
    evals = [h for h in logs if "eval_loss" in h]
    assert len(evals) == 2 and all("eval_loss_1" in h and "eval_loss_2" in h and "eval_score_mae" in h for h in evals)
    # transformers' convention: every output but `loss`, in order (scalars one value per batch); labels in
    # label_names order, one row per sample in dataset order
    p = got[-1]
    assert len(p.predictions) == 4 and p.predictions[0].shape == (2,)
    assert p.predictions[2].shape == (16,) and p.predictions[3].shape == (16, 3)
    np.testing.assert_allclose(p.label_ids[0], [s["score_labels"] for s in val], rtol=1e-6)
    assert p.label_ids[1].tolist() == [s["type_labels"] for s in val]
    assert evals[-1]["eval_seed_loss_1"] == pytest.approx(evals[-1]["eval_loss_1"], rel=1e-5)


def test_named_outputs_gathered_from_ranks_in_dataset_order():
    """Under DDP rank r evaluated samples r, r + 2, ...: every named output comes back in dataset order."""
    from vlmtrain.evaluation import gather
    from vlmtrain.trainer.predictions import Collected

    parts = []
    for rank in (0, 1):
        c = Collected()
        rows = torch.arange(rank, 5, 2)  # rank 0: samples 0 2 4; rank 1: 1 3
        for chunk in rows.split(2):
            c.add({"logits_a": chunk[:, None].float().expand(-1, 3), "logits_b": chunk, "loss_1": chunk.sum()})
        parts.append(gather.rows(c))
    merged = Collected()
    gather.set_rows(merged, parts, interleave=True)
    assert merged.result()[0].tolist() == [[float(i)] * 3 for i in range(5)]
    assert merged.named("logits_")["b"].tolist() == [0, 1, 2, 3, 4]
    assert sorted(merged.named("loss_")["1"].tolist()) == [2, 4, 4]  # one value per batch: [0 2] [4] | [1 3]
