"""vlmtrain's DPOTrainer on VLMs with TRL 1.16's vision DPO dataset layout: equal to TRL's DPOTrainer on a tiny
Qwen3-VL, each pair's images encoded once (the log-probs of that path equal the plain forward of the 2B rows with
the images repeated per row), and one vision tower pass per forward where TRL's encodes every image twice."""

from __future__ import annotations

import random

import pytest
import torch
from PIL import Image

import vlmtrain
import vlmtrain.errors
from tests.optional_extras import requires
from vlmtrain.models.objectives.dpo import answer_logps

METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")
WORDS = ["red", "blue", "green", "square", "circle", "two", "three", "a", "the", "big"]


def _image(rng: random.Random) -> Image.Image:
    size = rng.choice([(32, 32), (48, 32), (32, 48)])
    return Image.new("RGB", size, tuple(rng.randrange(256) for _ in range(3)))


def _pair(rng: random.Random, n_images: int) -> dict:
    """One pair in TRL's vision layout: message lists with image parts in the user turn, and ``images``."""
    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    return {"images": [_image(rng) for _ in range(n_images)],
            "prompt": [{"role": "user", "content": [{"type": "image"}] * n_images
                        + [{"type": "text", "text": words(1, 4)}]}],
            "chosen": [{"role": "assistant", "content": [{"type": "text", "text": words(1, 3)}]}],
            "rejected": [{"role": "assistant", "content": [{"type": "text", "text": words(1, 3)}]}]}


def _pairs(n: int, seed: int) -> list[dict]:
    """Pairs with 0, 1 and 2 images of different sizes, in every mix per batch."""
    rng = random.Random(seed)
    return [_pair(rng, rng.choice([0, 1, 1, 2])) for _ in range(n)]


def logps_and_grads(model, weights: torch.Tensor, compute) -> tuple[torch.Tensor, dict]:
    """``compute()``'s log-probs and the gradients of their ``weights``-weighted sum (a gradient through every
    row), from zeroed gradients."""
    model.zero_grad()
    logps = compute()
    (logps * weights).sum().backward()
    return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class TowerCounter:
    """Counts the vision tower's calls and the images they encode (the rows of ``grid_thw``)."""

    def __init__(self, tower: torch.nn.Module) -> None:
        self.calls = self.images = 0
        tower.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self.calls += 1
        self.images += int(kwargs.get("grid_thw", args[1] if len(args) > 1 else None).shape[0])


def _run(framework: str, path: str, processor, out, steps: int, with_eval: bool = True, padding_free: bool = False):
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText

    if framework == "trl":
        import trl

        config_class, trainer_class = trl.DPOConfig, trl.DPOTrainer
    else:
        config_class, trainer_class = vlmtrain.DPOConfig, vlmtrain.DPOTrainer
    args = config_class(str(out), max_length=None, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                        max_steps=steps, learning_rate=3e-3, weight_decay=0.1, logging_steps=1, seed=7, bf16=False,
                        gradient_checkpointing=False, report_to="none", save_strategy="no",
                        train_sampling_strategy="sequential", use_cpu=True, dataloader_num_workers=0,
                        eval_strategy="no", disable_tqdm=True, padding_free=padding_free)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    initial_vision = model.model.visual.blocks[0].attn.qkv.weight.detach().clone()
    trainer = trainer_class(model=model, args=args, train_dataset=Dataset.from_list(_pairs(2 * steps, 0)),
                            eval_dataset=Dataset.from_list(_pairs(4, 1)), processing_class=processor)
    ref = trainer.ref_model if trainer.ref_model is not None else trainer.model
    counters = {"policy": TowerCounter(model.model.visual), "ref": TowerCounter(ref.model.visual)}
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    metrics = trainer.evaluate() if with_eval else None
    return {"eval": metrics, "model": model, "logs": logs, "counters": counters, "initial_vision": initial_vision,
            "collator": trainer.data_collator}


@pytest.fixture(scope="module")
def qwen3_vl(tiny_hub):
    _, path, processor = tiny_hub("qwen3_vl")
    return path, processor


