"""train.async_eval: every saved checkpoint is evaluated by another process while training goes on.

On rank 0: saving checkpoint-N queues step N; once checkpoint-N is complete on disk a job runs
`vlmtrain eval --checkpoint checkpoint-N --result-file async_eval/step-N.json` (or train.async_eval_command) as
a subprocess or through submitit (SLURM on a cluster), on the device train.async_eval_device names (its
CUDA_VISIBLE_DEVICES; by default the last GPU this process sees). At each step end finished jobs are read and
their metrics logged at step N (metrics.jsonl and every tracker), with `eval_async`, `eval_checkpoint` and when
they arrived (`eval_arrived_step`, `eval_arrived_at`). A failed, timed-out or corrupt evaluation is a logged row
naming its log file, never a training failure; a checkpoint still queued is kept by rotation.

Exactly once across kill -9: the queue and the steps already logged are part of every checkpoint. A resumed run
queues again what its checkpoint had not logged (and the checkpoint it resumes from), reading results already
on disk instead of evaluating again; metrics.jsonl drops the rows logged after that checkpoint, so none is
logged twice.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from ..logging.eval_samples import THUMBNAIL_DIR
from ..trainer import checkpoint as ckpt
from ..trainer.distributed import rank, reduce_cpu

DIR = "async_eval"
POLL_S = 0.2  # seconds between polls while the ranks wait for an evaluation
DEFAULT_COMMAND = ("{python}", "-m", "vlmtrain", "eval", "--config", "{run_dir}/config.yaml", "--checkpoint",
                   "{checkpoint}", "--result-file", "{result_file}", "--train.output_dir", "{output_dir}")
# torchrun's variables: the evaluation is a process of its own, not one more rank of the training job
_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
             "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
             "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
RETRIES = 1  # a job that reports success but leaves a corrupt result file is run once more, then logged as failed


def visible_gpus() -> list[str]:
    """This process's GPUs as CUDA_VISIBLE_DEVICES names them (indices or UUIDs), in torch's order; [] when it
    sees none."""
    import torch

    if not torch.cuda.is_available():
        return []
    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(count)]
    return [d.strip() for d in listed.split(",") if d.strip()][:count]


def device_env(setting: str, launcher: str, gpus: list[str]) -> dict[str, str]:
    """The environment that puts an evaluation process on train.async_eval_device's device (see
    TrainingArguments), given this process's ``gpus`` (:func:`visible_gpus`); {} leaves it as it is."""
    if setting == "cpu":
        return {"CUDA_VISIBLE_DEVICES": ""}
    if setting == "auto":  # torchrun's ranks take the first GPUs: the last is free, or at least not rank 0's
        return {"CUDA_VISIBLE_DEVICES": gpus[-1]} if gpus and launcher == "subprocess" else {}
    index = int(setting[len("cuda:"):])
    if index >= len(gpus):
        raise ConfigError(f"async_eval_device={setting!r}, but this process sees {len(gpus)} GPU(s)"
                          + (f" ({', '.join(gpus)})" if gpus else "") + ": choose cuda:0 to "
                          f"cuda:{max(len(gpus) - 1, 0)}, 'auto' or 'cpu'.")
    return {"CUDA_VISIBLE_DEVICES": gpus[index]}


def read_result(path: str) -> dict[str, Any] | None:
    """The metrics of a result file (`{"step", "checkpoint", "metrics": {...}}`); None when it is missing,
    partial or corrupt (then it is never ingested)."""
    try:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, ValueError):
        return None
    metrics = result.get("metrics") if isinstance(result, dict) else None
    if not isinstance(metrics, dict) or not metrics:
        return None
    if not all(isinstance(v, (int, float, str)) or v is None for v in metrics.values()):
        return None
    return metrics


def write_result(path: str, step: int | None, checkpoint: str, metrics: dict[str, Any]) -> None:
    """Write a result file atomically (what `vlmtrain eval --result-file` does): complete or absent."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in metrics.items()}
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"step": step, "checkpoint": checkpoint, "metrics": clean, "finished_at": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def result_row(step: int, metrics: dict[str, Any], arrived_step: int | None) -> dict[str, Any]:
    """The metrics.jsonl row of checkpoint-``step``'s evaluation: logged at that step, marked as async."""
    row = {k if k.startswith("eval_") else f"eval_{k}": v for k, v in metrics.items()}
    return {"step": step, **row, "eval_async": True, "eval_checkpoint": f"{ckpt.PREFIX}-{step}",
            "eval_arrived_step": arrived_step, "eval_arrived_at": round(time.time(), 3)}


