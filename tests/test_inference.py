"""Inference from a trained Hub VLM with two score heads (tiny Qwen3-VL, LoRA): vlmtrain.load_for_inference,
`vlmtrain predict --data` on new JSONL / WebDataset data, the eval-set predict under skips, and the folder of
`vlmtrain export --merge` reloaded with transformers + vlmtrain.attach_heads. Scores must equal what evaluation
computes for the same samples."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
import yaml
from optional_extras import requires
from PIL import Image

import vlmtrain
from vlmtrain import cli, prediction, run
from vlmtrain.config import ConfigError, load_run_config
from vlmtrain.models.families import get_family

pytestmark = [requires("peft", "lora"), pytest.mark.usefixtures("one_thread")]

COLORS = [(220, 40, 40), (40, 160, 40), (40, 40, 220)]
HEADS = {"color": {"type": "classification", "num_outputs": 3},
         "level": {"type": "regression", "loss": "huber", "weight": 0.5}}


def _records(folder, n: int, start: int = 0) -> list[dict]:
    rows = []
    for i in range(start, start + n):
        c = i % len(COLORS)
        Image.new("RGB", (32, 32 + 16 * (i % 2)), COLORS[c]).save(folder / f"{i}.png")
        texts = [{"user": f"Which colour? ({i})", "assistant": "rgb"[c]}] if i % 3 == 0 else [
            {"user": f"Which colour? ({i})"}]
        rows.append({"images": [f"{i}.png"], "texts": texts, "labels": {"color": c, "level": float(c)}})
    return rows


def _write_jsonl(path, rows: list, bad_line: int | None = None) -> str:
    lines = [json.dumps(r) for r in rows]
    if bad_line is not None:
        lines.insert(bad_line, "{not json")
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA + two-heads run of 2 steps; returns (config path, run dir, data folder)."""
    tmp = tmp_path_factory.mktemp("infer")
    tiny = get_family("qwen3_vl").build_tiny(str(tmp / "tiny"))
    data = _write_jsonl(tmp / "train.jsonl", _records(tmp, 8))
    cfg = {"model": {"kind": "hub_vlm", "pretrained": tiny, "heads": HEADS, "lora": {"r": 4}},
           "data": {"source": "jsonl", "train_file": data, "eval_file": data, "max_length": 64},
           "train": {"output_dir": str(tmp / "run"), "max_steps": 2, "per_device_train_batch_size": 4,
                     "per_device_eval_batch_size": 4, "logging_steps": 1, "save_steps": 2, "learning_rate": 5e-2,
                     "disable_tqdm": True, "eval_strategy": "no"}}
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    torch.set_num_threads(1)
    assert cli.main(["train", "--config", str(path)]) == 0
    return str(path), str(tmp / "run"), tmp


def _new_data(folder) -> tuple[list[dict], int]:
    """Six new samples (ids on some), the fourth one bad (no text): (records, index of the bad one)."""
    rows = _records(folder, 6, start=100)
    for i, row in enumerate(rows):
        if i % 2:
            row["id"] = f"sample-{i}"
        if i in (1, 4):
            del row["labels"]  # labels are optional
    rows[3]["texts"] = []
    return rows, 3


def _evaluation_outputs(config: str, checkpoint: str, samples: list[dict]) -> dict[str, np.ndarray]:
    """The heads' outputs as evaluation computes them (Trainer.predict of the run's own build)."""
    trainer = run.build(load_run_config(config), checkpoint=checkpoint)
    return trainer.predict(samples).heads


def _assert_rows_match(rows: list[dict], outputs: dict[str, np.ndarray]) -> None:
    assert len(rows) == len(outputs["color"])
    for row, color, level in zip(rows, outputs["color"], outputs["level"]):
        probs = np.exp(color - color.max())
        probs /= probs.sum()
        assert row["color"] == int(np.argmax(color))
        np.testing.assert_allclose(row["color_probs"], probs, atol=1e-5)
        assert row["level"] == pytest.approx(float(level[0] if np.ndim(level) else level), abs=1e-5)


def _read_rows(path) -> list[dict]:
    return [json.loads(line) for line in open(path).read().splitlines()]