@pytest.fixture(scope="module")
def trl_and_ours(qwen3_vl, tmp_path_factory):
    """TRL's DPOTrainer and vlmtrain's, 10 steps each on the same tiny Qwen3-VL and pairs."""
    path, processor = qwen3_vl
    out = tmp_path_factory.mktemp("dpo_vision")
    return {name: _run(name, path, processor, out / name, 10) for name in ("trl", "ours")}


@pytest.mark.slow
@requires("trl", "dev")
def test_vision_dpo_equals_trl(trl_and_ours):
    """Per-step loss and metrics, final weights, and evaluation metrics (eval_ prefixed) as TRL's, over 10 steps
    of AdamW with weight decay on pairs with 0, 1 and 2 images."""
    theirs, ours = trl_and_ours["trl"], trl_and_ours["ours"]
    assert len(theirs["logs"]) == len(ours["logs"]) == 10
    for step, (t, o) in enumerate(zip(theirs["logs"], ours["logs"]), 1):
        for key in METRICS:
            assert o[key] == pytest.approx(t[key], rel=1e-4, abs=1e-6), (step, key)
    assert theirs["logs"][-1]["rewards/margins"] != pytest.approx(0.0, abs=1e-4)  # (the policy moved)
    for key in METRICS:
        assert ours["eval"][f"eval_{key}"] == pytest.approx(theirs["eval"][f"eval_{key}"], rel=1e-4, abs=1e-6), key
    # atol 5e-5: the gradients agree to float error (test_one_vision_pass_logps_equal_the_plain_forward), but a
    # chosen and a rejected row's gradients meet before the vision tower here and after it in TRL, and AdamW's
    # m / sqrt(v) turns that summation-order noise on a near-zero gradient element into a step of its own (one
    # element of the projector ends 3e-5 apart; every other within 1e-5)
    trl_weights = dict(theirs["model"].named_parameters())
    for name, param in ours["model"].named_parameters():
        torch.testing.assert_close(param, trl_weights[name], rtol=1e-4, atol=5e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    name = "model.visual.blocks.0.attn.qkv.weight"  # (the vision tower trained: gradients reach it)
    assert not torch.equal(dict(ours["model"].named_parameters())[name], ours["initial_vision"])


@pytest.mark.slow
@requires("trl", "dev")
def test_one_vision_pass_per_pair(trl_and_ours):
    """vlmtrain's policy and reference each make one vision tower call per forward, encoding each pair's images
    once; TRL's encodes every image twice (once in the chosen row, once in the rejected row)."""
    theirs, ours = trl_and_ours["trl"]["counters"], trl_and_ours["ours"]["counters"]
    pairs = _pairs(20, 0)
    images = sum(len(p["images"]) for p in pairs)
    forwards = 10 + 2  # 10 training steps and 2 evaluation batches (every batch here has an image)
    image_batches = sum(any(p["images"] for p in pairs[i:i + 2]) for i in range(0, 20, 2))
    eval_pairs = _pairs(4, 1)
    eval_images = sum(len(p["images"]) for p in eval_pairs)
    image_batches += sum(any(p["images"] for p in eval_pairs[i:i + 2]) for i in range(0, 4, 2))
    for who in ("policy", "ref"):
        assert ours[who].calls == image_batches <= forwards, who
        assert ours[who].images == images + eval_images, who
        assert theirs[who].images == 2 * (images + eval_images), who


def _mixed_batch_pairs() -> list[dict]:
    """Pairs with 1 and 2 images and a text-only pair, in one batch."""
    rng = random.Random(3)
    return [_pair(rng, 1), _pair(rng, 0), _pair(rng, 2)]


@pytest.mark.parametrize("family,padding_free",
                         [("qwen3_vl", False), ("qwen2_5_vl", False), ("idefics3", False), ("gemma3", False),
                          ("llava_onevision", False), ("qwen3_vl", True), ("qwen2_5_vl", True), ("idefics3", True)],
                         ids=["qwen3_vl", "qwen2_5_vl", "idefics3", "gemma3", "llava_onevision",
                              "qwen3_vl-padding_free", "qwen2_5_vl-padding_free", "idefics3-padding_free"])
def test_one_vision_pass_logps_equal_the_plain_forward(tiny_hub, family, padding_free):
    """The answers' log-probs of the 2B rows with each pair's images encoded once equal those of the plain
    forward of the same rows, each with its own copy of its images (the processor over the 2B rows), in fp32.
    Idefics3 cuts an image into crops and LLaVA-OneVision into tiles: the features are picked per image token,
    not per image; Gemma 3's come as one [images, tokens, hidden] tensor. With ``padding_free`` the 2B rows are
    one packed row (each sequence its own positions, Qwen's multimodal rotary ones too, and attention kept within
    it), logits computed only at the answer positions, and the images still encoded in one vision call."""
    import functools

    from transformers import AutoModelForImageTextToText

    from vlmtrain.data.preference_vision import VisionPreferenceCollator, render_pair
    from vlmtrain.models.objectives.dpo import pair_logps

    fam, path, processor = tiny_hub(family)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    pairs = _mixed_batch_pairs()
    batch = VisionPreferenceCollator(processor)(pairs)
    rope = functools.partial(fam.rope_positions, model.config) if fam.rope_positions is not None else None
    ours_batch = VisionPreferenceCollator(processor, padding_free=True, rope_positions=rope)(pairs) \
        if padding_free else batch
    texts = [render_pair(p, processor) for p in pairs]
    rows = [t[0] + t[1] for t in texts] + [t[0] + t[2] for t in texts]
    plain = processor(text=rows, images=[p["images"] for p in pairs] * 2, padding=True, return_tensors="pt",
                      add_special_tokens=False)
    width = batch["input_ids"].shape[1]
    assert torch.equal(plain["input_ids"][:, :width], batch["input_ids"])  # (the same rows, right-padded)
    assert "pixel_values" not in batch and batch["vision_pixel_values"].shape[0] < plain["pixel_values"].shape[0]
    if padding_free:  # (one row of the 2B sequences, no padding)
        assert ours_batch["input_ids"].shape == (1, int(batch["attention_mask"].sum()))
        assert "attention_mask" not in ours_batch
    weights = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.3, 1.0])  # (a gradient through every row)
    tower = getattr(model.model, "visual", None)
    calls = []
    if tower is not None:
        tower.register_forward_pre_hook(lambda *_: calls.append(1))

    ours, our_grads = logps_and_grads(model, weights, lambda: pair_logps(model, ours_batch))
    assert len(calls) == (1 if tower is not None else 0)  # (one vision tower call for the batch's images)
    theirs, their_grads = logps_and_grads(model, weights, lambda: answer_logps(
        model(**plain, use_cache=False).logits[:, :width], batch["input_ids"], batch["completion_mask"]))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert ours.abs().min() > 1.0  # (every row has answer tokens)
    assert our_grads.keys() == their_grads.keys() and any(".visual" in n or "vision" in n for n in our_grads)
    for name, grad in their_grads.items():  # (the chosen and rejected rows' gradients meet in one encoding)
        scale = grad.abs().max().item()
        # (1e-8: for gradients that are 0 in exact arithmetic, e.g. an attention key's bias)
        assert (our_grads[name] - grad).abs().max().item() <= 1e-5 * scale + 1e-8, name


