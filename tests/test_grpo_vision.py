"""vlmtrain.GRPOTrainer on a vision-language model with TRL 1.16's layout (conversational prompts, an ``images``
column): equal to TRL's GRPOTrainer on a tiny Qwen3-VL given the same completions, a mixed generation batch (prompts
with 0, 1 and 2 images, a micro-batch without any) included; each group's images encoded once per rollout and
once per training forward, the completions those of a plain per-row generate."""

from __future__ import annotations

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
    """test_grpo.py's deterministic completions (some end with EOS, others run to the limit) in the tiny Qwen3-VL's
    vocabulary; the prompt ids TRL's rollout_func returns are its processor's, as TRL's own generation path
    tokenizes them."""

    def completions(self, count: int) -> list[list[int]]:
        return [[EOS if t == text_grpo.EOS else 60 + t for t in row] for row in super().completions(count)]  # (a..l)

    def __call__(self, model, prompt_ids, **vision):  # vlmtrain's Generator
        return self.completions(len(prompt_ids))

    def trl(self, prompts, trainer):  # TRL's rollout_func
        proc = trainer.processing_class
        ids = [proc.apply_chat_template([p], add_generation_prompt=True, tokenize=True, return_dict=True)
               ["input_ids"][0] for p in prompts]
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


def _config(cls, out, **kw):
    base = dict(num_generations=2, per_device_train_batch_size=4, max_completion_length=5, max_steps=4,
                learning_rate=3e-3, weight_decay=0.1, adam_epsilon=1e-6, logging_steps=1, seed=7, bf16=False, shuffle_dataset=False,
                gradient_checkpointing=False, report_to="none", save_strategy="no", use_cpu=True,
                dataloader_num_workers=0, disable_tqdm=True, reward_weights=[1.0, 0.5])
    return cls(str(out), **{**base, **kw})


def _run(framework: str, qwen3_vl, out, peft_config=None, **kw):
    from transformers import AutoModelForImageTextToText

    path, processor = qwen3_vl
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    rollout, funcs = FixedCompletions(5), [letters_reward, target_reward]
    if framework == "trl":
        import trl

        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        processor.tokenizer.padding_side = "left"  # (as TRL loads a processor: its multimodal fields left-padded)
        try:
            trainer = trl.GRPOTrainer(model=model, reward_funcs=funcs, args=_config(trl.GRPOConfig, out, **kw),
                                      train_dataset=_prompts(), processing_class=processor, rollout_func=rollout.trl,
                                      peft_config=peft_config)
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


CASES = [("grpo", 0.1, 2, False, 1), ("dapo", 0.0, 1, False, 1), ("dr_grpo", 0.05, 1, False, 1),
         ("dapo", 0.1, 1, True, 1), ("dapo", 0.0, 1, False, 2)]


@requires("trl", "dev")
@pytest.mark.parametrize("loss_type,beta,num_iterations,lora,accum", CASES,
                         ids=[f"{t}-beta{b}-mu{m}" + ("-lora" if lo else "") + (f"-accum{a}" if a > 1 else "")
                              for t, b, m, lo, a in CASES])