def test_predict_new_jsonl_and_shards_equal_evaluation_ids_kept(trained, tmp_path):
    config, run_dir, _ = trained
    ckpt = os.path.join(run_dir, "checkpoint-2")
    records, bad = _new_data(tmp_path)
    good = [dict(r, images=[str(tmp_path / im) for im in r["images"]]) for i, r in enumerate(records) if i != bad]
    expected = _evaluation_outputs(config, ckpt, good)

    # JSONL: a malformed line after the second record shifts the line numbers of what follows
    data = _write_jsonl(tmp_path / "new.jsonl", records, bad_line=2)
    out = tmp_path / "pred.jsonl"
    assert cli.main(["predict", "--checkpoint", run_dir, "--data", data, "--output", str(out),
                     "--batch-size", "2"]) == 0
    rows = _read_rows(out)
    assert [r["id"] for r in rows] == [1, "sample-1", 3, 4, "sample-3", 6, "sample-5"]  # line numbers, or `id`
    assert rows[2] == {"id": 3, "skipped": "malformed_json",  # with where the parser stopped
                       "detail": "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"}
    assert rows[4]["skipped"] == "empty_conversation"
    _assert_rows_match([r for r in rows if "skipped" not in r], expected)

    # WebDataset shards (two, by brace range), read by a data-loader worker; ids are the keys unless a record has one
    from vlmtrain.data.tools import write_webdataset

    write_webdataset([dict(r, images=[Image.open(tmp_path / im) for im in r["images"]]) for r in records],
                     str(tmp_path / "shards"), shard_size=4)
    out = tmp_path / "pred-wds.jsonl"
    assert cli.main(["predict", "--checkpoint", ckpt, "--data", str(tmp_path / "shards" / "shard-{000000..000001}.tar"),
                     "--output", str(out), "--batch-size", "3", "--num-workers", "1"]) == 0
    rows = _read_rows(out)
    assert [r["id"] for r in rows] == ["000000000", "sample-1", "000000002", "sample-3", "000000004", "sample-5"]
    assert rows[3]["skipped"] == "empty_conversation"
    _assert_rows_match([r for r in rows if "skipped" not in r], expected)


