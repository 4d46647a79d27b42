"""vlmtrain.GRPOTrainer on a vision-language model with TRL 1.16's layout (conversational prompts, an ``images``
column): equal to TRL's GRPOTrainer on a tiny Qwen3-VL, Gemma 3 and Idefics3 given the same completions, a mixed
generation batch (prompts with 0, 1 and 2 images, a micro-batch without any) included; on every Hub VLM family each
group's images encoded once per rollout and once per training forward, the completions those of a plain per-row
generate."""

from __future__ import annotations

import contextlib
import os
import random

import pytest
import torch
from PIL import Image

import tests.test_grpo as text_grpo
import vlmtrain
from tests.optional_extras import requires
from tests.test_dpo_vision import TowerCounter
from vlmtrain.errors import ConfigError

EOS = 258  # the tiny Qwen3-VL's <|im_end|>
FAMILIES = ["qwen3_vl", "qwen2_5_vl", "idefics3", "gemma3", "llava_onevision"]
WORDS = ["red", "blue", "green", "square", "circle", "two", "three", "how", "many", "what"]
IMAGES_PER_PROMPT = [1, 0, 0, 0, 2, 1, 0, 1]  # (with 2 prompts a micro-batch, the second one has no image)


def _image(rng: random.Random) -> Image.Image:
    """Random pixels: a solid colour's identical patches give features whose gradients are ~0 in places, where
    AdamW's m / sqrt(v) turns float noise into full steps."""
    width, height = rng.choice([(32, 32), (48, 32), (32, 48)])
    return Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))


def _prompts():
    from datasets import Dataset

    rng = random.Random(0)
    rows = [{"prompt": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))}],
             "images": [_image(rng) for _ in range(n)], "target": rng.choice(WORDS[:3])} for n in IMAGES_PER_PROMPT]
    return Dataset.from_list(rows)