def test_padding_free_training_equals_padded(qwen3_vl, tmp_path):
    """DPOConfig(padding_free=True) on a Qwen3-VL: each batch's 2B sequences packed into one row trains as the
    padded batches do (per-step loss and metrics, final weights; AdamW with weight decay), with one vision tower
    call per batch for the policy and one for the reference."""
    path, processor = qwen3_vl
    runs = {pf: _run("ours", path, processor, tmp_path / str(pf), 3, with_eval=False, padding_free=pf)
            for pf in (False, True)}
    padded, packed = runs[False], runs[True]
    assert packed["collator"](_pairs(2, 0))["input_ids"].shape[0] == 1  # (the 4 sequences in one row)
    assert len(padded["logs"]) == len(packed["logs"]) == 3
    for step, (p, q) in enumerate(zip(padded["logs"], packed["logs"]), 1):
        for key in METRICS:
            assert q[key] == pytest.approx(p[key], rel=1e-5, abs=1e-6), (step, key)
    assert padded["logs"][-1]["rewards/margins"] != pytest.approx(0.0, abs=1e-6)  # (the policy moved)
    weights = dict(padded["model"].named_parameters())
    for name, param in packed["model"].named_parameters():
        torch.testing.assert_close(param, weights[name], rtol=1e-4, atol=5e-5, msg=lambda m, name=name: f"{name}: {m}")
    image_batches = sum(any(p["images"] for p in _pairs(6, 0)[i:i + 2]) for i in range(0, 6, 2))
    for who in ("policy", "ref"):
        assert packed["counters"][who].calls == padded["counters"][who].calls == image_batches, who