def test_eval_set_predict_keeps_indices_under_skips(trained, tmp_path):
    config, run_dir, folder = trained
    records = _records(folder, 5)
    records[2]["texts"] = [{"user": "   "}]  # skipped: malformed_text
    records[4]["id"] = "last"
    data = _write_jsonl(tmp_path / "eval.jsonl", [dict(r, images=[str(folder / im) for im in r["images"]])
                                                  for r in records])
    out_dir = tmp_path / "out"
    with pytest.warns(UserWarning, match=r"^1 of 5 samples were skipped \(rows with 'skipped'\): "
                                         r"\{'malformed_text': 1\}$"):
        assert cli.main(["predict", "--config", config, "--checkpoint", run_dir, "--data.eval_file", data,
                         "--train.output_dir", str(out_dir)]) == 0
    rows = _read_rows(out_dir / "predictions.jsonl")
    assert [r["index"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[2]["skipped"] == "malformed_text" and "color" not in rows[2]
    assert rows[4]["id"] == "last" and all("id" not in r for r in rows[:4])
    good = [dict(r, images=[str(folder / im) for im in r["images"]]) for i, r in enumerate(records) if i != 2]
    _assert_rows_match([r for r in rows if "skipped" not in r],
                       _evaluation_outputs(config, os.path.join(run_dir, "checkpoint-2"), good))


def test_load_for_inference_score_generate_and_defaults(trained, monkeypatch):
    _, run_dir, folder = trained
    model = vlmtrain.load_for_inference(run_dir)
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.model.parameters())
    assert set(model.head_configs) == {"color", "level"}
    samples = [{"images": [Image.new("RGB", (32, 32), c)], "texts": [{"user": "Which colour?"}], "id": k}
               for k, c in enumerate(COLORS)]
    rows = model.score(samples, batch_size=2)
    assert [r["id"] for r in rows] == [0, 1, 2] and all(len(r["color_probs"]) == 3 for r in rows)
    assert model.score(samples[:1]) == rows[:1]  # the batch it sits in does not change a score
    assert isinstance(model.generate("Which colour?", images=[str(folder / "0.png")], max_new_tokens=2), str)
    assert len(model.generate(samples, max_new_tokens=2)) == 3

    half = vlmtrain.load_for_inference(run_dir, dtype="bfloat16")  # read in bf16; heads stay float32
    assert half.dtype == torch.bfloat16
    assert {p.dtype for n, p in half.model.base.named_parameters() if "lora_" not in n} == {torch.bfloat16}
    assert {p.dtype for p in half.model.heads.parameters()} == {torch.float32}

    from vlmtrain import inference

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert inference.default_device() == torch.device("cuda", 0)
    assert inference.default_dtype(inference.default_device()) == torch.bfloat16


def test_export_merge_reloads_with_transformers_and_attach_heads(trained, tmp_path):
    from transformers import AutoModelForImageTextToText

    from vlmtrain.data.hub_collate import HubVLMCollator
    from vlmtrain.data.hub_processing import HubVLMProcessor

    _, run_dir, folder = trained
    ckpt = os.path.join(run_dir, "checkpoint-2")
    out = str(tmp_path / "merged")
    assert cli.main(["export", "--checkpoint", ckpt, "--merge", "--output-dir", out]) == 0
    with open(os.path.join(out, "processor_config.json")) as f:
        assert json.load(f)["processor_class"] == "Qwen3VLProcessor"  # the real class, for AutoProcessor
    samples = [{"images": [str(folder / f"{i}.png")], "texts": [{"user": f"Which colour? ({i})"}]} for i in range(4)]
    expected = vlmtrain.load_for_inference(ckpt).score(samples)

    model = AutoModelForImageTextToText.from_pretrained(out)
    scorer = vlmtrain.attach_heads(model, out).eval()
    family = get_family("qwen3_vl")
    processor = family.load_processor(out)  # vlmtrain's image-only loader (no torchvision)
    batch = HubVLMCollator(HubVLMProcessor(processor, family, prompts=False))(samples)
    with torch.no_grad():
        outputs = scorer(**{k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "labels"})
    for i, row in enumerate(expected):
        assert outputs["logits_level"][i, 0].item() == pytest.approx(row["level"], abs=1e-5)
        np.testing.assert_allclose(outputs["logits_color"][i].softmax(-1).numpy(), row["color_probs"], atol=1e-5)
    again = vlmtrain.load_for_inference(out).score(samples)  # the exported folder is a checkpoint too
    for row, want in zip(again, expected, strict=True):
        assert row["level"] == pytest.approx(want["level"], abs=1e-5)
        np.testing.assert_allclose(row["color_probs"], want["color_probs"], atol=1e-5)

    for saved in (out, ckpt):  # the export and the checkpoint folder
        _assert_auto_processor_loads_as_its_base(saved, str(folder / "tiny"))


def _assert_auto_processor_loads_as_its_base(saved: str, base: str) -> None:
    """transformers' AutoProcessor finds the base checkpoint's video processor settings in a saved folder, and
    builds the real Qwen3VLProcessor from it: with torchvision installed it does; without, it stops where it
    stops for the base itself, at transformers' own requirement (its video processors need torchvision)."""
    import importlib.util

    from transformers import AutoProcessor
    from transformers.video_processing_utils import BaseVideoProcessor

    settings = BaseVideoProcessor.get_video_processor_dict(saved)[0]  # what AutoVideoProcessor reads
    assert settings == BaseVideoProcessor.get_video_processor_dict(base)[0]
    if importlib.util.find_spec("torchvision") is not None:
        assert type(AutoProcessor.from_pretrained(saved)).__name__ == "Qwen3VLProcessor"
        return
    for folder in (saved, base):
        with pytest.raises(ImportError, match="requires the Torchvision library"):
            AutoProcessor.from_pretrained(folder)


def test_checkpoint_of_other_heads_or_model_is_an_error_naming_the_file(trained, tmp_path):
    _, run_dir, _ = trained
    ckpt = tmp_path / "ckpt"
    shutil.copytree(os.path.join(run_dir, "checkpoint-2"), ckpt)
    meta = json.loads((ckpt / "heads.json").read_text())
    meta["heads"]["color"]["num_outputs"] = 5  # heads.safetensors holds a 3-class color head
    (ckpt / "heads.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"heads\.safetensors holds .*expect"):
        vlmtrain.load_for_inference(str(ckpt))

    from transformers import AutoModelForImageTextToText, Qwen3VLConfig

    small = Qwen3VLConfig(text_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                       "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 32,
                                       "vocab_size": 300},
                          vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 1,
                                         "out_hidden_size": 32})
    other = AutoModelForImageTextToText.from_config(small)
    with pytest.raises(ConfigError, match=r"heads\.json: heads for hidden_size 64, but the model's hidden size is 32"):
        vlmtrain.attach_heads(other, os.path.join(run_dir, "checkpoint-2"))
    with pytest.raises(ConfigError, match="no file matches"):
        prediction.predict_data(run_dir, str(tmp_path / "missing-*.tar"))