def test_vision_grpo_equals_trl(qwen3_vl, tmp_path, loss_type, beta, num_iterations, lora, accum):
    """Per-step loss, rewards, KL, entropy and clip ratio and the final weights (the vision tower's included) as
    TRL's, over 4 steps of AdamW with weight decay on prompts with 0, 1 and 2 images (one micro-batch text-only).
    With 2 accumulation steps a group of 4 spans 2 micro-batches of 2 rows (each encodes the group's images once;
    TRL shuffles the generation batch before splitting it: the micro-batches differ, the steps do not; beta 0, as
    a KL averaged over micro-batches would differ with them)."""
    from peft import LoraConfig

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
    path, _ = qwen3_vl
    from safetensors.torch import load_file

    first = load_file(os.path.join(path, "model.safetensors"))
    vision = [k for k in weights if ".visual." in k and ("lora_A" in k if lora else k.endswith("qkv.weight"))]
    assert vision
    if not lora:  # (the vision tower trained: gradients reach it through the shared features)
        assert any(not torch.equal(first[k.removeprefix("base_model.model.")], weights[k]) for k in vision)


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen2_5_vl"])
def greedy_run(request, tiny_hub, tmp_path_factory):
    """Two steps (one generation) of vlmtrain's GRPO with its own rollout (greedy), the vision tower's calls
    counted and the rollout's completions and prefill logits recorded."""
    from transformers import AutoModelForImageTextToText

    _, path, processor = tiny_hub(request.param)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    args = _config(vlmtrain.GRPOConfig, tmp_path_factory.mktemp("greedy"), max_steps=2, num_generations=4,
                   per_device_train_batch_size=4, steps_per_generation=2, max_completion_length=6, beta=0.1,
                   generation_kwargs={"do_sample": False})
    trainer = vlmtrain.GRPOTrainer(model=model, reward_funcs=[letters_reward, target_reward], args=args,
                                   train_dataset=_prompts(), processing_class=processor)
    counter, prefill = TowerCounter(model.model.visual), _first_logits(model)
    ref_counter = TowerCounter(trainer.ref_model.model.visual)
    recorded, generate = [], trainer.generator

    def recording(model, prompt_ids, **vision):
        out = generate(model, prompt_ids, **vision)
        recorded.append((counter.calls, counter.images, out))
        return out

    trainer.generator = recording
    trainer.train()
    return {"counter": counter, "ref_counter": ref_counter, "recorded": recorded, "prefill": prefill,
            "model": (path, processor)}


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
    encode nothing."""
    (calls, images, _), = greedy_run["recorded"]
    counter = greedy_run["counter"]
    assert (calls, images) == (1, 1)  # the rollout
    assert (counter.calls, counter.images) == (3, 3)  # + the old log-probs and the first micro-batch's forward
    assert (greedy_run["ref_counter"].calls, greedy_run["ref_counter"].images) == (1, 1)


def _plain_rows(processor, rows: list[dict]) -> dict:
    """The processor over the rows' prompts (left-padded), each row with its own copy of its images."""
    texts = [processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}] * len(r["images"])
                                             + [{"type": "text", "text": r["prompt"][0]["content"]}]}],
                                           tokenize=False, add_generation_prompt=True) for r in rows]
    processor.tokenizer.padding_side = "left"
    try:
        return processor(text=texts, images=[im for r in rows for im in r["images"]], padding=True,
                         return_tensors="pt")
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
    plain = _plain_rows(processor, rows)
    prefill = _first_logits(model)
    out = model.generate(**plain, max_new_tokens=6, do_sample=False, pad_token_id=256, eos_token_id=[EOS],
                         suppress_tokens=[model.config.image_token_id])
    expected = []
    for row in out[:, plain["input_ids"].shape[1]:].tolist():
        end = next((i for i, t in enumerate(row) if t == EOS), None)
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


def test_vision_groups_cut_by_a_process_slice_give_each_row_its_prompts_features(qwen3_vl):
    """A process's slice of a generation batch may cut groups (4 completions a prompt; 6 rows from row 2 on: 2 of
    one prompt, 4 of the next): each row still reads its own prompt's tokens and features, each group's images
    given once, and the completion log-probs equal those of the plain forward of the rows, each with its own copy
    of its images."""
    from transformers import AutoModelForImageTextToText

    from vlmtrain.compat.grpo_rollout import pad_rows
    from vlmtrain.compat.grpo_vision import encode_groups
    from vlmtrain.models.objectives.grpo import completion_logps

    path, processor = qwen3_vl
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    data = list(_prompts())
    rows = [data[4]] * 2 + [data[5]] * 4  # (2 images, then 1)
    groups = encode_groups(processor, rows, model.config.image_token_id)
    assert groups.row_group == [0, 0, 1, 1, 1, 1]
    ids, mask = pad_rows(groups.row_prompt_ids(), 256, "left")
    completions = torch.tensor([[64, 65, 66, EOS]] * 6)
    vision = {**groups.inputs(0, 6), "mm_token_type_ids": groups.token_type_rows(ids.shape[1], 4)}
    assert vision["vision_image_grid_thw"].shape[0] == 3  # (each group's images once: 2 + 1, not 8)
    inputs = (torch.cat([ids, completions], 1), torch.cat([mask, torch.ones_like(completions)], 1), completions)
    with torch.no_grad():
        ours = completion_logps(model, *inputs, 1.0, **vision)[0]
    plain = _plain_rows(processor, rows)
    assert torch.equal(plain["input_ids"], ids)
    types = torch.cat([plain["mm_token_type_ids"], torch.zeros_like(completions)], 1)
    with torch.no_grad():
        expected = completion_logps(model, *inputs, 1.0, pixel_values=plain["pixel_values"],
                                    image_grid_thw=plain["image_grid_thw"], mm_token_type_ids=types)[0]
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