def test_padding_free_refused_for_a_family_that_cannot_pack(tiny_hub, tmp_path):
    """Gemma 3 cannot pack (its image tokens' bidirectional blocks): padding_free=True is one error naming it,
    before the model loads (the path holds the config alone: loading its weights would fail otherwise)."""
    import shutil

    from datasets import Dataset

    _, path, _ = tiny_hub("gemma3")
    config_only = tmp_path / "gemma3-config"
    config_only.mkdir()
    shutil.copy(f"{path}/config.json", config_only / "config.json")
    args = vlmtrain.DPOConfig(str(tmp_path / "out"), padding_free=True, use_cpu=True, report_to="none")
    with pytest.raises(vlmtrain.errors.ConfigError, match="padding_free=True: the gemma3 family cannot pack"):
        vlmtrain.DPOTrainer(model=str(config_only), args=args, train_dataset=Dataset.from_list(_pairs(2, 0)))


@requires("peft", "lora")
def test_lora_reference_encodes_each_pairs_images_once(qwen3_vl, tmp_path):
    """With LoRA (the vision tower's attention adapted too) the reference is the policy with its adapters off: per
    step the tower runs once with them on and once off, each time over each pair's images once."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForImageTextToText

    path, processor = qwen3_vl
    pairs = [_pair(random.Random(i), n) for i, n in enumerate([1, 2, 0, 1])]
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    args = vlmtrain.DPOConfig(str(tmp_path), max_length=None, per_device_train_batch_size=2, max_steps=2,
                              learning_rate=1e-2, logging_steps=1, seed=7, bf16=False, gradient_checkpointing=False,
                              report_to="none", save_strategy="no", train_sampling_strategy="sequential",
                              use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "q_proj", "v_proj"])
    trainer = vlmtrain.DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(pairs),
                                  processing_class=processor, peft_config=lora)
    assert trainer.ref_model is None  # (no copy: the adapters switched off give the reference)
    counter = TowerCounter(model.model.visual)
    trainer.train()
    assert counter.calls == 2 * 2  # 2 steps x (policy, reference)
    assert counter.images == 2 * sum(len(p["images"]) for p in pairs)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert logs[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # (policy = reference before any step)
    assert logs[1]["rewards/margins"] != pytest.approx(0.0, abs=1e-6)  # (the adapters moved the policy)


def test_a_vlm_path_brings_its_processor(qwen3_vl, tmp_path):
    """A VLM given as a path loads in its config's architecture, with the family's processor when none is given,
    and trains on pairs with images."""
    from datasets import Dataset

    path, _ = qwen3_vl
    args = vlmtrain.DPOConfig(str(tmp_path), max_steps=1, logging_steps=1, per_device_train_batch_size=2, bf16=False,
                              gradient_checkpointing=False, report_to="none", save_strategy="no", use_cpu=True,
                              disable_tqdm=True)
    trainer = vlmtrain.DPOTrainer(model=str(path), args=args, train_dataset=Dataset.from_list(_pairs(2, 0)))
    assert type(trainer.policy).__name__ == "Qwen3VLForConditionalGeneration"
    assert trainer.processing_class.image_processor is not None
    trainer.train()
    assert trainer.state.log_history[0]["loss"] == pytest.approx(0.6931472, rel=1e-5)  # (log 2: policy = reference)


@pytest.mark.parametrize("option,value", [("truncation_mode", "keep_end")])
def test_vision_pairs_refuse_what_trl_refuses(tmp_path, option, value):
    """Settings TRL 1.16 refuses with images are one error naming them, before the model loads (the path does
    not exist). (precompute_ref_log_probs, which TRL refuses too, works: tests/test_dpo_vision_precompute.py.)"""
    from datasets import Dataset

    args = vlmtrain.DPOConfig(str(tmp_path), use_cpu=True, report_to="none")
    setattr(args, option, value)  # (set after the config's own checks)
    with pytest.raises(vlmtrain.errors.ConfigError, match=option):
        vlmtrain.DPOTrainer(model=str(tmp_path / "no-model"), args=args, train_dataset=Dataset.from_list(_pairs(2, 0)))


def test_yaml_packed_pairs_refused_for_a_family_that_cannot_pack(tiny_hub, tmp_path, capsys):
    """data.packing: true with train.objective dpo on Gemma 3: one error naming it, before the model loads (the
    path holds the config and processor alone)."""
    import shutil

    import yaml

    from vlmtrain import cli

    _, path, _ = tiny_hub("gemma3")
    no_weights = tmp_path / "gemma3-no-weights"
    shutil.copytree(path, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    (tmp_path / "pairs.jsonl").write_text('{"texts": [{"user": "a"}], "chosen": "b", "rejected": "c"}\n')
    cfg = {"model": {"kind": "hub_vlm", "pretrained": str(no_weights)},
           "data": {"source": "jsonl", "train_file": str(tmp_path / "pairs.jsonl"), "packing": True},
           "train": {"output_dir": str(tmp_path / "run"), "objective": "dpo", "max_steps": 1}}
    (tmp_path / "dpo.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["train", "--config", str(tmp_path / "dpo.yaml")]) != 0
    assert "error: data.packing=true: the gemma3 family cannot pack" in capsys.readouterr().err


def _file_pairs(tmp_path, n: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Pairs with images saved as PNG files, as a JSONL holds them (every other pair in vlmtrain's own layout), and
    the same pairs in TRL's vision layout with the images loaded, as vlmtrain.DPOTrainer takes them."""
    rows, theirs = [], []
    for i, pair in enumerate(_pairs(n, seed)):
        paths = []
        for k, image in enumerate(pair["images"]):
            paths.append(str(tmp_path / f"{seed}-{i}-{k}.png"))
            image.save(paths[-1])
        question = pair["prompt"][0]["content"][-1]["text"]
        chosen, rejected = (pair[s][0]["content"][0]["text"] for s in ("chosen", "rejected"))
        if i % 2:
            rows.append({"images": paths, "texts": [{"user": question}], "chosen": chosen, "rejected": rejected})
        else:
            rows.append({**pair, "images": paths})
        theirs.append({**pair, "images": [Image.open(p).convert("RGB") for p in paths],
                       "prompt": [{"role": "user", "content": question}],
                       "chosen": [{"role": "assistant", "content": chosen}],
                       "rejected": [{"role": "assistant", "content": rejected}]})
    return rows, theirs


