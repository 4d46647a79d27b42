"""Checkpoints of a Hub VLM trained under FSDP (2 gloo ranks, tiny Qwen3-VL): with LoRA + two score heads a checkpoint
holds the adapter (peft's layout), the heads and the optimizer state, never the frozen base, and every command reads
it (eval, eval --all as async evaluation runs it, predict, export, export --merge, resume); a full fine-tune stays in
DCP shards that eval and export read with the keys from_pretrained expects. Two 2-rank trainings (+ one resume)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
import yaml
from optional_extras import requires

from tests.test_distributed import _losses, _run
from vlmtrain.cli import main
from vlmtrain.models.families import get_family
from vlmtrain.trainer.checkpoint import load_torch

pytestmark = [requires("peft", "lora"), pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

ROOT = Path(__file__).resolve().parents[1]
FSDP = ("--train.fsdp", "true")
# The files a LoRA + heads checkpoint holds (DDP or FSDP); nothing else, in particular no base weights. (The
# video processor settings are the base's, for transformers' AutoProcessor: models/families/processors.py.)
LORA_FILES = {"adapter_model.safetensors", "adapter_config.json", "README.md", "heads.safetensors", "heads.json",
              "processor_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "video_preprocessor_config.json",
              "optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth",
              "loop_state_0.pt", "loop_state_1.pt", "training_args.bin"}


def config(tiny: str, lora: bool) -> dict:
    """configs/qwen3vl-tiny-score-heads.yaml (two heads) on the tiny model, with the 8B config's LoRA."""
    cfg = yaml.safe_load((ROOT / "configs" / "qwen3vl-tiny-score-heads.yaml").read_text())
    cfg["model"]["pretrained"] = tiny
    if lora:
        cfg["model"]["lora"] = {"r": 16, "alpha": 32, "dropout": 0.05}  # dropout: resume restores the RNG too
    cfg["data"].update(num_train=64, num_eval=8)
    cfg["train"].update(max_steps=4, logging_steps=1, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                        save_steps=2, dataloader_num_workers=0, disable_tqdm=True, learning_rate=1e-2,
                        per_device_eval_batch_size=4)
    return cfg


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return get_family("qwen3_vl").build_tiny(str(tmp_path_factory.mktemp("qwen3vl") / "tiny"), seed=0)


@pytest.fixture(scope="module")
def lora_run(tiny, tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("lora")
    cfg = config(tiny, lora=True)
    return _run(tmp, cfg, "run", 2, 2, *FSDP), cfg


def _eval_losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in map(json.loads, open(run / "metrics.jsonl")) if "eval_loss" in r}


def _printed_metrics(capsys) -> dict:
    out = capsys.readouterr().out
    return json.loads(out[out.rindex("\n{") + 1:])  # the metrics: the last thing vlmtrain eval prints


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(path))