def move_eval_samples(run_dir: str, step: int) -> None:
    """Per-sample predictions an evaluation wrote in its own directory go next to metrics.jsonl, and the
    thumbnails their rows refer to (by path relative to that directory) join the run's, where missing."""
    out = os.path.join(run_dir, DIR, f"step-{step}")
    if os.path.isdir(out):
        for name in os.listdir(out):
            if name.startswith("eval_samples_") and name.endswith(".jsonl"):
                shutil.move(os.path.join(out, name), os.path.join(run_dir, name))
    for folder, _, files in os.walk(os.path.join(out, THUMBNAIL_DIR)):
        target = os.path.join(run_dir, os.path.relpath(folder, out))
        os.makedirs(target, exist_ok=True)
        for name in files:  # the same eval set at every step: a thumbnail already there is the same image
            if not os.path.exists(os.path.join(target, name)):
                shutil.move(os.path.join(folder, name), os.path.join(target, name))


BOOKKEEPING = ("eval_async", "eval_checkpoint", "eval_arrived_step", "eval_arrived_at", "eval_async_error",
                "eval_async_status")


def evaluated_steps(run_dir: str) -> set[int]:
    """Steps that metrics.jsonl holds metrics of an evaluation for (inline or async; a failed or skipped
    async evaluation does not count)."""
    steps = set()
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if any(k.startswith("eval_") and k not in BOOKKEEPING for k in row):
                    steps.add(row.get("step"))
    return steps


def log_result(run_dir: str, step: int) -> dict[str, Any]:
    """Append checkpoint-``step``'s result file to metrics.jsonl as its row (after training: `vlmtrain eval
    --all`; trackers get it through `vlmtrain sync`)."""
    metrics = read_result(os.path.join(run_dir, DIR, f"step-{step}.json"))
    if metrics is None:
        raise ValueError(f"{os.path.join(run_dir, DIR, f'step-{step}.json')} is missing or corrupt.")
    row = result_row(step, metrics, None)
    move_eval_samples(run_dir, step)
    with open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    return row


class _SubprocessJob:
    def __init__(self, command: list[str], env: dict[str, str], log_path: str, **options: Any) -> None:
        if options:
            raise ValueError(f"async_eval_launcher='subprocess' takes no async_eval_launcher_kwargs; got "
                             f"{sorted(options)} (they are for submitit).")
        self.log_path = log_path
        with open(log_path, "w", encoding="utf-8") as log:
            self._proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL)

    def done(self) -> bool:
        return self._proc.poll() is not None

    def failure(self) -> str | None:
        code = self._proc.returncode
        return None if code == 0 else f"exit code {code}"

    def cancel(self) -> None:
        self._proc.kill()
        self._proc.wait()


class _SubmititJob:
    def __init__(self, command: list[str], env: dict[str, str], log_path: str, **options: Any) -> None:
        try:
            import submitit
        except ImportError:
            raise ImportError("async_eval_launcher='submitit' needs submitit: pip install 'vlmtrain[submitit]'.") \
                from None
        folder = os.path.join(os.path.dirname(log_path), "submitit")
        options = dict(options)
        executor = submitit.AutoExecutor(folder=folder, cluster=options.pop("cluster", None))
        executor.update_parameters(**options)
        self._job = executor.submit(submitit.helpers.CommandFunction(command, verbose=False, env=env))
        self.log_path = str(self._job.paths.stdout)

    def done(self) -> bool:
        return self._job.done()

    def failure(self) -> str | None:
        error = self._job.exception()
        return None if error is None else f"{type(error).__name__}: {str(error).strip()[-300:]}"

    def cancel(self) -> None:
        self._job.cancel(check=False)


LAUNCHERS = {"subprocess": _SubprocessJob, "submitit": _SubmititJob}


