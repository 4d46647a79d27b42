"""DDP under torchrun (gloo, CPU): 2 processes x batch 2 == 1 process x batch 4, step by step; resume in 2.

The runs are ranks with torchrun's environment forked with their imports done (tests/preloaded.py, `vlmtrain`
below); a test about the launcher (`vlmtrain train --nproc 2` losing a rank) starts the real one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from vlmtrain.config import load_run_config
from vlmtrain.tasks.addition import split_pairs

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

LM = {
    "model": {"kind": "causal_lm", "config": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                                              "num_hidden_layers": 2, "num_attention_heads": 4,
                                              "num_key_value_heads": 2, "max_position_embeddings": 32}},
    "data": {"source": "addition", "num_train": 256, "num_eval": 8, "packing": False},
    "train": {"max_steps": 6, "learning_rate": 3e-3, "logging_steps": 1, "eval_strategy": "no",
              "save_strategy": "steps", "save_steps": 3, "disable_tqdm": True, "seed": 3,
              "gradient_accumulation_steps": 2, "max_grad_norm": 1.0, "predict_with_generate": True,
              "generation_max_new_tokens": 4},
}


def _vlm():
    from tests.test_vlm_run import TINY

    cfg = json.loads(json.dumps(TINY))
    cfg["data"].update(num_train=64, packing=False)
    # adam_epsilon 1e-6: an o_proj element whose gradient is ~0 (float noise: one batch of 4 vs two of 2 pad to
    # different widths) gets a full-size Adam step of either sign at eps 1e-8 -> a 1.3e-5 weight difference,
    # while losses and grad norms agree to 1e-7. The larger eps keeps noise-level gradients noise-level.
    cfg["train"].update(max_steps=4, eval_strategy="no", save_steps=2, logging_steps=1, adam_epsilon=1e-6)
    return cfg


def vlmtrain(logs: Path, nproc: int, *argv: str) -> str:
    """``vlmtrain ARGV`` as one process or as ``nproc`` ranks (torchrun's rank environment, no launcher: these
    tests are about the ranks), forked with their imports done (tests/preloaded.py); asserts exit code 0 and
    returns the stdout of every rank (rank by rank; stderr apart, as a subprocess's). logs: a new folder."""
    from tests import preloaded

    logs = Path(tempfile.mkdtemp(prefix=f"{logs.name}-", dir=logs.parent))  # (one folder per call, even on a reuse)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    codes, output = preloaded.launch("vlmtrain.cli:main", list(argv), env, nproc, logs, timeout=600,
                                     stderr_apart=True)
    assert codes == [0] * nproc, output
    return "".join((logs / f"rank{r}.log").read_text() for r in range(nproc))


def _run(tmp_path: Path, cfg: dict, out: str, nproc: int, batch: int, *extra: str) -> Path:
    path = tmp_path / f"{out}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    vlmtrain(tmp_path / f"{out}-logs", nproc, "train", "--config", str(path), "--train.output_dir", str(tmp_path / out),
             "--train.per_device_train_batch_size", str(batch), *extra)
    return tmp_path / out


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    """(kind 'lm' / 'vlm', nproc, batch, *extra) -> the output directory of that run of LM / _vlm(), trained on
    first use and read by every test of this module that needs it (runs are deterministic: a test that trained
    its own copy got the same files). Tests only read these directories (export and eval write elsewhere)."""
    runs: dict[tuple, Path] = {}

    def get(kind: str, nproc: int, batch: int, *extra: str) -> Path:
        key = (kind, nproc, batch, *extra)
        if key not in runs:
            runs[key] = _run(tmp_path_factory.mktemp(f"shared-{kind}"), LM if kind == "lm" else _vlm(), "run",
                             nproc, batch, *extra)
        return runs[key]

    return get


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "train_runtime" not in r}


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / f"checkpoint-{step}" / "model.safetensors"))