@pytest.mark.parametrize("lora,packing", [(False, False), (True, False), (False, True)],
                         ids=["full", "lora", "packed"])
def test_dpo_from_yaml_on_a_hub_vlm_equals_dpo_trainer(qwen3_vl, tmp_path, one_thread, lora, packing, capsys):
    """`vlmtrain train` with train.objective dpo on model.kind hub_vlm, pairs with images from a JSONL (both
    layouts): per-step loss and metrics equal vlmtrain.DPOTrainer's on the same model and pairs (rel 1e-5), eval_
    metrics too; with model.lora the reference is the model with its adapters off, as DPOTrainer's peft_config;
    with data.packing: true each batch's sequences are packed into one row (each its own multimodal positions)
    and train as DPOTrainer's padded batches.
    `vlmtrain data inspect --config` shows a pair's tokens, the prompt's image tokens expanded."""
    import json

    import yaml

    from vlmtrain import cli
    from vlmtrain.models.hub.hub_loading import load_model

    path, processor = qwen3_vl
    rows, theirs = _file_pairs(tmp_path, 8, 0)
    eval_rows, theirs_eval = _file_pairs(tmp_path, 4, 1)
    for name, data in (("train", rows), ("eval", eval_rows)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    train = {"learning_rate": 3e-3, "weight_decay": 0.1, "logging_steps": 1, "seed": 7, "report_to": "none",
             "dataloader_num_workers": 0, "disable_tqdm": True, "per_device_train_batch_size": 2,
             "per_device_eval_batch_size": 2, "max_steps": 3}
    lora_spec = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    cfg = {"model": {"kind": "hub_vlm", "pretrained": str(path), "torch_dtype": "float32",
                     **({"lora": lora_spec} if lora else {})},
           "data": {"source": "jsonl", "train_file": str(tmp_path / "train.jsonl"),
                    "eval_file": str(tmp_path / "eval.jsonl"), "max_length": 512, "packing": packing},
           "train": {"output_dir": str(tmp_path / "run"), "objective": "dpo", "save_strategy": "no", **train}}
    config = tmp_path / "dpo.yaml"
    config.write_text(yaml.safe_dump(cfg))
    if packing:
        from vlmtrain.config import load_run_config
        from vlmtrain.models.kinds import get_kind

        batch = get_kind("hub_vlm").pairs(load_run_config(str(config)), processor)(rows[:2])
        assert batch["input_ids"].shape[0] == 1 and batch["position_ids"].shape[0] == 4  # (one row, Qwen's rope)
    assert cli.main(["train", "--config", str(config)]) == 0

    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    args = vlmtrain.DPOConfig(str(tmp_path / "dpo_trainer"), max_length=512, bf16=False, gradient_checkpointing=False,
                              save_strategy="no", use_cpu=True, **train)
    # (the model as model.kind hub_vlm loads it: its patch embedding as the equal matmul differs from
    # from_pretrained's Conv3d by float rounding, 5e-5 relative after a step)
    trainer = vlmtrain.DPOTrainer(load_model(str(path), "float32"), args=args, train_dataset=theirs, eval_dataset=theirs_eval, processing_class=processor,
                                  peft_config=peft_config)
    trainer.train()
    logs, evaluation = [e for e in trainer.state.log_history if "loss" in e], trainer.evaluate()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    ours = [r for r in lines if "loss" in r]
    assert len(ours) == len(logs) == 3

    def close(mine: dict, expected: dict, prefix: str = "") -> None:
        for key in METRICS[:7]:
            # (packed: the attention sums in another order; a reward, beta x a difference of log-probs, then
            # carries the log-probs' rounding, 1e-5 of |logps|, as an absolute error)
            rounding = 1e-5 * 0.1 * abs(expected[f"{prefix}logps/chosen"]) if packing and "rewards" in key else 1e-7
            assert mine[prefix + key] == pytest.approx(expected[prefix + key], rel=1e-5, abs=rounding), key

    for mine, expected in zip(ours, logs):
        close(mine, expected)
    assert ours[-1]["rewards/margins"] != pytest.approx(0.0, abs=1e-5)  # (the policy moved off its reference)
    close([r for r in lines if "eval_loss" in r][-1], evaluation, "eval_")
    if not lora and not packing:
        one = next(r for r in rows if "texts" in r and r["images"])
        (tmp_path / "one.jsonl").write_text(json.dumps(one) + "\n")
        capsys.readouterr()
        assert cli.main(["data", "inspect", str(tmp_path / "one.jsonl"), "--config", str(config)]) == 0
        shown = capsys.readouterr().out
        assert "<|image_pad|>" in shown and "chosen (" in shown and "rejected (" in shown, shown


def test_yaml_vlm_pairs_whose_prompt_fills_max_length_are_counted_skips(qwen3_vl, tmp_path):
    """hub_vlm DPO pairs: a pair whose prompt fills data.max_length (its image tokens cut, or no answer token left)
    is skipped and counted as prompt_fills_max_length, the rest of its batch trains; more images than
    data.max_images is too_many_images."""
    import yaml

    from vlmtrain.config import load_run_config
    from vlmtrain.models.kinds import get_kind

    path, processor = qwen3_vl
    rows, _ = _file_pairs(tmp_path, 4, 3)
    cfg = {"model": {"kind": "hub_vlm", "pretrained": str(path)},
           "data": {"source": "jsonl", "train_file": str(tmp_path / "x.jsonl"), "max_length": 40, "max_images": 1},
           "train": {"output_dir": str(tmp_path / "run"), "objective": "dpo"}}
    (tmp_path / "x.jsonl").write_text("")
    (tmp_path / "dpo.yaml").write_text(yaml.safe_dump(cfg))
    collate = get_kind("hub_vlm").pairs(load_run_config(str(tmp_path / "dpo.yaml")), processor)
    short = {"texts": [{"user": "a"}], "chosen": "red", "rejected": "blue"}
    long_text = {"texts": [{"user": "the big red square " * 4}], "chosen": "red", "rejected": "blue"}
    with_image = {**rows[0], "images": rows[0]["images"][:1] or [str(tmp_path / "3-1-0.png")]}
    two_images = {**short, "images": [with_image["images"][0]] * 2}
    batch = collate([short, long_text, two_images])
    assert batch["skipped"] == {"prompt_fills_max_length": 1, "too_many_images": 1}
    assert batch["input_ids"].shape[0] == 2  # (the short pair's chosen and rejected rows)
    tight = get_kind("hub_vlm").pairs(load_run_config(str(tmp_path / "dpo.yaml"), {"data.max_length": 8}),
                                      processor)
    batch = tight([with_image])  # (8 tokens cut through its image tokens: a skip, not the collator's error)
    assert batch["skipped"] == {"prompt_fills_max_length": 1} and "input_ids" not in batch


def _yaml_pair_collator(path, processor, tmp_path):
    """The pair collator of a YAML `train.objective: dpo` run on the Hub VLM at ``path``."""
    import yaml

    from vlmtrain.config import load_run_config
    from vlmtrain.models.kinds import get_kind

    cfg = {"model": {"kind": "hub_vlm", "pretrained": str(path)},
           "data": {"source": "jsonl", "train_file": str(tmp_path / "x.jsonl")},
           "train": {"output_dir": str(tmp_path / "run"), "objective": "dpo"}}
    (tmp_path / "x.jsonl").write_text("")
    (tmp_path / "dpo.yaml").write_text(yaml.safe_dump(cfg))
    return get_kind("hub_vlm").pairs(load_run_config(str(tmp_path / "dpo.yaml")), processor)


def _answer_with_image(pair: dict) -> dict:
    """A pair whose chosen answer holds an image part (TRL's message lists allow one in any turn)."""
    chosen = [{"role": "assistant", "content": [{"type": "image"}, *pair["chosen"][0]["content"]]}]
    return {**pair, "images": [*pair["images"], _image(random.Random(9))], "chosen": chosen}


def test_images_in_an_answer_are_refused_or_skipped(qwen3_vl, tmp_path):
    """A pair with an image in its chosen (or rejected) messages, where the pair's answers would no longer share
    its prompt's images: vlmtrain.DPOTrainer refuses it when built, naming the pair (before training); a YAML run's
    collator skips it, counted as placeholder_in_assistant (as SFT counts an image in an answer), and the rest of
    the batch trains."""
    from datasets import Dataset


    path, processor = qwen3_vl
    pairs = _pairs(3, 0)
    pairs[1] = _answer_with_image(pairs[1])
    args = vlmtrain.DPOConfig(str(tmp_path / "out"), use_cpu=True, report_to="none", bf16=False)
    with pytest.raises(vlmtrain.errors.ConfigError, match="train_dataset pair 1: an image in its 'chosen'"):
        vlmtrain.DPOTrainer(model=str(tmp_path / "no-model"), args=args, train_dataset=Dataset.from_list(pairs),
                            processing_class=processor)
    collate = _yaml_pair_collator(path, processor, tmp_path)
    batch = collate(pairs)
    assert batch["skipped"] == {"placeholder_in_assistant": 1} and batch["input_ids"].shape[0] == 4


def test_yaml_vlm_pairs_place_images_at_their_placeholders(qwen3_vl, tmp_path):
    """vlmtrain's pair layout with `<image>` placeholders in its user texts: each image sits where its placeholder
    is, as in SFT samples (the batch equals vlmtrain.DPOTrainer's of TRL's layout with the image parts there); a
    placeholder count other than the image count is skipped as placeholder_mismatch, a placeholder in an answer
    as placeholder_in_assistant."""
    from vlmtrain.data.preference_vision import VisionPreferenceCollator

    path, processor = qwen3_vl
    rng = random.Random(3)
    paths = []
    for k in range(2):
        paths.append(str(tmp_path / f"{k}.png"))
        _image(rng).save(paths[-1])
    collate = _yaml_pair_collator(path, processor, tmp_path)
    own = {"images": paths, "texts": [{"user": "red <image> or", "assistant": "two"},
                                      {"user": "blue <image>?"}], "chosen": "red", "rejected": "blue"}
    mismatch = {**own, "texts": [{"user": "red <image>?"}]}
    in_answer = {**own, "chosen": "red <image>"}
    batch = collate([own, mismatch, in_answer])
    assert batch["skipped"] == {"placeholder_mismatch": 1, "placeholder_in_assistant": 1}
    images = [Image.open(p).convert("RGB") for p in paths]
    text = [{"type": "text", "text": t} for t in ("red ", " or", "blue ", "?")]
    trl = {"images": images, "prompt": [{"role": "user", "content": [text[0], {"type": "image"}, text[1]]},
                                        {"role": "assistant", "content": "two"},
                                        {"role": "user", "content": [text[2], {"type": "image"}, text[3]]}],
           "chosen": [{"role": "assistant", "content": "red"}], "rejected": [{"role": "assistant", "content": "blue"}]}
    expected = VisionPreferenceCollator(processor)([trl])
    assert batch["input_ids"].tolist() == expected["input_ids"].tolist()
    first = batch["input_ids"][0].tolist().index(processor.tokenizer.convert_tokens_to_ids("<|image_pad|>"))
    assert processor.tokenizer.decode(batch["input_ids"][0, :first]).endswith("user\nred <|vision_start|>")


def test_pairs_whose_prompt_fills_max_length_are_skipped_and_counted(qwen3_vl, tmp_path):
    """A pair with images whose prompt leaves no answer token within max_length trains nothing (its loss would be
    a constant log 2 diluting the batch): DPOTrainer's collator leaves it out and counts it, as the YAML path and
    TRL's text pairs do; the batch's other pairs train as they would alone."""
    from transformers import AutoModelForImageTextToText

    path, processor = qwen3_vl
    rng = random.Random(3)
    short, long = _pair(rng, 1), _pair(rng, 1)
    long["prompt"][0]["content"][-1]["text"] = " ".join(["big"] * 200)  # (fills max_length=96 before any answer)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    args = vlmtrain.DPOConfig(str(tmp_path), max_length=96, report_to="none", use_cpu=True, disable_tqdm=True)
    trainer = vlmtrain.DPOTrainer(model=model, args=args, train_dataset=[short, long], processing_class=processor)
    batch = trainer.data_collator([short, long])
    assert batch["skipped"] == {"prompt_fills_max_length": 1}
    assert batch["input_ids"].shape[0] == 2 and batch["completion_mask"].sum(dim=1).all()  # (one pair: 2 rows)
    alone = trainer.data_collator([short])
    assert "skipped" not in alone and torch.equal(alone["input_ids"], batch["input_ids"])
