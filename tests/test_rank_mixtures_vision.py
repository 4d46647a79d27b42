"""Ranks whose micro-batches differ in kind: rank 0 gets only image samples, rank 1 only text-only ones (2 gloo
ranks, per-device batch 1, ddp_timeout 30 so a collective mismatch fails fast instead of hanging).

Per case (a tiny Hub VLM, full fine-tune or LoRA with a trained projector, under DDP or FSDP; the own VLM under
DDP and FSDP): 2 training steps and an evaluation finish, and the final weights (fp32; SGD, and AdamW with weight
decay where the second step has no image on any rank) and the eval loss equal a 1-process run over the same global
samples. The vision tower and projector learn (the image rank's gradients reach them), so the dummy image's zero
contribution is checked against real ones. The cases come in groups, one torchrun launch per group (each case
built and run in turn in one process group); the 1-process references run in the test's process.

Besides, in one process and per Hub family (all 5): a text-only batch with the dummy path on gives the same
loss and gradients as without it, and every trainable vision and projector parameter gets a gradient (zero); and
a training step without images leaves the tower and projector alone (no gradient, under AdamW).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from tests import preloaded

ROOT = Path(__file__).resolve().parents[1]
LORA = {"r": 4, "modules_to_save": ["projector"]}  # adapters on the text model, the projector trained whole
# case -> (model: a Hub family or "vlm", train.fsdp, model.lora)
CASES = {
    "qwen3_vl-ddp-full": ("qwen3_vl", False, None),
    "qwen3_vl-ddp-lora": ("qwen3_vl", False, LORA),
    "qwen3_vl-fsdp-full": ("qwen3_vl", True, None),
    "qwen3_vl-fsdp-lora": ("qwen3_vl", True, LORA),
    "idefics3-ddp-full": ("idefics3", False, None),
    "llava_onevision-ddp-full": ("llava_onevision", False, None),
    "gemma3-fsdp-lora": ("gemma3", True, LORA),
    "vlm-ddp": ("vlm", False, None),
    "vlm-fsdp": ("vlm", True, None),
    # score heads; rank 0: answered image samples, rank 1: score-only text-only ones and a corrupt image
    "qwen3_vl-ddp-lora-heads": ("qwen3_vl", False, LORA),
    "qwen3_vl-fsdp-full-heads": ("qwen3_vl", True, None),
    "qwen3_vl-fsdp-lora-heads": ("qwen3_vl", True, LORA),
    # evaluate() before train() (the worker's "eval-first"): the optimizer gets the sharded parameters
    "qwen3_vl-fsdp-full-eval-first": ("qwen3_vl", True, None),
    # evaluation with predict_with_generate: generate() encodes rank 0's image itself (mm_encoder_outputs)
    "qwen3_vl-fsdp-full-generate": ("qwen3_vl", True, None),
}
HEADS = {"score": {"type": "regression", "loss": "mse"}, "kind": {"type": "classification", "num_outputs": 3,
                                                                  "weight": 0.5}}
OWN_VLM = {
    "kind": "vlm",
    "vision": {"model_type": "siglip_vision_model", "image_size": 32, "patch_size": 8, "hidden_size": 32,
               "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2},
    "text": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 256},
    "pixel_shuffle_factor": 2,
}
# One torchrun launch per group (other-families: slow)
GROUPS = {"qwen3_vl-ddp": ["qwen3_vl-ddp-full", "qwen3_vl-ddp-lora"],
          "qwen3_vl-fsdp": ["qwen3_vl-fsdp-full", "qwen3_vl-fsdp-lora"],
          "own-vlm": ["vlm-ddp", "vlm-fsdp"],
          "qwen3_vl-heads": ["qwen3_vl-ddp-lora-heads", "qwen3_vl-fsdp-full-heads", "qwen3_vl-fsdp-lora-heads"],
          "fsdp-eval-first": ["qwen3_vl-fsdp-full-eval-first"],
          "fsdp-generate": ["qwen3_vl-fsdp-full-generate"],
          "other-families": ["idefics3-ddp-full", "llava_onevision-ddp-full", "gemma3-fsdp-lora"]}
# SGD shows a wrong gradient; AdamW with weight decay also a zero gradient where there should be none (it moves a
# parameter by its momentum and decay where None leaves it alone)
OPTIMIZERS = {"sgd": {"optim": "sgd", "learning_rate": 0.5, "weight_decay": 0.0},
              "adamw": {"optim": "adamw_torch", "learning_rate": 0.01, "weight_decay": 0.1}}
# The largest weight difference float error explains: Adam's normalized step magnifies the ranks' other summation
# order on small gradients (2e-5 seen); a zero gradient where none belongs moves a weight by its momentum, ~0.7 x
# lr = 7e-3.
WEIGHT_TOLERANCE = {"sgd": 1e-6, "adamw": 1e-4}


def suffix(optim: str) -> str:
    """What an optimizer adds to a case's file names (its runs share one launch with the SGD ones)."""
    return "" if optim == "sgd" else f"-{optim}"