@pytest.mark.parametrize("kind", ["lm", "vlm"])
def test_two_processes_match_one_process_with_the_global_batch(tmp_path, shared_run, kind):
    cfg = LM if kind == "lm" else _vlm()
    steps = cfg["train"]["max_steps"]
    one = shared_run(kind, 1, 4)
    two = _run(tmp_path, cfg, "two", nproc=2, batch=2)
    a, b = _losses(one), _losses(two)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    assert all(abs(a[s] - b[s]) < 1e-5 for s in a), (a, b)
    norms = [{r["step"]: r["grad_norm"] for r in map(json.loads, open(run / "metrics.jsonl")) if "grad_norm" in r}
             for run in (one, two)]
    assert all(abs(norms[0][s] - norms[1][s]) < 1e-4 for s in norms[0])
    wa, wb = _weights(one, steps), _weights(two, steps)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5
    logs = [json.loads(line) for line in open(two / "metrics.jsonl")]
    assert any("data_wait_fraction_max" in r for r in logs)  # aggregated over both ranks
    assert {"rng_state_0.pth", "rng_state_1.pth", "loop_state_0.pt", "loop_state_1.pt"} <= set(
        os.listdir(two / f"checkpoint-{steps}"))
    if kind == "lm":  # a 2-process run resumed from its checkpoint continues exactly
        resumed = _run(tmp_path, cfg, "resumed", 2, 2,
                       "--train.resume_from_checkpoint", str(two / f"checkpoint-{steps // 2}"))
        wr = _weights(resumed, steps)
        assert all(torch.equal(wr[k], wb[k]) for k in wb)
        assert [_losses(resumed)[s] for s in range(steps // 2 + 1, steps + 1)] == \
               [b[s] for s in range(steps // 2 + 1, steps + 1)]


def test_a_killed_rank_ends_the_job_with_a_message_naming_it(tmp_path):
    """kill -9 of one rank mid-run: the job exits non-zero, naming the lost rank (no hang until ddp_timeout)."""
    import signal
    import time

    cfg = json.loads(json.dumps(LM))
    cfg["train"].update(max_steps=100000, save_strategy="no")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "vlmtrain", "train", "--config", str(path), "--nproc", "2",
                             "--train.output_dir", str(tmp_path / "run")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "run" / "metrics.jsonl").is_file():
        time.sleep(0.2)
    workers = []  # vlmtrain train --nproc -> torchrun -> 2 workers (LOCAL_RANK in their environment)
    for pid in _descendants(proc.pid):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"LOCAL_RANK=1" in environ:
            workers.append(pid)
    assert len(workers) == 1, workers
    os.kill(workers[0], signal.SIGKILL)
    try:  # (the default ddp_timeout, 1800 s, is far beyond this bound: a hang fails here)
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the job hung after losing rank 1")
    assert proc.returncode != 0
    assert "local_rank: 1" in out and "SIGKILL" in out, out[-2000:]


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found += children.get(pid, [])
        todo += children.get(pid, [])
    return found


def run_with_full_disk_on_rank1(tmp_path: Path, cfg: dict) -> subprocess.CompletedProcess:
    """2 ranks where rank 1 cannot write checkpoint-4 (ENOSPC, tests/dist_fault_worker.py): forked with their
    imports done and torchrun's rank environment (tests/preloaded.py); each must end by itself. Their whole
    output, rank by rank, is the returned stdout."""
    from tests import preloaded

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "FAULT": "diskfull:1:4"}
    logs = tmp_path / "logs"
    logs.mkdir()
    argv = ["train", "--config", str(path), "--train.output_dir", str(tmp_path / "run"),
            "--train.per_device_train_batch_size", "2"]
    # ddp_timeout (600 s) is longer than this bound: a rank waiting for the collective timeout fails here
    codes, _ = preloaded.launch("tests.dist_fault_worker:main", argv, env, 2, logs, end_others=False)
    if None in codes:
        pytest.fail("the healthy rank waited for the collective timeout")
    out = "".join((logs / f"rank{r}.log").read_text() for r in range(2))
    return subprocess.CompletedProcess(argv, max(codes, key=abs), out, "")


def test_a_full_disk_on_one_rank_fails_every_rank_at_once_and_keeps_older_checkpoints(tmp_path):
    """Rank 1 cannot write checkpoint-4 (ENOSPC): both ranks raise within seconds (not after ddp_timeout), the
    error names the failing rank, no partial directory is left, and checkpoint-2 resumes to the normal end."""
    cfg = json.loads(json.dumps(LM))
    cfg["train"].update(save_steps=2, ddp_timeout=600)
    done = run_with_full_disk_on_rank1(tmp_path, cfg)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "could not write checkpoint-4" in out and "failed on rank(s) [1]" in out, out[-3000:]
    assert out.count("could not write checkpoint-4") >= 2  # raised on both ranks
    assert not any(n.startswith(".tmp") for n in os.listdir(tmp_path / "run")), os.listdir(tmp_path / "run")
    assert (tmp_path / "run" / "checkpoint-2").is_dir() and not (tmp_path / "run" / "checkpoint-4").exists()
    resumed = _run(tmp_path, cfg, "run", 2, 2, "--train.resume_from_checkpoint", "true")
    straight = _run(tmp_path, cfg, "straight", 2, 2)
    steps = cfg["train"]["max_steps"]
    wr, ws = _weights(resumed, steps), _weights(straight, steps)
    assert all(torch.equal(wr[k], ws[k]) for k in ws)


def test_fsdp_two_processes_match_one_process_resume_and_export(tmp_path, shared_run):
    """train.fsdp: 2 sharded processes x batch 2 == 1 process x batch 4 (losses, grad norms, exported weights);
    checkpoints are DCP shards that resume exactly, evaluate directly and export to one model.safetensors."""
    steps = LM["train"]["max_steps"]
    one = shared_run("lm", 1, 4)
    two = shared_run("lm", 2, 2, "--train.fsdp", "true")
    a, b = _losses(one), _losses(two)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    assert all(abs(a[s] - b[s]) < 1e-5 for s in a), (a, b)
    ckpt = two / f"checkpoint-{steps}"
    assert (ckpt / "dcp" / ".metadata").is_file() and not (ckpt / "model.safetensors").exists()
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(ckpt / "dcp"))  # each rank wrote its shards

    cfg_path = two.parent / "run.yaml"  # written by _run
    assert "eval_loss" in vlmtrain(tmp_path / "eval-logs", 1, "eval", "--config", str(cfg_path), "--checkpoint",
                                   str(ckpt), "--train.output_dir", str(tmp_path / "eval"))
    vlmtrain(tmp_path / "export-logs", 1, "export", "--checkpoint", str(ckpt), "--output-dir", str(tmp_path / "exported"))
    exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
    reference = _weights(one, steps)
    assert set(reference) <= set(exported)
    assert max(float((reference[k] - exported[k]).abs().max()) for k in reference) < 1e-5
    from transformers import AutoModelForCausalLM  # the export loads like any saved model

    AutoModelForCausalLM.from_pretrained(tmp_path / "exported")

    resumed = _run(tmp_path, LM, "fsdp_resumed", 2, 2, "--train.fsdp", "true",
                   "--train.resume_from_checkpoint", str(two / f"checkpoint-{steps // 2}"))
    assert [_losses(resumed)[s] for s in range(steps // 2 + 1, steps + 1)] == \
           [b[s] for s in range(steps // 2 + 1, steps + 1)]
    vlmtrain(tmp_path / "export-logs", 1, "export", "--checkpoint", str(resumed / f"checkpoint-{steps}"))
    again = load_file(str(resumed / f"checkpoint-{steps}" / "model.safetensors"))
    assert all(torch.equal(again[k], exported[k]) for k in exported)


def test_fsdp_with_bf16_mixed_precision_trains(tmp_path, shared_run):
    """bf16 under FSDP: blocks compute in bfloat16 from float32 master weights; losses track the fp32 run."""
    fp32 = _losses(shared_run("lm", 2, 2, "--train.fsdp", "true"))
    bf16 = _losses(_run(tmp_path, LM, "bf16", 2, 2, "--train.fsdp", "true", "--train.bf16", "true"))
    assert sorted(bf16) == sorted(fp32)
    assert all(abs(bf16[s] - fp32[s]) < 0.05 * fp32[s] for s in fp32), (fp32, bf16)
    assert fp32 != bf16  # bf16 really ran in lower precision


def test_fsdp_with_bfloat16_parameters_shards_and_trains_in_bfloat16(tmp_path):
    """model.torch_dtype bfloat16 under FSDP: rank 1 builds on the meta device and receives bfloat16 shards from
    rank 0 (half the bytes of float32); the optimizer updates bfloat16 weights, which the checkpoint holds; the
    losses track a single process with the same weights and global batch."""
    cfg = json.loads(json.dumps(LM))
    cfg["model"]["torch_dtype"] = "bfloat16"
    one = _losses(_run(tmp_path, cfg, "one", nproc=1, batch=4))
    run = _run(tmp_path, cfg, "fsdp", 2, 2, "--train.fsdp", "true")
    fsdp = _losses(run)
    assert sorted(one) == sorted(fsdp) == [1, 2, 3, 4, 5, 6]
    assert all(abs(one[s] - fsdp[s]) < 0.02 * one[s] for s in one), (one, fsdp)
    assert fsdp[6] < fsdp[1]  # it learns
    exported = tmp_path / "exported"
    vlmtrain(tmp_path / "export-logs", 1, "export", "--checkpoint", str(run / "checkpoint-6"), "--output-dir",
             str(exported))
    weights = load_file(str(exported / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_evaluation_is_sharded_over_ranks_and_gathered_in_order(tmp_path, shared_run):
    """Under DDP each rank evaluates every other sample (9 samples: 5 + 4); the gathered loss, exact match,
    sample count and the predicted texts (in dataset order) equal a single process's."""
    cfg = json.loads(json.dumps(LM))
    cfg["data"]["num_eval"] = 9
    cfg["train"]["per_device_eval_batch_size"] = 2
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))  # (what is evaluated: any checkpoint of the LM does)
    run = shared_run("lm", 1, 4)
    args = ["--config", str(tmp_path / "run.yaml"), "--checkpoint", str(run / "checkpoint-6")]
    outputs = {}
    for name, nproc in (("one", 1), ("two", 2)):
        for command in ("eval", "predict"):
            outputs[name, command] = vlmtrain(tmp_path / "logs", nproc, command, *args)
    # Six steps teach no sum (exact match 0 either way): a copy of checkpoint-6 rewired to answer "57" to every
    # prompt is right on 2 of the 9 samples (a pair and its mirror image: samples 0 and 1, one on each rank).
    truths = [str(a + b) for a, b in split_pairs(num_eval=9, seed=load_run_config(tmp_path / "run.yaml").data.seed)[1]]
    assert truths.count("57") == 2 and truths.index("57") == 0, truths
    _answering(run / "checkpoint-6", tmp_path / "answers-57" / "checkpoint-6", "57")
    args57 = [*args[:-1], str(tmp_path / "answers-57" / "checkpoint-6")]
    for name, nproc in (("one", 1), ("two", 2)):
        stdout = vlmtrain(tmp_path / "logs", nproc, "eval", *args57)
        outputs[name, "eval57"] = json.loads(stdout[stdout.index("{\n"):])
    one, two = (json.loads(outputs[n, "eval"][outputs[n, "eval"].index("{\n"):]) for n in ("one", "two"))
    assert one["eval_samples"] == two["eval_samples"] == 9
    assert abs(one["eval_loss"] - two["eval_loss"]) < 1e-6
    assert one["eval_exact_match"] == two["eval_exact_match"]
    assert outputs["one", "eval57"]["eval_exact_match"] == outputs["two", "eval57"]["eval_exact_match"] \
        == pytest.approx(2 / 9)
    texts = [t for t in outputs["one", "predict"].splitlines() if not t.startswith("{")]  # (minus log lines)
    assert len(texts) == 9 and texts == [t for t in outputs["two", "predict"].splitlines() if not t.startswith("{")]


def _answering(src: Path, dst: Path, answer: str) -> None:
    """A copy of the tiny LM checkpoint ``src`` whose greedy answer to every prompt is ``answer`` (then </s>):
    the blocks' output projections are zeroed, so the last hidden state is the current token's embedding (one
    -hot), and lm_head maps "=" to answer[0], each answer token to the next one, the last to </s>."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(src)
    chain = tok.convert_tokens_to_ids(["=", *answer, tok.eos_token])
    weights = load_file(str(src / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    vocab, hidden = embed.shape
    weights["model.embed_tokens.weight"] = torch.eye(vocab, hidden)
    for key in weights:
        if key.endswith(("o_proj.weight", "down_proj.weight")):
            weights[key] = torch.zeros_like(weights[key])
    weights["model.norm.weight"] = torch.ones(hidden)
    head = torch.zeros(vocab, hidden)
    for current, following in zip(chain, chain[1:]):
        head[following, current] = 1.0
    weights["lm_head.weight"] = head
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_fsdp_trains_evaluates_and_exports_the_vlm(tmp_path, shared_run):
    """The tiny VLM (vision tower, projector, decoder) under FSDP: same losses as 1 process x batch 4, generation
    -based evaluation on the sharded model, and an export that VisionLanguageModel.from_pretrained loads."""
    from vlmtrain.models.own_vlm.vlm import VisionLanguageModel

    cfg = _vlm()
    cfg["train"].update(eval_strategy="steps", eval_steps=cfg["train"]["max_steps"])
    steps = cfg["train"]["max_steps"]
    # (the reference: the shared 1-process run, which does not evaluate; evaluating after the last step leaves the
    # training losses as they are)
    a = _losses(shared_run("vlm", 1, 4))
    run = _run(tmp_path, cfg, "fsdp", 2, 2, "--train.fsdp", "true")
    b = _losses(run)
    assert sorted(a) == sorted(b) and all(abs(a[s] - b[s]) < 1e-5 for s in a), (a, b)
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert any("eval_exact_match" in r for r in rows)
    assert f"checkpoint-{steps}" in vlmtrain(tmp_path / "export-logs", 1, "export", "--checkpoint", str(run))
    model = VisionLanguageModel.from_pretrained(run / f"checkpoint-{steps}")
    assert model.config.image_token_length > 0


def test_ranks_whose_streams_run_dry_at_different_times_end_each_epoch_together(tmp_path):
    """A 9-sample JSONL stream over 2 ranks: rank 0 reads 5 samples (3 batches of 2), rank 1 reads 4 (2 batches).
    Each epoch ends for both when rank 1 runs dry, so an epoch is 2 steps everywhere and the run neither hangs
    nor lets rank 0 drift a batch ahead."""
    from vlmtrain.data.cauldron import write_cauldron_jsonl
    from vlmtrain.tasks.shapes import ShapesVQA

    write_cauldron_jsonl(ShapesVQA("train", 9, seed=12), str(tmp_path / "jsonl"))
    cfg = _vlm()
    cfg["data"] = {**cfg["data"], "source": "stream", "num_eval": 0,
                   "sources": [{"kind": "jsonl", "path": str(tmp_path / "jsonl" / "data.jsonl")}]}
    cfg["train"].update(max_steps=5, save_strategy="no", gradient_accumulation_steps=1)
    run = _run(tmp_path, cfg, "run", nproc=2, batch=2)
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    epochs = {r["step"]: r["epoch"] for r in rows if "loss" in r and "train_runtime" not in r}
    assert epochs == {1: 0, 2: 0, 3: 1, 4: 1, 5: 2}, epochs


SAVE_MODEL_SCRIPT = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from vlmtrain import Trainer, TrainingArguments
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True))
data = [{"input_ids": torch.randint(0, 64, (8,)), "labels": torch.randint(0, 64, (8,))} for _ in range(16)]
args = TrainingArguments(output_dir=sys.argv[1], max_steps=2, fsdp=True, save_strategy="no", disable_tqdm=True,
                         per_device_train_batch_size=2)
trainer = Trainer(model, args, train_dataset=data)
trainer.train()
trainer.save_model(sys.argv[1] + "/final")  # every rank calls it: the shards are gathered to rank 0
torch.distributed.destroy_process_group()
"""


def test_save_model_under_fsdp_gathers_a_loadable_model(tmp_path):
    from transformers import LlamaForCausalLM

    script = tmp_path / "save.py"
    script.write_text(SAVE_MODEL_SCRIPT)
    from tests import preloaded

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    (tmp_path / "logs").mkdir()
    codes, output = preloaded.launch("tests.preloaded:run_script", [str(script), str(tmp_path / "out")], env, 2,
                                     tmp_path / "logs")
    assert codes == [0, 0], output
    model = LlamaForCausalLM.from_pretrained(tmp_path / "out" / "final")
    weights = load_file(str(tmp_path / "out" / "final" / "model.safetensors"))
    assert all(not torch.equal(weights[k], torch.zeros_like(weights[k])) for k in weights)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (32, 32)