class FixedCompletions(text_grpo.FixedCompletions):
    """test_grpo.py's deterministic completions (some end with ``eos``, others run to the limit) in the tiny VLMs'
    vocabularies (ids 64..75: no special token in any of them); the prompt ids TRL's rollout_func returns are its
    processor's, as TRL's own generation path tokenizes them."""

    def __init__(self, limit: int, eos: int = EOS) -> None:
        super().__init__(limit)
        self.eos = eos

    def completions(self, count: int) -> list[list[int]]:
        return [[self.eos if t == text_grpo.EOS else 60 + t for t in row] for row in super().completions(count)]

    def __call__(self, model, prompt_ids, **vision):  # vlmtrain's Generator
        return self.completions(len(prompt_ids))

    def trl(self, prompts, trainer):  # TRL's rollout_func
        from trl.data_utils import prepare_multimodal_messages

        proc = trainer.processing_class  # (string content as blocks, as TRL's own path gives a VLM's processor)
        ids = [proc.apply_chat_template([prepare_multimodal_messages(p)], add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"][0] for p in prompts]
        return {"prompt_ids": ids, "completion_ids": self.completions(len(prompts)), "logprobs": None}


def _text(completion) -> str:
    return completion[0]["content"]


def letters_reward(completions, **kwargs):
    return [float(sum(map(ord, _text(c))) % 5) for c in completions]


def target_reward(completions, target, **kwargs):
    return [1.0 if t[0] in _text(c) else 0.0 for c, t in zip(completions, target, strict=True)]


@pytest.fixture(scope="module")
def qwen3_vl(tiny_hub):
    _, path, processor = tiny_hub("qwen3_vl")
    return path, processor


def _eos(model) -> int:
    """The end of an assistant turn the tiny model's generation stops at (its generation config's first EOS)."""
    eos = model.generation_config.eos_token_id
    return eos[0] if isinstance(eos, list) else eos


class ImageCounter(TowerCounter):
    """TowerCounter on any family's vision tower (``model.model``'s ``visual``, ``vision_tower`` or
    ``vision_model``): its calls and what they encode (Qwen's images: rows of ``grid_thw``; another family's
    crops, tiles or images: the first dimension of its pixels)."""

    def __init__(self, model: torch.nn.Module) -> None:
        inner = model.model
        super().__init__(next(getattr(inner, n) for n in ("visual", "vision_tower", "vision_model") if hasattr(inner, n)))

    def _count(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if "grid_thw" in kwargs or len(args) > 1:
            return super()._count(module, args, kwargs)
        self.calls += 1
        self.images += int(kwargs.get("pixel_values", args[0] if args else None).shape[0])


def _config(cls, out, **kw):
    base = dict(num_generations=2, per_device_train_batch_size=4, max_completion_length=5, max_steps=4,
                learning_rate=3e-3, weight_decay=0.1, adam_epsilon=1e-6, logging_steps=1, seed=7, bf16=False, shuffle_dataset=False,
                gradient_checkpointing=False, report_to="none", save_strategy="no", use_cpu=True,
                dataloader_num_workers=0, disable_tqdm=True, reward_weights=[1.0, 0.5])
    return cls(str(out), **{**base, **kw})


@contextlib.contextmanager
def _template_tokens_only(processor):
    """TRL 1.16's forward runs the processor over the rendered prompts again for the pixel inputs and per-token
    keys, with ``add_special_tokens`` at its default: Gemma 3's tokenizer then adds a BOS to a template that holds
    one, so the ``token_type_ids`` TRL passes are a token longer than its prompt ids and Gemma 3's bidirectional
    image block lands a token late. Its rows, and vlmtrain's, are the template's tokens: the TRL side runs with no
    token added (nothing changes for a tokenizer that adds none)."""
    base = type(processor)

    class Processor(base):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **{"add_special_tokens": False, **kwargs})

    processor.__class__ = Processor
    try:
        yield
    finally:
        processor.__class__ = base


def _run(framework: str, qwen3_vl, out, peft_config=None, **kw):
    from transformers import AutoModelForImageTextToText

    path, processor = qwen3_vl
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    rollout, funcs = FixedCompletions(5, _eos(model)), [letters_reward, target_reward]
    if framework == "trl":
        import trl

        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        processor.tokenizer.padding_side = "left"  # (as TRL loads a processor: its multimodal fields left-padded)
        try:
            trainer = trl.GRPOTrainer(model=model, reward_funcs=funcs, args=_config(trl.GRPOConfig, out, **kw),
                                      train_dataset=_prompts(), processing_class=processor, rollout_func=rollout.trl,
                                      peft_config=peft_config)
            with _template_tokens_only(processor):
                trainer.train()
        finally:
            processor.tokenizer.padding_side = "right"
    else:
        trainer = vlmtrain.GRPOTrainer(model=model, reward_funcs=funcs, args=_config(vlmtrain.GRPOConfig, out, **kw),
                                       train_dataset=_prompts(), processing_class=processor, generator=rollout,
                                       peft_config=peft_config)
        trainer.train()
    policy = trainer.model if framework == "trl" else trainer.policy
    return [e for e in trainer.state.log_history if "loss" in e], {k: v.detach().clone() for k, v in
                                                                   policy.state_dict().items()}


CASES = [("qwen3_vl", "grpo", 0.1, 2, False, 1), ("qwen3_vl", "dapo", 0.0, 1, False, 1),
         ("qwen3_vl", "dr_grpo", 0.05, 1, False, 1), ("qwen3_vl", "dapo", 0.1, 1, True, 1),
         ("qwen3_vl", "dapo", 0.0, 1, False, 2), ("gemma3", "grpo", 0.1, 2, False, 1),
         ("idefics3", "dapo", 0.0, 1, False, 2)]


@requires("trl", "dev")
@pytest.mark.parametrize("family,loss_type,beta,num_iterations,lora,accum", CASES,
                         ids=[f"{f}-{t}-beta{b}-mu{m}" + ("-lora" if lo else "") + (f"-accum{a}" if a > 1 else "")
                              for f, t, b, m, lo, a in CASES])
def test_vision_grpo_equals_trl(tiny_hub, tmp_path, family, loss_type, beta, num_iterations, lora, accum):
    """Per-step loss, rewards, KL, entropy and clip ratio and the final weights (the vision tower's included) as
    TRL's, over 4 steps of AdamW with weight decay on prompts with 0, 1 and 2 images (one micro-batch text-only).
    With 2 accumulation steps a group of 4 spans 2 micro-batches of 2 rows (each encodes the group's images once;
    TRL shuffles the generation batch before splitting it: the micro-batches differ, the steps do not; beta 0, as
    a KL averaged over micro-batches would differ with them). Gemma 3 ([images, tokens, hidden] features, its
    image tokens attending each other) and Idefics3 (images cut into crops, batched per sample) as Qwen3-VL.
    LLaVA-OneVision is not compared: TRL 1.16's GRPOTrainer does not run on it (its forward passes the processor's
    ``batch_num_images`` on to ``_get_per_token_logps_and_entropies``, a TypeError); its rollout and log-probs are
    checked against the plain per-row generate and forward below."""
    from peft import LoraConfig

    fam, path, processor = tiny_hub(family)
    qwen3_vl = (path, processor)

    kw = dict(loss_type=loss_type, beta=beta, num_iterations=num_iterations)
    if accum > 1:
        kw.update(gradient_accumulation_steps=accum, per_device_train_batch_size=2, num_generations=4)
    if lora:
        kw["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "qkv"])
    trl_logs, trl_weights = _run("trl", qwen3_vl, tmp_path / "trl", **kw)
    logs, weights = _run("ours", qwen3_vl, tmp_path / "ours", **kw)
    assert len(logs) == len(trl_logs) == 4
    keys = ["loss", "reward", "reward_std", "rewards/letters_reward/mean", "rewards/target_reward/mean",
            "frac_reward_zero_std", "completions/mean_length", "clip_ratio/region_mean", "entropy"] + (
        ["kl"] if beta else [])
    for ours, theirs in zip(logs, trl_logs, strict=True):
        for key in keys:
            assert (key in ours) == (key in theirs), (key, ours["step"])
            if key in theirs:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (key, ours["step"])
    assert any(e["reward_std"] > 0 for e in logs)  # (non-zero advantages: the policy-gradient term counts)
    if beta:
        assert logs[-1]["kl"] > 0
    # (adam_epsilon 1e-6: a group's rows' gradients meet before the vision tower here and after it in TRL, and
    # with AdamW's 1e-8 m / sqrt(v) turns that summation-order noise on a near-zero gradient element into a full
    # step of its own)
    for name, value in trl_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    from transformers import AutoModelForImageTextToText

    first = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).state_dict()
    vision = [k for k in weights if k.removeprefix("base_model.model.").startswith(fam.module_groups["vision"])
              and ("lora_A" in k if lora else k.endswith("weight"))]
    assert vision
    if not lora:  # (the vision tower trained: gradients reach it through the shared features)
        assert any(not torch.equal(first[k.removeprefix("base_model.model.")], weights[k]) for k in vision)


@pytest.fixture(scope="module", params=FAMILIES)
def greedy_run(request, tiny_hub, tmp_path_factory):
    """Two steps (one generation) of vlmtrain's GRPO with its own rollout (greedy), the vision tower's calls
    counted and the rollout's completions and prefill logits recorded; ``one_image``: what the tower encodes for
    the first prompt's image alone (an image, or its crops or tiles)."""
    from transformers import AutoModelForImageTextToText

    _, path, processor = tiny_hub(request.param)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    counter = ImageCounter(model)
    first = _plain_rows(processor, list(_prompts())[:1])
    with torch.no_grad():
        model.get_image_features(**{k: v for k, v in first.items() if k not in (
            "input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")})
    one_image, counter.calls, counter.images = counter.images, 0, 0
    args = _config(vlmtrain.GRPOConfig, tmp_path_factory.mktemp("greedy"), max_steps=2, num_generations=4,
                   per_device_train_batch_size=4, steps_per_generation=2, max_completion_length=6, beta=0.1,
                   generation_kwargs={"do_sample": False})
    trainer = vlmtrain.GRPOTrainer(model=model, reward_funcs=[letters_reward, target_reward], args=args,
                                   train_dataset=_prompts(), processing_class=processor)
    prefill, ref_counter = _first_logits(model), ImageCounter(trainer.ref_model)
    recorded, generate = [], trainer.generator

    def recording(model, prompt_ids, **vision):
        out = generate(model, prompt_ids, **vision)
        recorded.append((counter.calls, counter.images, out))
        return out

    trainer.generator = recording
    trainer.train()
    return {"counter": counter, "ref_counter": ref_counter, "recorded": recorded, "prefill": prefill,
            "model": (path, processor), "one_image": one_image, "eos": _eos(model)}


def _first_logits(model) -> list[torch.Tensor]:
    """The logits of ``model``'s first forward (a rollout's prefill: the next-token logits of every row)."""
    first: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda m, args, out: None if first else first.append(out.detach().clone()))
    return first


def test_vision_grpo_encodes_each_groups_images_once(greedy_run):
    """One generation of 2 prompts x 4 completions (prompts 0 and 1: 1 image and none), 2 micro-batches of 4 rows
    (one optimizer step each): the rollout makes one vision tower call encoding the 1 image once (not 4 times);
    so do the old log-probs of the first 4 rows (the policy moves before the second micro-batch trains: computed
    with the rollout, as TRL) and its training forward; the reference (beta > 0) one call. The text-only rows
    encode nothing. On every family (Idefics3's crops, LLaVA-OneVision's tiles, Gemma 3's images: ``one``)."""
    (calls, images, _), = greedy_run["recorded"]
    counter, one = greedy_run["counter"], greedy_run["one_image"]
    assert one >= 1
    assert (calls, images) == (1, one)  # the rollout
    assert (counter.calls, counter.images) == (3, 3 * one)  # + the old log-probs and the first micro-batch's forward
    assert (greedy_run["ref_counter"].calls, greedy_run["ref_counter"].images) == (1, one)


def _plain_rows(processor, rows: list[dict]) -> dict:
    """The processor over the rows' prompts (left-padded), each row with its own copy of its images, the template's
    tokens only (as TRL's prompt ids: Gemma 3's tokenizer would add a second BOS)."""
    texts = [processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}] * len(r["images"])
                                             + [{"type": "text", "text": r["prompt"][0]["content"]}]}],
                                           tokenize=False, add_generation_prompt=True) for r in rows]
    processor.tokenizer.padding_side = "left"
    try:
        return processor(text=texts, images=[r["images"] for r in rows], padding=True, return_tensors="pt",
                         add_special_tokens=False)
    finally:
        processor.tokenizer.padding_side = "right"