TOWER = {"qwen3_vl": ("model.visual.blocks.", "model.visual.merger."),
         "idefics3": ("model.vision_model.encoder.", "model.connector."),
         "llava_onevision": ("model.vision_tower.encoder.", "model.multi_modal_projector."),
         "gemma3": ("model.vision_tower.", "model.multi_modal_projector."),
         "vlm": ("vision_encoder.", "projector.")}


def _samples(tmp: Path, n: int, offset: int, text_from: int | None = None) -> list[dict]:
    """n samples alternating image (even index) and text-only (odd), the images small random PNGs; from index
    ``text_from`` on, every sample is text-only."""
    rng = np.random.default_rng(offset)
    out = []
    for i in range(n):
        turn = {"user": f"What is sample {offset + i}?", "assistant": f"It is {offset + i} of them."}
        sample = {"images": [], "texts": [turn]}
        if i % 2 == 0 and (text_from is None or i < text_from):
            name = f"img{offset + i}.png"
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), "RGB").save(tmp / name)
            sample["images"] = [name]
        out.append(sample)
    return out


def _heads_samples(tmp: Path, n: int, offset: int, text_from: int | None = None) -> list[dict]:
    """n samples for 2 ranks at per-device batch 2: rank 0's (even index) answered, with head labels and an image
    (none from index ``text_from`` on); rank 1's (odd) score-only and text-only, but for one whose image is
    corrupt (skipped)."""
    rng = np.random.default_rng(offset)
    out = []
    for i in range(n):
        labels = {"score": float(rng.uniform(-1, 1)), "kind": int(rng.integers(0, 3))}
        sample = {"images": [], "texts": [{"user": f"Rate sample {offset + i}."}], "labels": labels}
        if i % 2 == 0:
            name = f"img{offset + i}.png"
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), "RGB").save(tmp / name)
            sample.update(images=[name], texts=[{"user": f"Rate sample {offset + i}.", "assistant": f"It is {i}."}])
            if text_from is not None and i >= text_from:
                sample["images"] = []
        elif i == 3:
            (tmp / f"bad{offset + i}.png").write_bytes((tmp / f"img{offset}.png").read_bytes()[:40])
            sample["images"] = [f"bad{offset + i}.png"]
        out.append(sample)
    return out


