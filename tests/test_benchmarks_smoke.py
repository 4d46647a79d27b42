"""benchmarks/gpu_hub_vlm.py end to end on CPU: without CUDA it says so and measures nothing; with --smoke it runs
its whole pipeline (offline processor, synthetic two-image data, meta-device init, the three contenders, the
meter and the checks) on tiny Qwen3-VL configs. benchmarks/grpo.py's Qwen3-VL-2B LoRA mode: its options reach the
contender processes, and --smoke runs each contender's code path on the tiny config."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
import yaml
from optional_extras import requires

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_hub_vlm.py"


def _script(path: Path, name: str) -> Iterator[ModuleType]:
    """A benchmark script as a module (the files beside it importable, as when it runs), torch's thread count
    restored afterwards."""
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    yield module
    torch.set_num_threads(threads)


@pytest.fixture
def bench():
    yield from _script(SCRIPT, "gpu_hub_vlm")


def test_without_cuda_it_says_so_and_exits_0(bench, capsys):
    assert not torch.cuda.is_available()  # (tests/conftest.py hides GPUs)
    assert bench.main([]) == 0
    out = capsys.readouterr().out
    assert "needs a CUDA GPU" in out and "nothing was measured" in out
    assert "tokens/s" not in out


def _rows(block: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(
        r"^  (transformers \+ liger|transformers|vlmtrain padded|vlmtrain packed|vlmtrain budget)\s+(.*)$", block,
        re.M)}


def test_profiled_steps_and_the_report_step_are_left_out_of_the_rates(bench):
    """--profile: the 2 profiled steps and the step after them (the profiler's report) are slow and not
    counted; the other steps after --warmup are, each with the batch fetched for it."""
    meter = bench.parts.Meter(profile_after=2)
    meter.stamps = [0.0, 1.0, 11.0, 21.0, 31.0, 32.0, 33.0, 34.0]  # steps 3-5 take 10 s, the others 1 s
    meter.fetches = [(k - 1, 0.25, 100, 1e9, 200) for k in range(1, 9)]  # (steps done, wait, tokens, flops, room)
    rates = meter.window(1)
    assert rates["steps"] == 4 and rates["wall"] == 4.0  # steps 2, 6, 7, 8
    assert rates["tokens_per_s"] == 100.0 and rates["data_wait"] == 0.25 and rates["fill"] == 0.5
    meter.profile_after = None
    assert meter.window(1)["tokens_per_s"] == pytest.approx(700 / 34)


@pytest.mark.slow
def test_smoke_runs_only_the_chosen_contender(bench, capsys, tmp_path):
    assert bench.main(["--smoke", "--only", "2b-full", "--contender", "vlmtrain padded", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert set(_rows(out)) == {"vlmtrain padded"}, out
    assert "1 contender(s) ran: nothing to compare" in out


@pytest.mark.slow
def test_liger_contenders_say_why_they_cannot_run_on_cpu(bench, capsys, tmp_path):
    """--liger on CPU: 'transformers + liger' is skipped (CUDA only), vlmtrain with train.use_liger_kernel is
    refused by vlmtrain itself before training (liger-kernel missing, or no CUDA device), transformers runs."""
    assert bench.main(["--smoke", "--liger", "--only", "2b-full", "--contender", "transformers", "--contender",
                       "transformers + liger", "--contender", "vlmtrain padded", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert set(rows) == {"transformers", "transformers + liger", "vlmtrain padded"}, out
    assert float(rows["transformers"].split()[0]) > 0
    assert rows["transformers + liger"] == "skipped: Liger's kernels are Triton kernels: CUDA only"
    refused = rows["vlmtrain padded"]  # (liger-kernel is checked first, then the device)
    assert refused.startswith("skipped: vlmtrain refuses it: use_liger_kernel=true"), out
    assert "needs liger-kernel, which is not installed" in refused or "run on a CUDA GPU" in refused, out
    assert "Liger kernels in vlmtrain on" in out and "1 contender(s) ran: nothing to compare" in out


@pytest.mark.slow
def test_budget_contender_trains_one_row_of_T_tokens_per_step(bench, capsys, tmp_path, monkeypatch):
    """vlmtrain budget: every step one packed row of --budget-tokens (data.pack_window, batch 1), the vision
    tower padded to --budget-patches, text and vision attention varlen_torch."""
    from vlmtrain.models.vision import vision_attention

    shapes, calls = set(), []
    counted = bench.parts.Counted.__call__

    def spy(self, rows):
        batch = counted(self, rows)
        shapes.add(tuple(batch["input_ids"].shape))
        return batch

    monkeypatch.setattr(bench.parts.Counted, "__call__", spy)
    inner = vision_attention.vision_varlen_attention
    monkeypatch.setattr(vision_attention, "vision_varlen_attention", lambda *a, **k: (calls.append(1), inner(*a, **k))[1])
    assert bench.main(["--smoke", "--only", "2b-full", "--contender", "vlmtrain budget", "--budget-tokens", "512",
                       "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert set(_rows(out)) == {"vlmtrain budget"} and shapes == {(1, 512)} and calls, out
    fill = float(_rows(out)["vlmtrain budget"].split()[-2])
    assert fill > 0.9, out
    written = yaml.safe_load(open(tmp_path / "2b-full" / "vlmtrain_budget.yaml"))
    assert written["data"]["max_patches_per_pack"] == 8192 and written["model"]["attn_implementation"] == "varlen_torch"


@pytest.mark.slow
def test_selective_checkpointing_runs_vlmtrain_with_the_losses_of_full(bench, capsys, tmp_path, monkeypatch):
    """--checkpointing-mode selective: vlmtrain padded checkpoints with the selective policy (it decides what each
    checkpointed operator keeps), with the same step-1 loss as transformers' full recompute on the same samples."""
    from vlmtrain.models.speed import checkpointing_policies

    calls = []
    policy = checkpointing_policies._selective_policy
    monkeypatch.setattr(checkpointing_policies, "_selective_policy", lambda *a, **k: (calls.append(1), policy(*a, **k))[1])
    assert bench.main(["--smoke", "--only", "2b-full", "--contender", "transformers", "--contender",
                       "vlmtrain padded", "--checkpointing-mode", "selective", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "activation checkpointing selective" in out and calls
    assert "step-1 losses within 0.01 relative: yes" in out and out.rstrip().endswith("all checks passed"), out


@pytest.mark.slow
def test_text_varlen_runs_vlmtrain_packed_with_varlen_torch(bench, capsys, tmp_path, monkeypatch):
    """--text-attn varlen: vlmtrain packed's text attention is model.attn_implementation varlen_torch (its
    per-document path runs), with the same step-1 loss as transformers' sdpa on the same samples."""
    from vlmtrain.models.speed import varlen_attention

    calls = []
    per_document = varlen_attention._varlen
    monkeypatch.setattr(varlen_attention, "_varlen", lambda *a, **k: (calls.append(1), per_document(*a, **k))[1])
    assert bench.main(["--smoke", "--only", "2b-full", "--contender", "transformers", "--contender",
                       "vlmtrain packed", "--text-attn", "varlen", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "(vlmtrain packed text: varlen_torch)" in out and calls
    assert set(_rows(out)) == {"transformers", "vlmtrain packed"}, out
    assert "step-1 losses within 0.01 relative: yes" in out and out.rstrip().endswith("all checks passed"), out


@pytest.mark.slow
@requires("peft", "lora")
def test_smoke_runs_every_contender_on_the_same_start_and_data(bench, capsys, tmp_path):
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    blocks = out.split("\n== ")[1:]
    assert [b.split(":")[0] for b in blocks] == ["2b-full", "8b-lora"]
    for block in blocks:
        rows = _rows(block)
        assert set(rows) == {"transformers", "transformers + liger", "vlmtrain padded", "vlmtrain packed"}, block
        assert rows["transformers + liger"] == "skipped: Liger's kernels are Triton kernels: CUDA only", block
        for name in ("transformers", "vlmtrain padded"):
            tokens_per_s, ratio = (float(v) for v in rows[name].split()[:2])
            assert tokens_per_s > 0, block
        assert float(rows["transformers"].split()[1]) == 1.0
        loss = {name: float(rows[name].split()[-1]) for name in ("transformers", "vlmtrain padded")}
        assert loss["transformers"] == pytest.approx(loss["vlmtrain padded"], rel=1e-2)
        packed = rows["vlmtrain packed"]
        assert packed.startswith("skipped: vlmtrain refuses it: ") or float(packed.split()[0]) > 0
        assert re.search(r"same weights at the start \(checksums \[[^,\]]+\]\): yes", block), block
        assert re.search(r"same trainable parameters \([\d,]+\): yes", block), block
        assert "same first batch (targets, id sum) [(" in block and ": yes | step-1 losses" in block, block
        assert "step-1 losses within 0.01 relative: yes" in block
    assert out.rstrip().endswith("all checks passed")


@pytest.mark.gpu
@requires("peft", "lora")
def test_smoke_on_cuda_measures_peak_memory(bench, capsys, tmp_path):
    """On a GPU machine --smoke runs the CUDA paths (bf16, fused AdamW, workers beside CUDA, peak memory)."""
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for block in out.split("\n== ")[1:]:
        rows = _rows(block)
        for name in ("transformers", "vlmtrain padded"):
            assert float(rows[name].split()[4]) > 0, block  # peak GiB
        liger = rows["transformers + liger"]  # (runs where the liger-kernel wheel came along)
        assert liger.startswith("skipped: liger-kernel is not installed") or float(liger.split()[4]) > 0, block
    assert out.rstrip().endswith("all checks passed")


def test_vision_varlen_attention_takes_every_image_in_one_call_per_block(bench, monkeypatch):
    """--vision-attn varlen: transformers hands the whole vision tower's attention of a multi-image batch to
    the library's vlmtrain/models/vision/vision_attention.py, one call per block with every image's boundaries, and the
    model computes what its own per-image attention computes (on CPU both run one sdpa per image)."""
    from transformers import AttentionInterface

    from tests.test_hub_packing import _samples
    from vlmtrain.data.hub_collate import HubVLMCollator
    from vlmtrain.data.hub_processing import HubVLMProcessor
    from vlmtrain.models.vision import vision_attention as varlen

    parts = bench.parts
    calls = []
    original = varlen.vision_varlen_attention

    def counted(*args, **kwargs):
        calls.append(kwargs["cu_seq_lens_q"].tolist())
        return original(*args, **kwargs)

    monkeypatch.setattr(varlen, "vision_varlen_attention", counted)
    config = parts.model_config("tiny", "sdpa")
    batch = HubVLMCollator(HubVLMProcessor(parts.processor_for("tiny"), parts.FAMILY, max_length=400,
                                           prompts=False))(_samples())
    inputs = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    losses = {}
    for mode in ("same", "varlen"):
        model = parts.build_model(config, torch.device("cpu"), 0, mode)
        assert config.vision_config._attn_implementation == "sdpa"  # (the shared config is left as it was)
        losses[mode] = model(**inputs).loss.item()
    assert len(batch["image_grid_thw"]) == 7  # 1 + 0 + 2 + 1 + 3 images
    assert len(calls) == config.vision_config.depth and all(len(c) == 8 for c in calls)  # 7 images: 8 bounds
    assert losses["varlen"] == pytest.approx(losses["same"], rel=1e-4)  # (bf16 weights, another memory layout)
    AttentionInterface._global_mapping.pop(varlen.NAME, None)


GRPO_SCRIPT = SCRIPT.parent / "grpo.py"


@pytest.fixture(scope="module")
def grpo_bench():
    yield from _script(GRPO_SCRIPT, "grpo_bench")


def test_grpo_options_reach_each_contender_as_given(grpo_bench):
    """--smoke sets its sizes as defaults (an option given wins); every option, flags included, reaches the
    contender processes as given; --lora / --smoke are refused on the tiny text model."""
    from contenders import contender_flags

    opts = grpo_bench.parse(["--model", "qwen3_vl_2b", "--lora", "--smoke", "--steps", "2"])
    assert (opts.steps, opts.warmup, opts.length, opts.generations, opts.image_size) == (2, 1, 8, 4, 64)
    full = grpo_bench.parse(["--model", "qwen3_vl_2b", "--lora", "--length", "128"])
    assert (full.smoke, full.lora, full.steps, full.length, full.image_size) == (False, True, 12, 128, 448)
    for o in (opts, full):
        assert grpo_bench.parse(contender_flags(o)) == o
    with pytest.raises(SystemExit):
        grpo_bench.parse(["--lora"])


@pytest.mark.slow
@requires("peft", "lora")
def test_grpo_smoke_trains_the_same_lora_from_the_same_weights_on_both_sides(grpo_bench, capsys, tmp_path):
    """--model qwen3_vl_2b --lora --smoke, each contender as its process runs it: the same random-init weights
    (gpu_hub_vlm_models' tiny Qwen3-VL under seed 0) and the same LoRA adapters (r 16 on every linear layer of the
    language model, nothing else trainable) on TRL's GRPOTrainer and vlmtrain's; no CUDA: no GPU peak."""
    import gpu_hub_vlm_models as hub
    from gpu_hub_vlm_parts import LORA, LORA_TARGETS

    model = hub.build_model(hub.model_config("tiny", "sdpa"), torch.device("cpu"), 0)
    lora = sum(LORA["r"] * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and re.fullmatch(LORA_TARGETS, name))
    results = {}
    for contender in ("trl", "vlmtrain"):
        grpo_bench.main(["--model", "qwen3_vl_2b", "--lora", "--smoke", "--steps", "2", "--prompts", "1",
                         "--generations", "2", "--length", "4", "--threads", "1", "--one", contender,
                         "--path", str(tmp_path)])
        results[contender] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results["trl"]["start"] == results["vlmtrain"]["start"] == pytest.approx(hub.checksum(model))
    assert lora > 0 and results["trl"]["trainable"] == results["vlmtrain"]["trainable"] == lora, results
    for r in results.values():
        assert r["peak_gpu_gib"] is None and r["tokens_per_s"] > 0 and 0 < r["mean_length"] <= 4, results
