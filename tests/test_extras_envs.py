"""Each extra installs what its documented commands need: a fresh virtual environment per extra (the core
installed once by scripts/install.sh, each extra's environment reading the core's packages and installing only
`.[EXTRA]` on top, again by scripts/install.sh), then the commands the docs give for that extra.

Opt-in (VLMTRAIN_TEST_EXTRAS=1): it installs from the package index (network) and takes minutes, beyond what CI's
offline, 30-minute suite holds. See tests/README.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("VLMTRAIN_TEST_EXTRAS") != "1",
    reason="opt-in: VLMTRAIN_TEST_EXTRAS=1 installs each extra into a fresh venv from the package index")]
SMALL = ["--train.max_steps", "2", "--data.num_train", "16", "--data.num_eval", "2", "--train.eval_steps", "2",
         "--train.save_steps", "2", "--train.per_device_train_batch_size", "4", "--train.logging_steps", "1",
         "--train.disable_tqdm", "true"]


def _sh(cmd: list[str], env: dict[str, str], cwd: Path | None = None, timeout: int = 900) -> str:
    proc = subprocess.run(cmd, env=env, cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-4000:]}"
    return out


def _venv(path: Path, base_env: dict[str, str], core: Path | None = None) -> dict[str, str]:
    """A venv without the system's packages; with ``core``, it reads that venv's packages too (a .pth file)."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    env = {**base_env, "PATH": f"{path / 'bin'}{os.pathsep}{base_env['PATH']}", "VIRTUAL_ENV": str(path),
           "PYTHON": str(path / "bin" / "python")}
    if core is not None:
        site = _site_packages(path)
        (site / "_vlmtrain_core.pth").write_text(f"import site; site.addsitedir({str(_site_packages(core))!r})\n")
    return env


def _site_packages(venv: Path) -> Path:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return venv / "lib" / version / "site-packages"


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    """The core install (what the demo needs) and a 2-step shapes run made with it."""
    tmp = tmp_path_factory.mktemp("extras")
    base = {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VLMTRAIN_EXTRAS", "VIRTUAL_ENV", "PYTHONHOME")}
    base.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", VLMTRAIN_EXTRAS="")
    env = _venv(tmp / "core", base)
    print(_sh(["bash", "scripts/install.sh"], env))
    run = tmp / "run"
    _sh(["vlmtrain", "train", "--config", "configs/shapes-tiny.yaml", "--train.output_dir", str(run), *SMALL], env)
    out = _sh(["vlmtrain", "report", str(run)], env)
    assert (run / "report.html").is_file() and "wrote" in out
    return tmp, base, run


def _with_extra(core, extra: str) -> tuple[dict[str, str], Path]:
    tmp, base, run = core
    env = _venv(tmp / extra, {**base, "VLMTRAIN_EXTRAS": f"[{extra}]"}, core=tmp / "core")
    out = _sh(["bash", "scripts/install.sh"], env)
    assert "is installed: kept" in out  # the core's torch, not a second one
    work = tmp / f"{extra}-work"
    work.mkdir()
    return env, work


def test_the_core_runs_the_demo_commands_without_extras(core):
    tmp, base, run = core
    assert (run / "checkpoint-2").is_dir()
    env = {**base, "PATH": f"{tmp / 'core' / 'bin'}{os.pathsep}{base['PATH']}"}
    out = _sh(["python", "-c", "import importlib.util as u; print([m for m in ('peft', 'wandb', 'datasets', "
                               "'tensorboard', 'mlflow', 'trackio', 'submitit', 'lmms_eval', 'mkdocs') "
                               "if u.find_spec(m)])"], env)
    assert out.strip() == "[]", out  # an environment with the core only


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb", "mlflow", "trackio"])
def test_each_tracker_extra_syncs_a_run(core, tracker):
    env, work = _with_extra(core, tracker)
    env.update(WANDB_MODE="offline", WANDB_DIR=str(work), TRACKIO_DIR=str(work / "trackio"),
               MLFLOW_TRACKING_URI=f"sqlite:///{work / 'mlflow.db'}", WANDB_SILENT="true")
    out = _sh(["vlmtrain", "sync", str(core[2]), "--to", tracker, "--project", "extras"], env)
    assert f"to {tracker} run" in out, out


def test_lmms_extra_runs_lmms_eval_on_a_checkpoint_and_prints_its_table(core):
    env, work = _with_extra(core, "lmms")
    task = _sh(["python", "-m", "vlmtrain.evaluation.shapes_task", str(work / "task"), "--num-samples", "4"],
               env).strip().splitlines()[-1]
    out = _sh(["lmms-eval", "--model", "vlmtrain", "--model_args", f"checkpoint={core[2] / 'checkpoint-2'}",
               "--tasks", "shapes_vqa", "--include_path", task, "--output_path", str(work / "out")], env, cwd=work)
    assert "exact_match" in out and "|" in out and "Traceback" not in out, out[-3000:]


def test_lora_extra_trains_and_merges_an_adapter(core):
    env, work = _with_extra(core, "lora")
    _sh(["python", "scripts/build_tiny_hub.py", "qwen3_vl", str(work / "tiny")], env)
    _sh(["vlmtrain", "train", "--config", "configs/qwen3vl-tiny-score-heads.yaml", "--model.pretrained",
         str(work / "tiny"), "--model.lora", "{r: 4, alpha: 8}", "--train.output_dir", str(work / "run"),
         "--train.save_strategy", "steps", "--train.dataloader_num_workers", "0", *SMALL], env)
    out = _sh(["vlmtrain", "export", "--checkpoint", str(work / "run" / "checkpoint-2"), "--merge"], env)
    assert "wrote" in out and any((work / "run").glob("checkpoint-2-merged/*.safetensors"))


def test_hf_extra_reads_a_load_from_disk_dataset(core):
    env, work = _with_extra(core, "hf")
    _sh(["python", "-c", "import datasets, sys\n"
                         "from vlmtrain.tasks.shapes import ShapesVQA\n"
                         "rows = [{k: s[k] for k in ('images', 'texts')} for s in ShapesVQA('train', 8)]\n"
                         "datasets.Dataset.from_list(rows).save_to_disk(sys.argv[1])", str(work / "ds")], env)
    out = _sh(["vlmtrain", "data", "inspect", str(work / "ds")], env)
    assert "8" in out, out


def test_submitit_extra_runs_async_evaluation_as_jobs(core):
    env, work = _with_extra(core, "submitit")
    _sh(["vlmtrain", "train", "--config", "configs/shapes-tiny.yaml", "--train.output_dir", str(work / "run"),
         "--train.async_eval", "true", "--train.async_eval_launcher", "submitit",
         "--train.async_eval_launcher_kwargs", "{cluster: local, timeout_min: 10}", *SMALL], env)
    assert any((work / "run" / "async_eval" / "submitit").glob("*_log.out"))


def test_docs_extra_builds_the_site(core):
    env, work = _with_extra(core, "docs")
    _sh(["mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(work / "site")], env)
    assert (work / "site" / "index.html").is_file()