def _config(tmp: Path, case: str, checkpoints: dict[str, str], nproc: int, optim: str = "sgd") -> Path:
    model, fsdp, lora = CASES[case]
    heads = case.endswith("-heads")
    batch = (4 if heads else 2) // nproc
    data = "heads-" if heads else ""
    if model == "vlm":
        model_cfg = dict(OWN_VLM)
    else:
        model_cfg = {"kind": "hub_vlm", "pretrained": checkpoints[model], "torch_dtype": "float32", "lora": lora,
                     "heads": HEADS if heads else None}
    cfg = {
        "model": model_cfg,
        "data": {"source": "jsonl", "train_file": str(tmp / f"{data}train{suffix(optim)}.jsonl"),
                 "eval_file": str(tmp / f"{data}eval.jsonl"),
                 "max_length": 128, "max_images": 1},
        "train": {"output_dir": str(tmp / f"{case}{suffix(optim)}-{nproc}"), "max_steps": 2, **OPTIMIZERS[optim],
                  "lr_scheduler_type": "constant", "warmup_ratio": 0.0,
                  "per_device_train_batch_size": batch, "per_device_eval_batch_size": batch,
                  "train_sampling_strategy": "sequential", "logging_steps": 1, "eval_strategy": "no",
                  "save_strategy": "no", "dataloader_num_workers": 0, "disable_tqdm": True, "seed": 0,
                  "ddp_timeout": 30, "fsdp": fsdp, "report_to": "none",
                  **({"predict_with_generate": True, "generation_max_new_tokens": 3}
                     if case.endswith("-generate") else {})},
    }
    path = tmp / f"{case}{suffix(optim)}-{nproc}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _problem(tmp: Path, case: str, output: str, optim: str = "sgd") -> str | None:
    """What is wrong with a case's 2-rank run against its 1-process one (None: nothing)."""
    two_path, one_path = tmp / f"{case}{suffix(optim)}-2.pt", tmp / f"{case}{suffix(optim)}-1.pt"
    if not two_path.is_file():
        return f"the 2-rank run did not finish:\n{output}"
    two, one = torch.load(two_path, weights_only=False), torch.load(one_path, weights_only=False)
    if not two["global_step"] == one["global_step"] == 2:
        return f"steps {two['global_step']} (2 ranks) vs {one['global_step']} (1 process)"
    if sorted(two["weights"]) != sorted(one["weights"]):
        return "not the same parameters"
    worst = max((float((two["weights"][k] - one["weights"][k]).abs().max()), k) for k in one["weights"])
    if worst[0] >= WEIGHT_TOLERANCE[optim]:
        return f"weights differ from one process's: {worst}"
    # (with heads, eval_loss weighs each batch's total by its num_items: it depends on the batches; each eval_loss_*
    # is compared below)
    if not case.endswith("-heads") and abs(two["eval_loss"] - one["eval_loss"]) >= 1e-5:
        return f"eval_loss {two['eval_loss']} (2 ranks) vs {one['eval_loss']} (1 process)"
    # the vision tower and projector learned from rank 0's images (under LoRA: the projector)
    model, _, lora = CASES[case]
    for prefix in TOWER[model][1:] if lora else TOWER[model]:
        names = [k for k in two["weights"] if prefix in k]
        if not names or all(torch.equal(two["weights"][k], two["initial"][k]) for k in names):
            return f"no parameter under {prefix!r} changed"
    if case.endswith("-eval-first"):  # every parameter trains (the root unit's too: embeddings, lm_head, merger)
        still = [k for k in one["weights"] if torch.equal(two["weights"][k], two["initial"][k])]
        if still:
            return f"{len(still)} parameters never changed: {still[:6]}"
    if case.endswith("-heads"):
        return _logged_problem(two, one)
    if case.endswith("-generate") and not two["eval"]["eval_samples"] == one["eval"]["eval_samples"] == 2:
        return f"not every eval sample generated: {two['eval']} (2 ranks) vs {one['eval']} (1 process)"
    if case.endswith("-generate") and two["eval"]["eval_exact_match"] != one["eval"]["eval_exact_match"]:
        return f"eval_exact_match {two['eval']['eval_exact_match']} (2 ranks) vs {one['eval']['eval_exact_match']}"
    return None