def test_vision_grpo_rollout_equals_a_plain_per_row_generate(greedy_run):
    """The rollout's completions (images encoded once per group, the features shared by its rows) equal greedy
    generate over the 8 rows, each with its own copy of its prompt's images (the processor over the rows), and
    so do the logits of the prefill."""
    from transformers import AutoModelForImageTextToText

    path, processor = greedy_run["model"]
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    rows = [r for r in list(_prompts())[:2] for _ in range(4)]
    plain, eos = _plain_rows(processor, rows), model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    prefill = _first_logits(model)
    out = model.generate(**plain, max_new_tokens=6, do_sample=False, pad_token_id=processor.tokenizer.pad_token_id,
                         eos_token_id=eos, suppress_tokens=[model.config.image_token_id])
    expected = []
    for row in out[:, plain["input_ids"].shape[1]:].tolist():
        end = next((i for i, t in enumerate(row) if t in eos), None)
        expected.append(row if end is None else row[:end + 1])
    (_, _, completions), = greedy_run["recorded"]
    assert completions == expected
    # (the prefill's logits too, which tokens alone would hide: image features and rotary positions agree)
    torch.testing.assert_close(greedy_run["prefill"][0], prefill[0], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(prefill[0][0], prefill[0][4])  # (the two prompts' rows differ)


def test_vision_grpo_refuses_string_prompts_before_loading(tmp_path):
    """Images need conversational prompts (TRL's rule): one line, before the model loads (the path does not exist;
    videos on a family without them: tests/test_grpo_video.py)."""
    from datasets import Dataset

    args = _config(vlmtrain.GRPOConfig, tmp_path, reward_weights=None)
    text = Dataset.from_list([{"prompt": "what colour?", "image": Image.new("RGB", (32, 32))}] * 2)
    with pytest.raises(ConfigError, match="conversational prompts"):
        vlmtrain.GRPOTrainer(model=str(tmp_path / "missing"), reward_funcs=letters_reward, args=args,
                             train_dataset=text)


def test_vision_grpo_refuses_a_model_no_family_covers(qwen3_vl, tmp_path):
    """Prompts with images for a model no Hub VLM family covers (a text-only Llama): one line naming the model
    types GRPO takes images on."""
    from tests.tiny import tiny_llama

    args = _config(vlmtrain.GRPOConfig, tmp_path, reward_weights=None)
    with pytest.raises(ConfigError, match=r"the model is a 'llama'; vlmtrain's GRPO takes images on the Hub VLM "
                                          r"families' models \(gemma3, idefics3, llava_onevision, qwen2_5_vl, "
                                          r"qwen3_vl, smolvlm\)"):
        vlmtrain.GRPOTrainer(model=tiny_llama(), reward_funcs=letters_reward, args=args, train_dataset=_prompts(),
                             processing_class=qwen3_vl[1])


@pytest.mark.parametrize("family", [*FAMILIES, "smolvlm"])
def test_vision_groups_cut_by_a_process_slice_give_each_row_its_prompts_features(tiny_hub, tmp_path, family):
    """A process's slice of a generation batch may cut groups (4 completions a prompt; 8 rows from row 2 on: 2 of a
    prompt with 2 images, 4 of one with 1, 2 of a text-only one), and micro-batches of 4 rows cut them again (the
    1-image group spans both): each row still reads its own prompt's tokens and features, each micro-batch gives
    the images of the groups it holds once (one vision tower call), and the completion log-probs equal those of the
    plain forward of the 8 rows, each with its own copy of its images, on every family (SmolVLM2: the idefics3
    family's other model type, its own processor)."""
    from transformers import AutoModelForImageTextToText

    from vlmtrain.compat.grpo_rollout import pad_rows
    from vlmtrain.compat.grpo_vision import check_vision_model, encode_groups, rows_of
    from vlmtrain.data.preference_vision import ROW_TOKEN_KEYS
    from vlmtrain.models.objectives.grpo import completion_logps, vision_inputs

    if family == "smolvlm":
        fam, _, _ = tiny_hub("idefics3")
        path = fam.build_tiny(str(tmp_path), model_type="smolvlm")
        processor = fam.load_processor(path)
    else:
        _, path, processor = tiny_hub(family)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.model_type == family
    data = list(_prompts())
    rows = [data[4]] * 2 + [data[5]] * 4 + [data[6]] * 2  # (2 images, 1, none)
    groups = encode_groups(processor, rows, model.config.image_token_id, check_vision_model(model).batch_layout)
    assert groups.row_group == [0, 0, 1, 1, 1, 1, 2, 2]
    pad = processor.tokenizer.pad_token_id
    ids, mask = pad_rows(groups.row_prompt_ids(), pad, "left")
    completions = torch.tensor([[64, 65, 66, _eos(model)]] * 8)
    batch = {"input_ids": torch.cat([ids, completions], 1), "attention_mask": torch.cat(
        [mask, torch.ones_like(completions)], 1), **groups.token_rows(ids.shape[1], 4), "vision": groups}
    plain = _plain_rows(processor, rows)
    assert torch.equal(plain["input_ids"], ids)
    assert groups.inputs(0, 8)["vision_pixel_values"].shape[0] < plain["pixel_values"].shape[0]  # (each group once)
    counter, ours = ImageCounter(model), []
    with torch.no_grad():
        for start in (0, 4):
            micro = rows_of(batch, start, start + 4)
            ours.append(completion_logps(model, micro["input_ids"], micro["attention_mask"], completions[:4], 1.0,
                                         **vision_inputs(micro))[0])
        assert counter.calls == 2
        extra = {k: torch.cat([v, torch.zeros_like(completions)], 1) if k in ROW_TOKEN_KEYS else v
                 for k, v in plain.items() if k not in ("input_ids", "attention_mask")}
        expected = completion_logps(model, batch["input_ids"], batch["attention_mask"], completions, 1.0, **extra)[0]
    torch.testing.assert_close(torch.cat(ours), expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(expected[0], expected[2])  # (the groups' rows differ)