@pytest.mark.parametrize("heads_json", [True, False])
def test_fsdp_dcp_checkpoint_loads_for_inference(trained, tmp_path, heads_json):
    """A full fine-tune under FSDP saves dcp/ (the whole model) + config.json + processor files; the heads are
    described by heads.json or, without it, by the run's config.yaml next to checkpoint-N/."""
    import torch.distributed.checkpoint as dcp

    from vlmtrain.models.files.head_files import save_heads
    from vlmtrain.models.hub.lora import merge_lora

    _, run_dir, folder = trained
    loaded = vlmtrain.load_for_inference(run_dir)
    model = merge_lora(loaded.model)
    ckpt = tmp_path / "run" / "checkpoint-7"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt / "dcp"), no_dist=True)
    model.base.config.save_pretrained(ckpt)
    loaded.processor.save_pretrained(ckpt)
    if heads_json:
        save_heads(model, str(tmp_path / "heads"))
        shutil.copy(tmp_path / "heads" / "heads.json", ckpt / "heads.json")
    else:
        with pytest.raises(vlmtrain.trainer.CheckpointError, match="heads.json nor the run's config.yaml"):
            vlmtrain.load_for_inference(str(ckpt))
        (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump({"model": {"heads": HEADS}}))
    samples = [{"images": [str(folder / f"{i}.png")], "texts": [{"user": "Which colour?"}]} for i in range(3)]
    for row, want in zip(vlmtrain.load_for_inference(str(ckpt)).score(samples), loaded.score(samples),
                         strict=True):
        assert row["level"] == pytest.approx(want["level"], abs=1e-5)
        np.testing.assert_allclose(row["color_probs"], want["color_probs"], atol=1e-5)


@pytest.mark.slow
def test_predict_two_ranks_same_rows_as_one(trained, tmp_path, monkeypatch):
    _, run_dir, _ = trained
    records, _ = _new_data(tmp_path)
    data = _write_jsonl(tmp_path / "new.jsonl", records, bad_line=2)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert cli.main(["predict", "--checkpoint", run_dir, "--data", data, "--output", str(one)]) == 0
    assert cli.main(["predict", "--nproc", "2", "--checkpoint", run_dir, "--data", data, "--output", str(two),
                     "--batch-size", "2"]) == 0
    rows_one, rows_two = _read_rows(one), _read_rows(two)
    assert [r["id"] for r in rows_two] == [r["id"] for r in rows_one] == [1, "sample-1", 3, 4, "sample-3", 6, "sample-5"]
    for a, b in zip(rows_one, rows_two):
        assert a.keys() == b.keys() and a.get("skipped") == b.get("skipped")
        if "level" in a:
            assert a["level"] == pytest.approx(b["level"], abs=1e-5)
            np.testing.assert_allclose(a["color_probs"], b["color_probs"], atol=1e-5)