def _logged_problem(two: dict, one: dict) -> str | None:
    """What the 2-rank run logged (loss, each loss_*, skip counts: log history, metrics.jsonl, evaluation)
    against the 1-process run (None: the same)."""
    from tests.test_rank_mixtures import _eval_counts, _logged, _same_numbers

    rows = [r for r in two["logs"] if "loss" in r]
    if len(rows) != 2 or not all("loss_lm" in r and "loss_score" in r and "loss_kind" in r for r in rows):
        return f"not every training row has loss_lm, loss_score and loss_kind: {rows}"
    final = next(r for r in two["logs"] if "train_loss" in r)
    if final.get("train_skipped_corrupt_image") != 1 or two["eval"].get("eval_skipped_corrupt_image") != 1:
        return f"the corrupt images are not counted: {final}, {two['eval']}"
    try:
        _same_numbers(_logged(two["logs"]), _logged(one["logs"]))
        _same_numbers(_logged(two["rows"]), _logged(one["rows"]))
        _same_numbers([_eval_counts(two["eval"])], [_eval_counts(one["eval"])])
    except AssertionError as e:
        return f"logged numbers differ from one process's: {e}"
    return None


@pytest.mark.parametrize("group", [pytest.param(g, marks=pytest.mark.slow) if g == "other-families" else g
                                   for g in GROUPS])
