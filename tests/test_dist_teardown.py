"""A finished multi-process run frees its process groups before Python exits.

destroy_process_group() alone left FSDP2's gloo group (held by DeviceMesh objects in torch's DTensor caches)
and its threads alive until interpreter teardown, where a rank could abort ('terminate called without an
active exception', SIGABRT) after a complete run. These tests look at the threads themselves, which is
deterministic, rather than waiting for the rare abort.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.test_distributed import LM

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# Runs `vlmtrain train` in-process, then prints the threads the process still has (names from /proc).
CLI_WORKER = """
import os, sys
from vlmtrain import cli
code = cli.main(sys.argv[1:])
names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
print(f"rank {os.environ['RANK']} threads after main: {names}", file=sys.stderr)
sys.exit(code)
"""

# A library user's script: Trainer under FSDP in main(), then its own destroy_process_group(); the reporter
# registered before the process group runs after vlmtrain's atexit handler (atexit is last in, first out).
# (Groups that the script's own globals still reference, e.g. a module-level FSDP model, cannot be freed.)
SCRIPT_WORKER = """
import atexit, os, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from vlmtrain import Trainer, TrainingArguments

def report():
    names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    print(f"rank {os.environ['RANK']} threads at exit: {names}", file=sys.stderr)

def main():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4))
    data = [{"input_ids": torch.randint(0, 64, (8,)), "labels": torch.randint(0, 64, (8,))} for _ in range(16)]
    args = TrainingArguments(output_dir=sys.argv[1], max_steps=2, fsdp=True, save_strategy="no",
                             disable_tqdm=True, per_device_train_batch_size=2, report_to="none")
    Trainer(model, args, train_dataset=data).train()
    torch.distributed.destroy_process_group()

atexit.register(report)
main()
"""


def _torchrun(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    """The script as 2 ranks with torchrun's rank environment, forked with their imports done (tests/preloaded.py:
    no thread of the forkserver's survives the fork; its children run the atexit handlers as an interpreter
    does); the ranks' stderr, rank by rank, is the returned stderr."""
    from tests import preloaded

    path = tmp_path / "worker.py"
    path.write_text(script)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    logs = tmp_path / "logs"
    logs.mkdir()
    codes, _ = preloaded.launch("tests.preloaded:run_script", [str(path), *args], env, 2, logs, stderr_apart=True)
    err = "".join((logs / f"rank{r}.err").read_text() for r in range(2))
    return subprocess.CompletedProcess(args, next((c for c in codes if c != 0), 0), "", err)  # (None: hung)


def _reports(stderr: str, marker: str) -> list[str]:
    """Each rank's report (two ranks' writes to the shared stderr can land on one line)."""
    return re.findall(rf"rank \d+ {marker}: \[[^\]]*\]", stderr)


def test_fsdp_bf16_cli_run_leaves_no_gloo_thread_behind(tmp_path):
    cfg = tmp_path / "lm.yaml"
    cfg.write_text(yaml.safe_dump(LM))
    done = _torchrun(tmp_path, CLI_WORKER, "train", "--config", str(cfg), "--train.output_dir",
                     str(tmp_path / "run"), "--train.per_device_train_batch_size", "2", "--train.fsdp", "true",
                     "--train.bf16", "true")
    assert done.returncode == 0, done.stderr[-3000:]
    reports = _reports(done.stderr, "threads after main")
    assert len(reports) == 2, done.stderr[-3000:]
    assert all("gloo" not in line for line in reports), reports  # e.g. pt_gloo_runloop, gloo_tcp_loop
    assert (tmp_path / "run" / "checkpoint-6").is_dir()


def test_a_script_that_destroys_the_group_itself_is_freed_at_exit(tmp_path):
    done = _torchrun(tmp_path, SCRIPT_WORKER, str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    reports = _reports(done.stderr, "threads at exit")
    assert len(reports) == 2, done.stderr[-3000:]
    assert all("gloo" not in line for line in reports), reports
