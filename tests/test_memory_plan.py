"""The memory plan (vlmtrain.memory, vlmtrain.parallel.memory_plan, docs/memory.md): a training step traced on the
meta device against the same step measured on CPU, `vlmtrain plan`, and data.pack_length: auto.

What the 15% compares: the plan's total (weights + gradients + optimizer state + activations + temporaries at the
peak of a step) against the peak of the CPU memory timeline of torch.profiler (profile_memory, record_shapes,
with_stack: ``export_memory_timeline``), every category summed, over the second of two AdamW steps on the same
micro-batch, of the same architecture built for real. (torch.profiler's plain ``[memory]`` events see only part
of the CPU allocations in torch 2.13; the timeline sees them all.)"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from vlmtrain.cli import main
from vlmtrain.config import load_run_config
from vlmtrain.errors import ConfigError
from vlmtrain.memory import build_meta_model, estimate_step_memory, made_up_batch, plan_token_budget

LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048}


def _config(tmp_path, name, model, data, train=None):
    cfg = {"model": model, "data": data,
           "train": {"output_dir": str(tmp_path / name), "per_device_train_batch_size": 2, "weight_decay": 0.1,
                     **(train or {})}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.fixture(scope="module")
def configs(tmp_path_factory, tiny_hub):
    tmp = tmp_path_factory.mktemp("memplan")
    qwen = tiny_hub("qwen3_vl")[1]
    jsonl = {"source": "jsonl", "train_file": str(tmp / "none.jsonl"), "max_length": 128}
    return {
        "causal_lm full, packed": _config(tmp, "lm", {"kind": "causal_lm", "config": LLAMA},
                                          {"source": "addition", "packing": True, "pack_length": 256}),
        "hub_vlm Qwen3-VL LoRA, padded": _config(
            tmp, "lora", {"kind": "hub_vlm", "pretrained": qwen, "lora": {"r": 8, "alpha": 16}}, jsonl),
        "hub_vlm Qwen3-VL full, packed, activation checkpointing": _config(
            tmp, "ac", {"kind": "hub_vlm", "pretrained": qwen},
            {**jsonl, "packing": True, "pack_length": 256, "max_patches_per_pack": 128},
            {"activation_checkpointing": True}),
    }


def _measured_peak(model, batch, tmp_path) -> int:
    """The peak of torch.profiler's CPU memory timeline over the second of two AdamW steps."""
    torch.manual_seed(0)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, weight_decay=0.1,
                                  foreach=False)

    def step():
        model(**batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                record_shapes=True, with_stack=True) as prof:
        step()
    path = tmp_path / "timeline.json"
    prof.export_memory_timeline(str(path), device="cpu")
    _, sizes = json.loads(path.read_text())
    return max(sum(s) for s in sizes)


@pytest.mark.slow  # (20-40 s each on a loaded 2-core machine: a trace and a profiled step)
@pytest.mark.parametrize("name", ["causal_lm full, packed", "hub_vlm Qwen3-VL LoRA, padded",
                                  "hub_vlm Qwen3-VL full, packed, activation checkpointing"])
def test_the_plan_is_within_15_percent_of_the_cpu_peak(configs, name, tmp_path):
    cfg = load_run_config(configs[name])
    plan = estimate_step_memory(cfg)
    model = build_meta_model(cfg)
    length = cfg.data.pack_length if cfg.data.packing else cfg.data.max_length
    batch = made_up_batch(cfg, model, cfg.train.per_device_train_batch_size, length, cfg.data.max_patches_per_pack)
    measured = _measured_peak(model, batch, tmp_path)
    # activations and optimizer state are a visible part of these tiny models' peak (not only fixed costs)
    assert plan.parts["activations"] > 0.2 * plan.total and plan.parts["optimizer"] > 0, plan.table()
    print(f"{name}: plan {plan.total} B, measured {measured} B ({plan.total / measured - 1:+.1%})")
    assert abs(plan.total - measured) <= 0.15 * measured, (name, plan.total, measured, plan.table())