def test_image_rank_and_text_only_rank_match_one_process(tmp_path, one_thread, group):
    """The group's cases, each with SGD and with AdamW, in one torchrun launch (one process group, each run built
    and run in turn), the 1-process references in this process. With AdamW the second step has no image on any
    rank: the vision tower and projector get no gradient there (None, as one process without the dummy image
    leaves them)."""
    from tests.rank_mixtures_vision_worker import run
    from vlmtrain.models.families import get_family

    cases = GROUPS[group]
    for name, samples in (("eval", _samples(tmp_path, 2, 100)), ("heads-eval", _heads_samples(tmp_path, 4, 300))):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    for optim in OPTIMIZERS:
        text_last = optim == "adamw"  # (step 2: global samples 2-3, or 4-7 with heads)
        for name, samples in (("train", _samples(tmp_path, 4, 0, 2 if text_last else None)),
                              ("heads-train", _heads_samples(tmp_path, 8, 200, 4 if text_last else None))):
            (tmp_path / f"{name}{suffix(optim)}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    families = sorted({CASES[c][0] for c in cases} - {"vlm"})
    checkpoints = {f: get_family(f).build_tiny(str(tmp_path / f"tiny-{f}"), seed=0) for f in families}
    runs = [(c, optim) for optim in OPTIMIZERS for c in cases]
    configs = [str(_config(tmp_path, c, checkpoints, 2, optim)) for c, optim in runs]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    (tmp_path / "logs").mkdir()
    # the ranks: torchrun's rank environment, forked with their imports done (tests/preloaded.py; no launcher)
    _, output = preloaded.launch("tests.preloaded:run_script", [
        str(ROOT / "tests" / "rank_mixtures_vision_worker.py"), str(tmp_path), *configs], env, 2, tmp_path / "logs",
        timeout=600)
    for case, optim in runs:
        run(str(_config(tmp_path, case, checkpoints, 1, optim)), str(tmp_path))
    problems = {f"{case} ({optim})": _problem(tmp_path, case, output, optim) for case, optim in runs}
    assert not any(problems.values()), "\n".join(f"{c}: {p}" for c, p in problems.items() if p)


FAMILIES = [("qwen3_vl", {}), ("qwen2_5_vl", {}), ("idefics3", {}), ("idefics3", {"model_type": "smolvlm"}),
            ("llava_onevision", {}), ("gemma3", {})]


@pytest.mark.parametrize("name,options", FAMILIES, ids=[o.get("model_type", n) for n, o in FAMILIES])
def test_dummy_image_adds_zero_and_reaches_the_vision_tower(tmp_path, monkeypatch, one_thread, name, options):
    """In one process with the dummy path forced on: a text-only batch's loss and every gradient the plain
    forward gives are bitwise the same, and every trainable vision / projector parameter gets a gradient, all
    zero; the parameters its VisionInput names (the Trainer sets their gradients to None on a step without
    images) are exactly those. What the model never uses (the family's unused_parameters: LLaVA-OneVision's post_layernorm, after the
    layer output it takes) is frozen at load."""
    from vlmtrain.data.hub_collate import HubVLMCollator
    from vlmtrain.data.hub_processing import HubVLMProcessor
    from vlmtrain.models.families import get_family
    from vlmtrain.models.hub.hub_loading import load_model
    from vlmtrain.models.vision import dummy_vision

    family = get_family(name)
    path = family.build_tiny(str(tmp_path / "tiny"), seed=0, **options)
    model = load_model(path).train()
    hub = HubVLMProcessor(family.load_processor(path), family, max_length=128, max_images=1, prompts=False)
    batch = HubVLMCollator(hub, label_collate=lambda raw: {})(
        [hub.process({"images": [], "texts": [{"user": "Hi there", "assistant": "Yes."}]})])
    batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(dummy_vision, "needed", lambda on=on: on)
        model.zero_grad(set_to_none=True)
        out = model(**batch, loss_only=True)
        out["loss"].backward()
        runs[on] = out["loss"].detach(), {n: p.grad for n, p in model.named_parameters()}
    assert torch.equal(runs[False][0], runs[True][0])
    plain, dummy = runs[False][1], runs[True][1]
    image_side = [n for n in plain if n.startswith(family.module_groups["vision"] + family.module_groups["projector"])]
    unused = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert unused == ([n for n in plain if n.startswith(family.unused_parameters(model.config))]
                      if family.unused_parameters else [])
    assert len(unused) == (2 if name == "llava_onevision" else 0)  # (its tower's post_layernorm)
    assert image_side and all(plain[n] is None for n in image_side)
    for n in set(image_side) - set(unused):
        assert dummy[n] is not None and not dummy[n].any(), n
    for n, grad in plain.items():
        if grad is not None:
            assert torch.equal(grad, dummy[n]), n
    # what the Trainer sets to None on a step without images: exactly what the dummy alone gave a gradient
    host = model.model
    fed = {id(p) for p in getattr(host, dummy_vision.VISION_INPUT_ATTR).parameters(host)}
    assert {n for n, p in model.named_parameters() if id(p) in fed and p.requires_grad} == \
        {n for n in plain if plain[n] is None and dummy[n] is not None}


@pytest.mark.parametrize("model", ["vlm", "qwen3_vl"])
def test_a_step_without_images_leaves_the_vision_tower_alone(tmp_path, monkeypatch, one_thread, model):
    """One process, AdamW with weight decay, the dummy image on (the own VLM runs it in training; a Hub VLM's is
    forced on, as under several ranks): step 1 has an image, step 2 none. Step 2 moves the text model but not one
    vision tower or projector weight: their gradients there are None, not zero (AdamW's momentum and weight
    decay would move a parameter with a zero gradient)."""
    from vlmtrain.config import load_run_config
    from vlmtrain.models.families import get_family
    from vlmtrain.models.vision import dummy_vision
    from vlmtrain.run import build
    from vlmtrain.trainer.callbacks import TrainerCallback

    monkeypatch.setattr(dummy_vision, "needed", lambda: True)
    for name, samples in ((f"train{suffix('adamw')}", _samples(tmp_path, 4, 0, text_from=2)),
                          ("eval", _samples(tmp_path, 2, 100))):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    checkpoints = {model: get_family(model).build_tiny(str(tmp_path / "tiny"), seed=0)} if model != "vlm" else {}
    trainer = build(load_run_config(_config(tmp_path, "vlm-ddp" if model == "vlm" else "qwen3_vl-ddp-full",
                                            checkpoints, 1, "adamw")))
    weights: list[dict[str, torch.Tensor]] = []

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            weights.append({n: p.detach().clone() for n, p in model.named_parameters()})

    trainer.add_callback(Snapshot())
    trainer.train()
    first, second = weights
    image_side = [n for n in first if n.startswith(TOWER[model])]
    assert image_side and all(torch.equal(first[n], second[n]) for n in image_side), \
        [n for n in image_side if not torch.equal(first[n], second[n])][:5]
    assert not any(torch.equal(first[n], second[n]) for n in first if "embed_tokens" in n)  # the text model trains