def _logits(model, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_lora_checkpoint_holds_only_what_trains_and_every_command_reads_it(lora_run, tmp_path, capsys):
    from transformers import AutoModelForImageTextToText

    from vlmtrain import run as run_mod
    from vlmtrain.config import load_run_config

    run, _ = lora_run
    ckpt = run / "checkpoint-4"
    assert set(os.listdir(ckpt)) == LORA_FILES

    # size: the trainable parameters in fp32, twice more for Adam's moments, and small files
    trainer = run_mod.build(load_run_config(run / "config.yaml"))
    trainable = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    n = sum(p.numel() for p in trainable.values())
    adapter, heads = _tensors(ckpt / "adapter_model.safetensors"), _tensors(ckpt / "heads.safetensors")
    assert all("lora_" in k for k in adapter) and all(k.startswith("head_") for k in heads)  # no base weight
    assert sum(t.numel() for t in [*adapter.values(), *heads.values()]) == n
    optimizer = load_torch(ckpt / "optimizer.pt")
    assert set(optimizer["state"]) == set(trainable)  # by parameter name, trainable ones only
    assert sum(t.numel() for s in optimizer["state"].values() for k, t in s.items() if k != "step") == 2 * n
    state_bytes = sum(os.path.getsize(ckpt / f) for f in ("adapter_model.safetensors", "heads.safetensors",
                                                         "optimizer.pt"))
    assert abs(state_bytes - 12 * n) < 0.1 * 12 * n, (state_bytes, 12 * n)
    small = sum(os.path.getsize(ckpt / f) for f in LORA_FILES) - state_bytes
    assert small < 100_000  # config, processor, RNG and loop state

    # vlmtrain eval: the eval_loss the run logged at that step
    logged = _eval_losses(run)[4]
    capsys.readouterr()
    assert main(["eval", "--config", str(run / "config.yaml"), "--checkpoint", str(ckpt),
                 "--train.output_dir", str(tmp_path / "eval")]) == 0
    got = _printed_metrics(capsys)["eval_loss"]
    assert got == pytest.approx(logged, rel=1e-5)

    # vlmtrain eval --all (what async evaluation runs on a run directory): logs the same eval_loss at step 4
    scratch = tmp_path / "async"
    scratch.mkdir()
    shutil.copy(run / "config.yaml", scratch / "config.yaml")
    shutil.copytree(ckpt, scratch / "checkpoint-4")
    assert main(["eval", "--checkpoint", str(scratch), "--all"]) == 0
    assert _eval_losses(scratch)[4] == pytest.approx(logged, rel=1e-5)

    # vlmtrain predict: one row per eval sample with both heads' outputs
    assert main(["predict", "--config", str(run / "config.yaml"), "--checkpoint", str(ckpt),
                 "--train.output_dir", str(tmp_path / "predict")]) == 0
    rows = [json.loads(line) for line in open(tmp_path / "predict" / "predictions.jsonl")]
    assert len(rows) == 8 and all({"count", "color", "color_probs"} <= set(r) for r in rows)

    # vlmtrain export: the model files without the training state; transformers loads base + adapter from them
    assert main(["export", "--checkpoint", str(ckpt), "--output-dir", str(tmp_path / "export")]) == 0
    assert set(os.listdir(tmp_path / "export")) == LORA_FILES - {"optimizer.pt", "scheduler.pt", "trainer_state.json",
                                                                 "rng_state_0.pth", "rng_state_1.pth",
                                                                 "loop_state_0.pt", "loop_state_1.pt",
                                                                 "training_args.bin"}
    with_adapter = AutoModelForImageTextToText.from_pretrained(tmp_path / "export")

    # vlmtrain export --merge: full weights from_pretrained loads with no key missing, the adapter's logits
    assert main(["export", "--checkpoint", str(ckpt), "--merge", "--output-dir", str(tmp_path / "merged")]) == 0
    merged, info = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    torch.testing.assert_close(_logits(merged), _logits(with_adapter), atol=1e-5, rtol=0)
    assert not torch.allclose(_logits(merged), _logits(AutoModelForImageTextToText.from_pretrained(
        load_run_config(run / "config.yaml").model.pretrained)))  # the adapter trained something
    assert all(torch.equal(t, heads[k]) for k, t in _tensors(tmp_path / "merged" / "heads.safetensors").items())


def test_lora_checkpoint_resumes_exactly_under_fsdp(lora_run, tmp_path):
    run, cfg = lora_run
    resumed = _run(tmp_path, cfg, "resumed", 2, 2, *FSDP, "--train.resume_from_checkpoint",
                   str(run / "checkpoint-2"))
    want, got = _losses(run), _losses(resumed)
    assert [got[s] for s in (3, 4)] == [want[s] for s in (3, 4)]
    assert _eval_losses(resumed)[4] == _eval_losses(run)[4]
    for name in ("adapter_model.safetensors", "heads.safetensors"):
        a, b = _tensors(run / "checkpoint-4" / name), _tensors(resumed / "checkpoint-4" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lora_fsdp_checkpoint_resumes_in_one_process(lora_run, tmp_path):
    """Another world size: one process (unsharded) takes the 2-rank checkpoint's weights and optimizer state."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from vlmtrain import run as run_mod
    from vlmtrain.config import load_run_config

    run, _ = lora_run
    ckpt = run / "checkpoint-2"
    cfg = load_run_config(run / "config.yaml", {"train.output_dir": str(tmp_path / "one"), "train.max_steps": 2,
                                                "train.eval_strategy": "no"})
    trainer = run_mod.build(cfg)
    trainer.train(resume_from_checkpoint=str(ckpt))  # at its last step: loads, trains nothing
    assert trainer.state.global_step == 2
    reference = run_mod.build(cfg).model
    trainer.parts.model_files.load_model_weights(reference, str(ckpt))
    saved = {n: p for n, p in reference.named_parameters() if p.requires_grad}
    params = dict(trainer.model.named_parameters())
    assert all(torch.equal(params[k], t) for k, t in saved.items())
    want, got = load_torch(ckpt / "optimizer.pt"), get_optimizer_state_dict(trainer.model, trainer.optimizer)
    assert want["state"].keys() == got["state"].keys() == saved.keys()
    assert all(torch.equal(want["state"][k][m], got["state"][k][m]) for k in saved for m in ("exp_avg", "exp_avg_sq"))


def test_a_checkpoint_of_other_heads_or_lora_is_an_error_naming_the_file(lora_run, tmp_path, capsys):
    run, _ = lora_run
    ckpt = run / "checkpoint-4"
    argv = ["eval", "--config", str(run / "config.yaml"), "--checkpoint", str(ckpt),
            "--train.output_dir", str(tmp_path / "eval")]
    # A CheckpointError: the command prints it as one line (exit 1), no traceback.
    assert main([*argv, "--model.heads", json.dumps({"count": {"type": "regression"}})]) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: \S*checkpoint-4/heads\.json: .*differ.*", err.splitlines()[-1]) and "Traceback" not in err
    assert main([*argv, "--model.lora", json.dumps({"r": 8, "alpha": 32})]) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: \S*adapter_model\.safetensors.*shape.*", err.splitlines()[-1]) and "Traceback" not in err


def test_full_fine_tune_checkpoint_stays_sharded_and_eval_and_export_read_it(tiny, tmp_path, capsys):
    from transformers import AutoModelForImageTextToText

    from vlmtrain.models.files.sharded_files import read_model_weights

    cfg = config(tiny, lora=False)
    cfg["train"].update(max_steps=2, eval_steps=2, save_steps=2)
    run = _run(tmp_path, cfg, "full", 2, 2, *FSDP)
    ckpt = run / "checkpoint-2"
    names = set(os.listdir(ckpt))
    assert {"dcp", "config.json", "heads.json", "heads.safetensors", "tokenizer.json"} <= names
    assert not names & {"model.safetensors", "adapter_model.safetensors", "optimizer.pt"}

    capsys.readouterr()
    assert main(["eval", "--config", str(run / "config.yaml"), "--checkpoint", str(ckpt),
                 "--train.output_dir", str(tmp_path / "eval")]) == 0
    assert _printed_metrics(capsys)["eval_loss"] == pytest.approx(_eval_losses(run)[2], rel=1e-5)

    assert main(["export", "--checkpoint", str(ckpt), "--output-dir", str(tmp_path / "export")]) == 0
    model, info = AutoModelForImageTextToText.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    shards = read_model_weights(str(ckpt))
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], shards[f"base.{k}"]) for k in loaded)  # nothing random-initialised
    heads = _tensors(tmp_path / "export" / "heads.safetensors")
    assert heads.keys() == {k[len("heads.layers."):] for k in shards if k.startswith("heads.")}
    assert all(torch.equal(t, shards[f"heads.layers.{k}"]) for k, t in heads.items())


def test_new_data_scores_equal_the_runs_last_evaluation_also_after_export_merge(lora_run, tmp_path):
    """`vlmtrain predict --data` on the eval samples written as a JSONL file gives, to 1e-5, the heads' outputs
    of the 2-rank FSDP run's last evaluation (eval_samples_step_4.jsonl), and so does the `export --merge` folder
    reloaded with vlmtrain.load_for_inference."""
    from vlmtrain import load_for_inference
    from vlmtrain.config import load_run_config
    from vlmtrain.data.cauldron import write_cauldron_jsonl
    from vlmtrain.data.registry import get_source

    run, _ = lora_run
    cfg = load_run_config(run / "config.yaml")
    samples = get_source(cfg.data.source).build(cfg)["eval_dataset"]
    data = write_cauldron_jsonl(samples, str(tmp_path / "data"), name="eval")
    evaluated = [json.loads(line) for line in open(run / "eval_samples_step_4.jsonl")]
    assert [row["index"] for row in evaluated] == list(range(8))

    def check(rows: list[dict]) -> None:
        assert len(rows) == len(evaluated)
        for row, want in zip(rows, evaluated):
            assert row["count"] == pytest.approx(want["heads"]["count"]["predicted"], abs=1e-5)
            assert row["color"] == want["heads"]["color"]["predicted"]

    assert main(["predict", "--checkpoint", str(run / "checkpoint-4"), "--data", data,
                 "--output", str(tmp_path / "rows.jsonl")]) == 0
    check([json.loads(line) for line in open(tmp_path / "rows.jsonl")])
    assert main(["export", "--checkpoint", str(run / "checkpoint-4"), "--merge",
                 "--output-dir", str(tmp_path / "merged")]) == 0
    records = [json.loads(line) for line in open(data)]
    for record in records:  # paths relative to the JSONL file, as `predict --data` resolves them
        record["images"] = [os.path.join(os.path.dirname(data), path) for path in record["images"]]
    check(load_for_inference(str(tmp_path / "merged")).score(records))