SMALL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 512}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A packed causal_lm run small enough to trace in a second or two."""
    tmp = tmp_path_factory.mktemp("memplan_small")
    return _config(tmp, "small", {"kind": "causal_lm", "config": SMALL},
                   {"source": "addition", "packing": True, "pack_length": 128, "max_length": 64},
                   {"per_device_train_batch_size": 1})


def test_plan_prints_each_part_and_the_total_against_the_device(small, capsys):
    assert main(["plan", "--config", small, "--device", "h100-80gb"]) == 0
    out = capsys.readouterr().out
    for part in ("weights", "gradients", "optimizer", "activations", "temporaries", "total"):
        assert part in out
    assert "80.00 GiB   fits" in out and "1 row(s) x 128 tokens" in out
    assert main(["plan", "--config", small, "--device-memory", "1KiB"]) == 0
    assert "does NOT fit" in capsys.readouterr().out


def test_a_budget_that_cannot_fit_is_refused_before_training_in_one_line(small, capsys):
    assert main(["train", "--config", small, "--data.device_memory", "1MiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: data.pack_length=128 (data.packing: true) needs an estimated ") and "MiB" in err
    assert "of the device's 1.00 MiB" in err and "lower data.pack_length or set it to auto" in err


def test_auto_picks_a_budget_that_fits_and_grows_with_the_device(small):
    cfg = load_run_config(small, {"data.pack_length": "auto"})
    base = estimate_step_memory(cfg, pack_length=64).total
    picked = []
    for factor in (1.2, 2, 4):
        device = int(base * factor / 0.9)
        length = plan_token_budget(load_run_config(small, {"data.pack_length": "auto",
                                                           "data.device_memory": str(device)})).data.pack_length
        assert isinstance(length, int) and length % 64 == 0 and length >= 64
        picked.append((length, device))
    length, device = picked[-1]
    assert estimate_step_memory(cfg, device, pack_length=length).fits()
    picked = [length for length, _ in picked]
    assert picked == sorted(picked) and picked[0] < picked[-1], picked


def test_auto_refusals(small):
    with pytest.raises(ConfigError, match="data.pack_length: auto plans against the GPU's memory; without CUDA set "
                                          "data.device_memory"):
        plan_token_budget(load_run_config(small, {"data.pack_length": "auto"}))
    with pytest.raises(ConfigError, match="data.pack_length: auto plans a packed row's token budget: set "
                                          "data.packing: true"):
        load_run_config(small, {"data.pack_length": "auto", "data.packing": None})
    with pytest.raises(ConfigError, match="device memory 'lots' is neither a size"):
        load_run_config(small, {"data.device_memory": "lots"})


def _checkpointed(small, **kwargs):
    over = {"train.activation_checkpointing": True,
            "train.activation_checkpointing_kwargs": json.dumps({"mode": "auto"}), **kwargs}
    return load_run_config(small, over)


def test_auto_checkpointing_picks_the_least_recompute_that_fits_the_device(small):
    """mode: auto -> each candidate policy's step traced; the one that recomputes least among those that fit (more
    device memory: a policy that keeps more), and its estimate fits."""
    from vlmtrain.memory import plan_checkpointing
    from vlmtrain.models.speed.checkpointing_policies import AUTO_CANDIDATES

    cfg = _checkpointed(small)
    totals = []
    for mode, extra in AUTO_CANDIDATES:
        chosen = load_run_config(small, {"train.activation_checkpointing": True,
                                         "train.activation_checkpointing_kwargs": json.dumps({"mode": mode, **extra})})
        totals.append(estimate_step_memory(chosen).total)
    assert totals[0] < totals[-1], totals  # (full keeps least, selective on every layer most)
    for i in (0, len(totals) - 1):  # a device that holds exactly candidate i's step (with the 10% margin)
        device = int(totals[i] / 0.9) + 1
        picked = plan_checkpointing(_checkpointed(small, **{"data.device_memory": str(device)}))
        kwargs = picked.train.activation_checkpointing_kwargs
        fitting = [j for j, t in enumerate(totals) if t <= device * 0.9]
        best = max(fitting, key=lambda j: (totals[j], j))  # (a tie: the one that recomputes less)
        assert kwargs == {"mode": AUTO_CANDIDATES[best][0], **AUTO_CANDIDATES[best][1]}, (kwargs, totals, device)
        assert estimate_step_memory(picked, device).fits()
    assert cfg.train.activation_checkpointing_kwargs == {"mode": "auto"}  # (the config itself left alone)


def test_auto_checkpointing_refusals(small, capsys):
    from vlmtrain.memory import plan_checkpointing

    with pytest.raises(ConfigError, match="mode: auto plans against the GPU's memory"):
        plan_checkpointing(_checkpointed(small))
    with pytest.raises(ConfigError, match="mode: auto: even full checkpointing needs an estimated"):
        plan_checkpointing(_checkpointed(small, **{"data.device_memory": "1MiB"}))
    with pytest.raises(ConfigError, match="mode: auto with data.pack_length: auto"):
        plan_checkpointing(_checkpointed(small, **{"data.pack_length": "auto", "data.device_memory": "80GiB"}))
    with pytest.raises(ConfigError, match="train.activation_checkpointing is off"):
        plan_checkpointing(load_run_config(small, {"train.activation_checkpointing_kwargs": '{"mode": "auto"}',
                                                   "data.device_memory": "80GiB"}))
    with pytest.raises(ConfigError, match="mode 'auto' chooses selective_every_n_layers itself"):
        load_run_config(small, {"train.activation_checkpointing_kwargs":
                                '{"mode": "auto", "selective_every_n_layers": 2}'})
    # the CLI: refused in one line before training; `vlmtrain plan` prints the choice
    assert main(["train", "--config", small, "--train.activation_checkpointing", "true",
                 "--train.activation_checkpointing_kwargs", '{"mode": "auto"}', "--data.device_memory", "1MiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mode: auto: even full checkpointing needs an estimated" in err, err
    assert main(["plan", "--config", small, "--device", "h100-80gb", "--train.activation_checkpointing", "true",
                 "--train.activation_checkpointing_kwargs", '{"mode": "auto"}']) == 0
    assert "activation_checkpointing_kwargs.mode: auto -> {'mode': 'selective'}" in capsys.readouterr().out


def test_auto_checkpointing_in_the_python_trainer_says_where_it_works():
    from vlmtrain import TrainingArguments
    from vlmtrain.models.speed.training_prep import enable_activation_checkpointing

    args = TrainingArguments("out", activation_checkpointing=True, activation_checkpointing_kwargs={"mode": "auto"})
    with pytest.raises(ConfigError, match="chosen by the memory plan of a run started from a config"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2), args.activation_checkpointing_kwargs)
