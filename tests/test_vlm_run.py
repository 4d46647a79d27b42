"""The VLM through the config: shapes-VQA and the_cauldron JSONL sources, per-type evaluation, checks."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from vlmtrain import run
from vlmtrain.config import ConfigError, load_run_config
from vlmtrain.data.cauldron import write_cauldron_jsonl
from vlmtrain.tasks.shapes import QTYPES, ShapesVQA

ROOT = Path(__file__).resolve().parents[1]

TINY = {
    "model": {
        "kind": "vlm",
        "vision": {"model_type": "siglip_vision_model", "image_size": 64, "patch_size": 8, "hidden_size": 32,
                   "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2},
        "text": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                 "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 256},
        "pixel_shuffle_factor": 2,
    },
    "data": {"source": "shapes", "num_train": 32, "num_eval": 4},
    "train": {"max_steps": 2, "per_device_train_batch_size": 8, "per_device_eval_batch_size": 8,
              "logging_steps": 1, "eval_strategy": "steps", "eval_steps": 2, "save_steps": 2,
              "predict_with_generate": True, "generation_max_new_tokens": 3, "disable_tqdm": True,
              "module_learning_rates": {"projector": 5e-3, "vision_encoder": 1e-3, "decoder": 1e-3}},
}


def _config(tmp_path, **sections):
    data = {k: {**v, **sections.get(k, {})} for k, v in TINY.items()}
    data["train"]["output_dir"] = str(tmp_path / "run")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_run_config(path)


def test_shapes_vlm_trains_and_evaluates_per_question_type(tmp_path):
    cfg = _config(tmp_path)
    metrics = run.train(cfg)
    for q in QTYPES:
        assert 0.0 <= metrics[f"eval_{q}_exact_match"] <= 1.0
        assert math.isfinite(metrics[f"eval_{q}_loss"])
    assert (tmp_path / "run" / "checkpoint-2" / "model.safetensors").is_file()
    logs = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert "learning_rate_projector" in logs
    # vlmtrain eval --checkpoint: the saved weights and tokenizer give the same evaluation.
    again = run.evaluate(cfg, checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert again["eval_count_loss"] == pytest.approx(metrics["eval_count_loss"], rel=1e-6)

    # vlmtrain generate: the checkpoint answers from images, and a bad image is a clear error.
    sample = ShapesVQA("test", 1, seed=5, multi_image_fraction=1.0)[0]
    paths = []
    for k, image in enumerate(sample["images"]):
        paths.append(str(tmp_path / f"img{k}.png"))
        image.save(paths[-1])
    answer = run.generate(str(tmp_path / "run"), sample["texts"][0]["user"], images=paths, max_new_tokens=3)
    expected = _greedy_answer(tmp_path / "run" / "checkpoint-2", sample["texts"][0]["user"], paths, 3)
    assert expected and answer == expected  # (2 steps: not a right answer, but a non-empty, known one)
    with pytest.raises(ConfigError, match="missing_image"):
        run.generate(str(tmp_path / "run"), "What color?", images=[str(tmp_path / "nope.png")])

    # scripts/shapes_lookup.py reads the same checkpoint: every head's attention is split over the four groups;
    # of the text, the share on the naming word(s) and the token drawing the most.
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "shapes_lookup.py"), str(tmp_path / "run" / "checkpoint-2"),
                          "--samples", "4", "--json"], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    assert set(report) == {"color", "shape", "position", "side"}
    for r in report.values():
        assert 0.0 <= r["accuracy"] <= 1.0
        for head in (h for layer in r["attention"] for h in layer):
            groups = {k: head[k] for k in ("named", "other_objects", "background", "text")}
            assert set(head) == set(groups) | {"named_words", "top_text"}
            assert sum(groups.values()) == pytest.approx(1.0, abs=5e-3) and head["named"] > 0.0
            assert 0.0 < head["named_words"] <= head["text"] + 1e-3  # the question names its object(s)
            word, share = head["top_text"]
            assert isinstance(word, str) and 0.0 < share <= head["text"] + 1e-3



def _greedy_answer(checkpoint: Path, question: str, images: list[str], max_new_tokens: int) -> str:
    """The checkpoint's greedy answer, decoded here: the whole sequence recomputed each step (no KV cache,
    no generate()), argmax of the last position's logits, until end of sequence."""
    import torch
    from transformers import AutoTokenizer

    from vlmtrain.data.processing import VLMProcessor
    from vlmtrain.models.own_vlm.vlm import VisionLanguageModel

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = VisionLanguageModel.from_pretrained(checkpoint).eval()
    processor = VLMProcessor.for_checkpoint(tokenizer, model.config, max_images=len(images))
    sample = processor.process({"images": images, "texts": [{"user": question, "assistant": "-"}]})
    ids, new = sample["prompt_input_ids"][None], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(input_ids=ids, pixel_values=sample["pixel_values"])["logits"][0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokenizer.decode(new, skip_special_tokens=True).strip()


def test_demo_workers_on_a_gpu_machine_and_the_same_run_with_them(tmp_path, capsys):
    """The demo gives a config without workers 4 on a CUDA machine with 6+ cores (it waits for data there);
    with workers the demo is the same run: same losses step by step and the same evaluation."""
    assert run.demo_workers(0, cuda=True, cpus=16) == 4
    assert run.demo_workers(0, cuda=False, cpus=16) == run.demo_workers(0, cuda=True, cpus=2) == 0
    assert run.demo_workers(2, cuda=True, cpus=16) == 2  # the config's own number stands
    _config(tmp_path, data={"side_warmup_steps": 1, "lookup_warmup_steps": 1},  # data that follows the step
            train={"max_steps": 3, "eval_steps": 3, "save_steps": 3})
    runs = {}
    for workers in (0, 2):
        out = tmp_path / f"w{workers}"
        metrics = run.demo(config=str(tmp_path / "cfg.yaml"), output_dir=str(out),
                           overrides={"train.dataloader_num_workers": workers})
        printed = capsys.readouterr().out
        assert ("2 data-loader workers" in printed) == (workers == 2)
        losses = [(r["step"], r["loss"]) for r in map(json.loads, open(out / "metrics.jsonl")) if "loss" in r]
        runs[workers] = losses, {k: v for k, v in metrics.items() if k.endswith(("_exact_match", "_loss"))}
    assert len(runs[0][0]) == 3 and runs[0][0] == runs[2][0]
    assert runs[0][1] and runs[0][1] == runs[2][1]

def test_demo_report_for_a_shapes_config(tmp_path, capsys):
    """`vlmtrain demo --config --seed` on a (tiny) shapes config: per-type table, blank-image baseline, chance,
    right and wrong examples per type, the time spent, paths; --seed sets both seeds."""
    cfg = _config(tmp_path)
    metrics = run.demo(config=str(tmp_path / "cfg.yaml"), seed=3)
    saved = load_run_config(tmp_path / "run" / "config.yaml")
    assert saved.train.seed == saved.data.seed == 3 and (cfg.train.seed, cfg.data.seed) == (42, 0)
    printed = capsys.readouterr().out
    assert "train.seed 3, data.seed 3" in printed
    examples = [line for line in printed.splitlines() if line.startswith("    [")]
    for q in QTYPES:  # 2 right and 2 wrong at most per type; a tiny 2-step model gets most wrong
        shown = [line for line in examples if line.startswith(f"    [{q}] ")]
        assert 1 <= len(shown) <= 4 and sum("] wrong: " in line for line in shown) <= 2, shown
        assert all(" -> " in line and ("(truth " in line) == ("] wrong: " in line) for line in shown)
    assert any("] wrong: " in line for line in examples)
    assert "s training (" in printed and "steps/s)" in printed and "s in all" in printed
    for q in QTYPES:
        assert f"blank_{q}_exact_match" in metrics and q in printed
    assert {"eval_single_image_exact_match", "eval_multi_image_exact_match", "blank_single_image_exact_match",
            "blank_multi_image_exact_match"} <= set(metrics)
    assert "single-image (mean)" in printed and "multi-image (mean)" in printed and "chance" in printed
    assert "held-out examples" in printed and str(cfg.train.output_dir) in printed
    report = tmp_path / "run" / "report.html"  # the demo ends with the run report (vlmtrain report)
    assert report.is_file() and f"report:      {report}" in printed and "step 2:" in report.read_text()
    with pytest.raises(ConfigError, match="does not exist"):
        run.demo(config=str(tmp_path / "nope.yaml"))


def test_demo_console_is_the_bar_a_line_per_evaluation_and_the_table(tmp_path, capsys):
    """While the demo trains it prints one line per evaluation (headline numbers, no line per log or per eval
    set), marks a type the warm-up has not asked yet and says why, and starts without library warnings."""
    _config(tmp_path, data={"lookup_warmup_steps": 2, "side_fraction": 0.5, "num_eval": 2},
            train={"max_steps": 4, "eval_steps": 2, "save_steps": 4, "disable_tqdm": False})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = run.demo(config=str(tmp_path / "cfg.yaml"))
    assert not [str(w.message) for w in caught if "deprecated" in str(w.message)]
    out = capsys.readouterr()
    lines = [line for line in out.out.splitlines() if line.strip()]
    evals = [line for line in lines if line.startswith("[step ")]
    assert [line.split("]")[0] for line in evals] == ["[step 2/4", "[step 4/4"], evals
    assert f"eval exact match {metrics['eval_exact_match']:.3f}, loss {metrics['eval_loss']:.3f}" in evals[1]
    assert f"single-image {metrics['eval_single_image_exact_match']:.3f}" in evals[1]
    for q in QTYPES:
        assert f"{q} {metrics[f'eval_{q}_exact_match']:.3f}" in evals[1]
    note = lines[lines.index(evals[0]) + 1]  # steps 0-1 asked look-up questions only: no count question yet
    assert re.search(r" count \d\.\d{3}\*,", evals[0]) and evals[0].count("*") == 1 and "*" not in evals[1]
    assert note.startswith("  * by design, not asked in training yet") and "count (data.lookup_warmup_steps: 2" in note
    assert lines[lines.index(evals[1]) + 1].startswith("vlmtrain demo (")  # then the final table
    assert not [line for line in lines if "loss=" in line or line.startswith("[step") and "blank" in line]
    assert "held-out exact match" in out.out and "blank images" in out.out


def test_eval_line_of_one_eval_set_and_of_named_sets():
    from vlmtrain.logging.console import eval_line

    assert eval_line(500, {"eval_loss": 0.25, "eval_exact_match": 0.875, "eval_samples": 8}, 1000) == \
        "[step 500/1000] eval exact match 0.875, loss 0.250"
    assert eval_line(7, {"eval_loss": 1.5, "eval_runtime": 2.0}) == "[step 7] eval loss 1.500"
    named = {"eval_a_loss": 1.0, "eval_a_exact_match": 0.5, "eval_a_samples": 2, "eval_b_loss": 2.0,
             "eval_b_exact_match": 0.0, "eval_b_samples": 2, "eval_loss": 1.5, "eval_exact_match": 0.25}
    assert eval_line(4, named, 8, summary=lambda m, p: {f"{p}_mean_exact_match": 0.25, f"{p}_x_loss": 9.0},
                     untrained={"b": "data.k: 5", "c": "not an eval set"}) == (
        "[step 4/8] eval exact match 0.250, loss 1.500 | mean 0.250 | a 0.500, b 0.000*\n"
        "  * by design, not asked in training yet (a warm-up curriculum, see docs/own-vlm.md): b (data.k: 5)")


@pytest.mark.parametrize("options", [
    {"lookup_warmup_steps": 3, "side_warmup_steps": 2, "side_fraction": 0.4, "questions_per_sample": 3},
    {"side_fraction": 1.0, "multi_image_fraction": 0.0},
    {"multi_image_fraction": 1.0, "lookup_warmup_steps": 2},
])
def test_shapes_questions_asked_before_a_step_are_what_the_training_items_ask(options):
    """qtypes_asked_before(step), which the demo uses to explain a type at 0 by design, is exactly the set of
    question types (first questions and extra turns) that training items of the steps before ask."""
    train = ShapesVQA("train", 400, seed=0, **options)
    for step in (1, 2, 3, 4, 6):
        drawn = {q for at in range(step) for i in range(0, 400, 2) for q in train.get_item_at_step(i, at)["turn_qtypes"]}
        assert drawn == train.qtypes_asked_before(step), (step, options)
    assert train.qtypes_asked_before(0) == set()


def test_demo_names_the_types_a_warm_up_has_not_asked(tmp_path):
    from vlmtrain.tasks.shapes_source import untrained

    data = _config(tmp_path, data={"lookup_warmup_steps": 1000, "side_fraction": 0.4}).data
    assert set(untrained(data, 1000)) == {"count"} and "data.lookup_warmup_steps: 1000" in untrained(data, 1000)["count"]
    assert untrained(data, 1001) == {} and untrained(data, 0) == {}
    data = _config(tmp_path, data={"multi_image_fraction": 0.0}).data
    assert set(untrained(data, 5)) == {"multi_count", "multi_color", "side"}


def test_demo_examples_show_right_and_wrong_answers_per_type():
    from types import SimpleNamespace

    from vlmtrain.tasks.shapes_source import _examples

    evals = {q: ShapesVQA("val", 6, seed=0, qtypes=[q]) for q in ("color", "count")}
    truths = [evals[q][i]["texts"][-1]["assistant"] for q in evals for i in range(6)]
    answers = [t if i % 3 else "nope" for i, t in enumerate(truths)]  # 2 wrong, 4 right per type
    trainer = SimpleNamespace(eval_dataset=evals, predict=lambda samples: SimpleNamespace(texts=answers))
    lines = _examples(trainer).splitlines()[1:]
    kinds = [line.split("]")[0].strip() + "]" + line.split("]")[1].split(":")[0] for line in lines]
    assert kinds == ["[color] right", "[color] right", "[color] wrong", "[color] wrong",
                     "[count] right", "[count] right", "[count] wrong", "[count] wrong"]
    assert lines[2].endswith(f"-> 'nope' (truth {truths[0]!r})") and "truth" not in lines[0]


def test_demo_seed_option_reaches_the_run(monkeypatch):
    from vlmtrain.cli import main

    calls = []
    monkeypatch.setattr(run, "demo", lambda **kw: calls.append(kw))
    assert main(["demo", "--seed", "2"]) == 0 and main(["demo"]) == 0
    assert [c["seed"] for c in calls] == [2, None]
    assert main(["demo", "--seed", "two"]) == 2  # a bad value is a usage error, not a traceback


def test_jsonl_source_in_cauldron_schema(tmp_path):
    path = write_cauldron_jsonl(ShapesVQA("train", 16, seed=1), str(tmp_path / "data"), name="train")
    cfg = _config(tmp_path, data={"source": "jsonl", "train_file": path, "eval_file": path})
    trainer = run.build(cfg)
    out = trainer.train()
    assert out.global_step == 2 and math.isfinite(out.training_loss)
    assert "eval_exact_match" in trainer.evaluate()


def test_bad_samples_are_skipped_counted_and_logged(tmp_path):
    """Missing/corrupt images and empty conversations never stop a run: each is counted by reason, per logging
    window in metrics.jsonl (also from DataLoader workers) and in total at the end and in evaluation."""
    data = tmp_path / "data"
    path = write_cauldron_jsonl(ShapesVQA("train", 13, seed=1), str(data), name="train")
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    (data / rows[0]["images"][0]).unlink()  # missing_image
    (data / rows[1]["images"][0]).write_bytes(b"not a png")  # corrupt_image
    with open(path, "a") as f:
        f.write(json.dumps({"images": [], "texts": []}) + "\n")  # empty_conversation
    cfg = _config(tmp_path, data={"source": "jsonl", "train_file": path, "eval_file": path},
                  train={"max_steps": 4, "dataloader_num_workers": 2, "eval_steps": 4, "save_strategy": "no"})
    trainer = run.build(cfg)
    with pytest.warns(UserWarning, match="6 training samples were skipped"):  # the end-of-run summary
        out = trainer.train()  # 14 samples, batch 8: 2 batches per epoch, so 4 steps see every bad sample twice
    expected = {"missing_image": 2, "corrupt_image": 2, "empty_conversation": 2}
    assert {k: v for k, v in out.metrics.items() if k.startswith("train_skipped_")} == {
        f"train_skipped_{k}": v for k, v in expected.items()}
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    per_window = {k: sum(row.get(f"skipped_{k}", 0) for row in logged) for k in expected}
    assert per_window == expected
    evaluation = next(row for row in logged if "eval_loss" in row)
    assert {k: evaluation.get(f"eval_skipped_{k}") for k in expected} == {k: 1 for k in expected}
    assert evaluation["eval_samples"] == 11


@pytest.mark.parametrize("sections,message", [
    ({"model": {"kind": "causal_lm"}}, "data.source='shapes' needs model.kind='vlm'"),
    ({"data": {"source": "jsonl"}}, "train_file"),
    ({"model": {"vision": None}}, "needs model.vision and model.text"),
])
def test_inconsistent_sections_fail_at_load(tmp_path, sections, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, **sections)


def test_unknown_vision_type_fails_before_data_is_built(tmp_path, monkeypatch):
    import vlmtrain.tasks.shapes as synthetic

    monkeypatch.setattr(synthetic, "ShapesVQA", lambda *a, **k: pytest.fail("data built before the model check"))
    cfg = _config(tmp_path, model={"vision": {"model_type": "siglip_vision", "image_size": 64}})
    with pytest.raises(ConfigError, match="siglip_vision_model"):
        run.build(cfg)


# Offline stand-ins of the same families for the Hub names in shipped configs (no network in tests).
TINY_BY_HUB_NAME = {
    "google/siglip2-base-patch16-512": {"model_type": "siglip2_vision_model", "num_patches": 64, "patch_size": 8,
                                        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                        "num_attention_heads": 2},
    "HuggingFaceTB/SmolLM2-360M-Instruct": TINY["model"]["text"],
}


@pytest.mark.parametrize("path", sorted(ROOT.glob("configs/*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_builds_at_tiny_scale(path, tmp_path):
    cfg = load_run_config(path)
    if cfg.model.kind != "vlm":
        return  # causal-LM configs are built and trained by test_e2e / test_config
    for key in ("vision", "text"):
        spec = getattr(cfg.model, key)
        if isinstance(spec, str):
            assert spec in TINY_BY_HUB_NAME, f"add a tiny stand-in for {spec}"
            setattr(cfg.model, key, TINY_BY_HUB_NAME[spec])
    cfg.model.tokenizer, cfg.model.load_backbone = None, False
    if cfg.data.source == "jsonl":
        data = write_cauldron_jsonl(ShapesVQA("train", 8, seed=2), str(tmp_path / "data"), name="d")
        cfg.data.train_file = cfg.data.eval_file = data
    cfg.data.num_train, cfg.data.num_eval = min(cfg.data.num_train, 16), min(cfg.data.num_eval, 2)
    trainer = run.build(cfg)
    model = trainer.model
    assert model.config.image_token_length > 0 and {"vision_encoder", "projector", "decoder"} <= {
        n for n, _ in model.named_children()}
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    out = model(**{k: v for k, v in batch.items() if not k.startswith("prompt_")})
    assert math.isfinite(out["loss"].item())


def test_image_normalization_comes_from_the_config(tmp_path):
    trainer = run.build(_config(tmp_path, data={"image_mean": [0.94] * 3, "image_std": [0.25] * 3}))
    batch = trainer.data_collator([trainer.train_dataset[0]])
    # The grey-240 background of shapes images maps to ~0 with its own mean.
    assert abs(float(batch["pixel_values"][0, :, 0, 0].mean())) < 0.01
    with pytest.raises(ConfigError, match="3 values"):
        _config(tmp_path, data={"image_std": [0.5, 0.5]})


def test_trained_tokenizer_spends_one_token_per_role_name(tmp_path):
    """The BPE trained for a run sees the chat roles, so a turn's template costs 10 tokens (5 a message), not ~19."""
    trainer = run.build(_config(tmp_path, data={"questions_per_sample": 3}))
    tok = trainer.processing_class
    assert len(tok("user").input_ids) == 1 and len(tok("assistant").input_ids) == 1
    sample = trainer.train_dataset[0]
    row = trainer.data_collator([sample])["attention_mask"].sum().item()
    content = sum(len(tok(t[role]).input_ids) for t in sample["texts"] for role in ("user", "assistant"))
    per_turn = (row - content - trainer.model.config.image_token_length) / len(sample["texts"])
    assert per_turn == 10, per_turn  # <|im_start|> role \n ... <|im_end|> \n: 5 tokens a message, 2 a turn


def test_trained_tokenizer_sees_every_phase_of_a_curriculum(tmp_path):
    """With a lookup warm-up the first items ask no count questions; the BPE still learns their words because
    it reads the items as the steps across the whole run see them."""
    data = {"lookup_warmup_steps": 5, "num_train": 400}
    warm = run.build(_config(tmp_path, data=data, train={"max_steps": 10})).processing_class
    never = run.build(_config(tmp_path, data=data, train={"max_steps": 5})).processing_class  # all warm-up
    question = "How many crosses are there?"
    assert len(warm(question).input_ids) <= 6 < len(never(question).input_ids)


def test_generate_preprocesses_images_as_training_did(tmp_path, monkeypatch):
    from vlmtrain.data.processing import VLMProcessor

    cfg = _config(tmp_path, data={"image_mean": [0.94] * 3, "image_std": [0.25] * 3}, train={"max_steps": 1})
    run.train(cfg)
    seen = []
    original = VLMProcessor.to_tensor
    monkeypatch.setattr(VLMProcessor, "to_tensor", lambda self, img: seen.append(original(self, img)) or seen[-1])
    path = str(tmp_path / "img.png")
    ShapesVQA("test", 1, qtypes=["color"])[0]["images"][0].save(path)
    run.generate(str(tmp_path / "run"), "What color is the circle?", images=[path], max_new_tokens=2)
    assert abs(float(seen[0][:, 0, 0].mean())) < 0.01  # the background maps to ~0 with the run's own mean