@pytest.mark.gpu
def test_load_for_inference_defaults_to_cuda_bf16(trained):
    """On a GPU machine (-m gpu): weights straight onto cuda in bfloat16, heads float32, scores near CPU's."""
    _, run_dir, folder = trained
    gpu, cpu = vlmtrain.load_for_inference(run_dir), vlmtrain.load_for_inference(run_dir, device="cpu")
    assert gpu.device.type == "cuda" and gpu.dtype == torch.bfloat16
    assert {p.device.type for p in gpu.model.parameters()} == {"cuda"}
    assert {p.dtype for p in gpu.model.heads.parameters()} == {torch.float32}
    samples = [{"images": [str(folder / f"{i}.png")], "texts": [{"user": "Which colour?"}]} for i in range(3)]
    for a, b in zip(gpu.score(samples), cpu.score(samples), strict=True):
        np.testing.assert_allclose(a["color_probs"], b["color_probs"], atol=0.05)


def test_saved_processor_names_the_real_class_and_keeps_video_settings(trained, tmp_path):
    """The image-only processor saves as the transformers class, with the video processor settings of the
    checkpoint it came from, and vlmtrain's loader reads it back as the image-only class (no torchvision)."""
    _, _, folder = trained
    base = tmp_path / "base"
    shutil.copytree(folder / "tiny", base)
    video = {"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 8, "temporal_patch_size": 2,
             "merge_size": 2}
    (base / "video_preprocessor_config.json").write_text(json.dumps(video))
    family = get_family("qwen3_vl")
    family.load_processor(str(base)).save_pretrained(str(tmp_path / "saved"))
    saved = tmp_path / "saved"
    assert json.loads((saved / "processor_config.json").read_text())["processor_class"] == "Qwen3VLProcessor"
    assert json.loads((saved / "tokenizer_config.json").read_text())["processor_class"] == "Qwen3VLProcessor"
    assert json.loads((saved / "video_preprocessor_config.json").read_text()) == video
    assert type(family.load_processor(str(saved))).__name__ == "ImageOnlyQwen3VLProcessor"


def test_predict_data_without_heads_writes_each_samples_generated_answer(tiny_hub, tmp_path):
    """A checkpoint without score heads answers new data: one row per sample keyed by its id, the answer its
    load_for_inference().generate gives (a skipped sample keeps its row)."""
    _, ckpt, _ = tiny_hub("qwen3_vl")
    records = _records(tmp_path, 4)
    records[2]["images"] = ["missing.png"]
    out = tmp_path / "answers.jsonl"
    with pytest.warns(UserWarning, match=r"1 of 4 samples were skipped"):
        assert cli.main(["predict", "--checkpoint", ckpt, "--data", _write_jsonl(tmp_path / "new.jsonl", records),
                         "--output", str(out), "--max-new-tokens", "6", "--batch-size", "2"]) == 0
    rows = _read_rows(out)
    assert [r["id"] for r in rows] == [1, 2, 3, 4] and rows[2]["skipped"] == "missing_image"
    model = vlmtrain.load_for_inference(ckpt, device="cpu")
    expected = [model.generate(dict(r, images=[str(tmp_path / im) for im in r["images"]]), max_new_tokens=6)
                for i, r in enumerate(records) if i != 2]
    assert [r["generated"] for r in rows if "skipped" not in r] == expected and all(expected), rows


@requires("av", "video")
def test_generate_answers_a_prompt_about_a_video(tiny_hub, tmp_path, capsys):
    from vlmtrain.data.video import write_video

    _, ckpt, _ = tiny_hub("qwen3_vl")
    frames = np.zeros((8, 48, 64, 3), np.uint8)
    for t in range(8):  # a square moving right
        frames[t, 16:32, 6 * t:6 * t + 16] = (250, 30, 30)
    clip = write_video(str(tmp_path / "clip.mp4"), frames, fps=4)
    argv = ["generate", "--checkpoint", ckpt, "--prompt", "Where does the square go?", "--max-new-tokens", "6"]
    assert cli.main([*argv, "--video", clip]) == 0
    answer = capsys.readouterr().out.strip()
    model = vlmtrain.load_for_inference(ckpt, device="cpu")
    assert answer == model.generate("Where does the square go?", videos=[clip], max_new_tokens=6)
    assert answer != model.generate("Where does the square go?", max_new_tokens=6)  # the clip was seen
    capsys.readouterr()
    assert cli.main([*argv, "--video", str(tmp_path / "none.mp4")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--video" in err and "none.mp4" in err, err