class AsyncEvaluator:
    """Rank 0's queue of checkpoints to evaluate in other processes (see the module docstring). ``poll`` returns
    the rows to log and never blocks: where training must wait for an evaluation it sets ``waiting`` and the
    trainer polls again, every rank waiting with rank 0; ``state_dict`` goes into every checkpoint."""

    def __init__(self, args: Any) -> None:
        self.args, self.run_dir = args, args.output_dir
        self.queue: list[int] = []  # saved checkpoints whose results are not logged yet, oldest first
        self.logged: set[int] = set()
        self._jobs: dict[int, tuple[Any, float]] = {}  # step -> (job, start time)
        self._attempts: Counter = Counter()
        self._device_env: dict[str, str] | None = None  # CUDA_VISIBLE_DEVICES for train.async_eval_device
        self.waiting = False  # set by poll: training must not go on before the next poll
        self._end_deadline: float | None = None  # (at the end of training) async_eval_wait_at_end_s from then

    # -- state -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"queue": list(self.queue), "logged": sorted(self.logged)}

    def load_state_dict(self, state: dict[str, Any], resumed_step: int) -> None:
        """Resume from checkpoint-``resumed_step``: what it had not logged is queued again (that checkpoint
        too, queued just after it was written). Results of later steps belong to the run that crashed."""
        self.logged = {s for s in state.get("logged", []) if s <= resumed_step}
        self.queue = sorted({s for s in [*state.get("queue", []), resumed_step]
                             if s <= resumed_step and s not in self.logged})

    def check_command(self) -> None:
        """At train start: async_eval_device names a GPU this machine has, and the default command evaluates with
        the run's config.yaml (vlmtrain train writes it)."""
        self._device_env = device_env(self.args.async_eval_device, self.args.async_eval_launcher, visible_gpus())
        if self.args.async_eval_command is None and not os.path.isfile(os.path.join(self.run_dir, "config.yaml")):
            raise ValueError(
                f"train.async_eval evaluates checkpoints with `vlmtrain eval --config "
                f"{os.path.join(self.run_dir, 'config.yaml')}`, and there is no such file: train through "
                f"`vlmtrain train --config ...` (it writes config.yaml), or set async_eval_command to your own "
                f"evaluation command.")

    def in_use(self) -> list[str]:
        """Checkpoints rotation must keep: their evaluation has not been logged yet."""
        return [self._checkpoint(step) for step in self.queue]

    # -- the queue ---------------------------------------------------------------------------------------
    def enqueue(self, step: int) -> None:
        """checkpoint-``step`` is being saved: evaluate it once it is complete (a stale result left by a run
        that crashed after this step is removed first)."""
        if step in self.logged or step in self.queue:
            return
        for path in (self._result_file(step), self._log_file(step)):
            if os.path.exists(path):
                os.remove(path)
        self.queue.append(step)

    def poll(self, current_step: int, at_end: bool = False) -> list[dict[str, Any]]:
        """Never blocks: rows for evaluations that finished; jobs launched for complete checkpoints that have a
        free slot (async_eval_when_full: 'skip' logs a step that has none as skipped). Afterwards :attr:`waiting`
        says whether training must not go on yet, and the caller polls again after a pause (every rank waits
        there together, see :meth:`poll_in_step`): a complete checkpoint has no free slot
        (async_eval_when_full: 'wait'), or, ``at_end`` (the end of training), evaluations are still queued,
        for at most async_eval_wait_at_end_s from the first such call."""
        rows, self.waiting = self._collect(current_step), False
        for step in list(self.queue):
            if step in self._jobs:
                continue
            result = self._result_file(step)
            metrics = read_result(result)
            if metrics is not None:  # evaluated before a resume: logged, not evaluated again
                rows.append(self._row(step, current_step, metrics))
                continue
            if os.path.exists(result):
                warnings.warn(f"train.async_eval: {result} is partial or corrupt: not logged; checkpoint-{step} is "
                              f"evaluated again (the file is kept as {result}.corrupt).", stacklevel=3)
                os.replace(result, result + ".corrupt")
            if not os.path.isfile(os.path.join(self._checkpoint(step), ckpt.STATE_NAME)):
                if at_end and not os.path.isdir(self._checkpoint(step)):
                    rows.append(self._row(step, current_step, {
                        "eval_async_error": f"{self._checkpoint(step)} is missing"}))
                continue  # (async_checkpoint) still being written
            if len(self._jobs) >= self.args.async_eval_max_pending:
                if self.args.async_eval_when_full == "skip":
                    rows.append(self._row(step, current_step, {"eval_async_status": (
                        f"skipped: {len(self._jobs)} evaluations were still running (async_eval_max_pending)")}))
                    continue
                self.waiting = True  # launched, in order, once a slot frees
                break
            self._launch(step)
        if at_end:
            self._wait_at_end()
        return rows

    def poll_in_step(self, current_step: int, at_end: bool, log_rows: Callable[[list[dict[str, Any]]], None]) -> None:
        """(every rank, at a step end or ``at_end`` of training) Rank 0 polls (:meth:`poll`) and hands the rows to
        ``log_rows``. Where it must wait for an evaluation (async_eval_when_full: wait with no free slot; at the end,
        until all are logged or async_eval_wait_at_end_s) every rank waits here with it, the ranks agreeing once per
        poll through one small all-reduce: no rank sits in a collective meanwhile, so the wait may last longer than
        ddp_timeout."""
        while True:
            waiting = False
            if rank() == 0:
                log_rows(self.poll(current_step, at_end=at_end))
                waiting = self.waiting
            if not reduce_cpu([float(waiting)], "max")[0]:
                return
            time.sleep(POLL_S)

    def _wait_at_end(self) -> None:
        """(at the end of training) Wait while anything is queued, within async_eval_wait_at_end_s."""
        timeout = self.args.async_eval_wait_at_end_s
        if self._end_deadline is None:
            self._end_deadline = time.monotonic() + timeout
        self.waiting = bool(self.queue)
        if self.queue and time.monotonic() > self._end_deadline:
            warnings.warn(f"train.async_eval: {len(self.queue)} evaluation(s) still running after "
                          f"async_eval_wait_at_end_s={timeout:g} s (steps {self.queue}); their results are not "
                          f"logged by this run: `vlmtrain eval --checkpoint {self.run_dir} --all` logs them later.",
                          stacklevel=4)
            self.waiting = False

    # -- internals ---------------------------------------------------------------------------------------
    def _collect(self, current_step: int) -> list[dict[str, Any]]:
        rows = []
        for step, (job, started) in list(self._jobs.items()):
            timeout = self.args.async_eval_timeout_s
            if not job.done():
                if timeout and time.monotonic() - started > timeout:
                    job.cancel()
                    del self._jobs[step]
                    rows.append(self._row(step, current_step, {"eval_async_error": (
                        f"timed out after {timeout:g} s (async_eval_timeout_s); log: {job.log_path}")}))
                continue
            del self._jobs[step]
            failure = job.failure()
            if failure is not None:
                rows.append(self._row(step, current_step, {"eval_async_error": f"{failure}; log: {job.log_path}"}))
                continue
            metrics = read_result(self._result_file(step))
            if metrics is not None:
                rows.append(self._row(step, current_step, metrics))
            elif self._attempts[step] <= RETRIES:  # re-queued: launched again by the caller's next pass
                result = self._result_file(step)
                warnings.warn(f"train.async_eval: the result of checkpoint-{step} ({result}) is missing or corrupt "
                              f"although its job succeeded (log: {job.log_path}); evaluating it again.", stacklevel=4)
                if os.path.exists(result):
                    os.replace(result, result + ".corrupt")
            else:
                rows.append(self._row(step, current_step, {"eval_async_error": (
                    f"corrupt or missing result file {self._result_file(step)}; log: {job.log_path}")}))
        return rows

    def _launch(self, step: int) -> None:
        self._attempts[step] += 1
        out = self._job_dir(step)
        os.makedirs(out, exist_ok=True)
        values = {"python": self.args.async_eval_python or sys.executable, "run_dir": self.run_dir,
                  "checkpoint": self._checkpoint(step), "result_file": self._result_file(step), "step": str(step),
                  "output_dir": out}
        # Only the known {placeholders} are replaced: other braces (e.g. in a python -c script) stay as written.
        pattern = re.compile("{(" + "|".join(values) + ")}")
        command = [pattern.sub(lambda m: values[m.group(1)], part)
                   for part in (self.args.async_eval_command or DEFAULT_COMMAND)]
        env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
        if self._device_env is None:
            self._device_env = device_env(self.args.async_eval_device, self.args.async_eval_launcher, visible_gpus())
        env.update(self._device_env)  # train.async_eval_device
        launcher = LAUNCHERS[self.args.async_eval_launcher]
        job = launcher(command, env, self._log_file(step), **(self.args.async_eval_launcher_kwargs or {}))
        self._jobs[step] = (job, time.monotonic())

    def _row(self, step: int, current_step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """The row logged for checkpoint-``step``; it leaves the queue (its checkpoint may now be rotated)."""
        self.queue.remove(step)
        self.logged.add(step)
        move_eval_samples(self.run_dir, step)
        return result_row(step, metrics, current_step)

    def _checkpoint(self, step: int) -> str:
        return os.path.join(self.run_dir, f"{ckpt.PREFIX}-{step}")

    def _job_dir(self, step: int) -> str:
        return os.path.join(self.run_dir, DIR, f"step-{step}")

    def _result_file(self, step: int) -> str:
        return os.path.join(self.run_dir, DIR, f"step-{step}.json")

    def _log_file(self, step: int) -> str:
        return os.path.join(self.run_dir, DIR, f"step-{step}.log")


def checkpoint_evaluator(args: Any) -> AsyncEvaluator | None:
    """The trainer's ``checkpoint_evaluator``: the AsyncEvaluator when train.async_eval is on (rank 0's evaluates;
    every rank's waits with it, :meth:`AsyncEvaluator.poll_in_step`), else None."""
    return AsyncEvaluator(args) if args.async_eval else None

