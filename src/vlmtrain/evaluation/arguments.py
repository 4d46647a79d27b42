"""The evaluation layer's arguments: lmms-eval tasks on checkpoints (lmms.py) and the evaluation of saved
checkpoints in other processes (async_eval.py). :class:`EvaluationArguments` is a base of vlmtrain.TrainingArguments
(vlmtrain/compat/arguments.py), which runs its checks at construction among the trainer core's."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..trainer.args import check_choice


@dataclass
class EvaluationArguments:
    """The arguments of lmms-eval and of async evaluation (train.lmms_eval_*, train.async_eval*). Their checks
    below run when vlmtrain.TrainingArguments is built, among the core's (they read its save_strategy too)."""

    lmms_eval_tasks: list[str] | None = None
    """lmms-eval tasks that `vlmtrain eval --checkpoint` (and so async evaluation) also runs on the checkpoint,
    logged as eval_lmms_{task}_{metric}; needs the lmms extra (docs: Evaluation and tracking). None: none."""
    lmms_eval_include_path: str | None = None
    """Directory of lmms-eval task YAMLs (searched recursively) that defines lmms_eval_tasks; None: lmms-eval's
    built-in tasks only (most download from the Hugging Face Hub)."""
    lmms_eval_limit: int | None = None
    """Run each lmms-eval task on at most this many documents (None: all)."""
    async_eval: bool = False
    """Evaluate each saved checkpoint in a separate process while training goes on (rank 0 launches it). Results
    are logged at the checkpoint's step (metrics.jsonl and trackers) with eval_async, eval_checkpoint and when
    they arrived; exactly once across resumes. Inline evaluation (eval_strategy) is independent of it."""
    async_eval_launcher: str = "subprocess"
    """How async evaluations run: subprocess (on this machine) or submitit (SLURM on a cluster, local processes
    elsewhere; pip install -e '.[submitit]')."""
    async_eval_launcher_kwargs: dict[str, Any] | str | None = None
    """submitit's parameters, passed through (e.g. {slurm_partition: eval, gpus_per_node: 1, timeout_min: 60};
    cluster: local|slurm|debug picks the executor)."""
    async_eval_command: list[str] | None = None
    """The evaluation command; None: `{python} -m vlmtrain eval --config {run_dir}/config.yaml --checkpoint
    {checkpoint} --result-file {result_file} --train.output_dir {output_dir}`. Placeholders: python, run_dir,
    checkpoint, result_file, step, output_dir. It must write {result_file} as JSON {"metrics": {...}}."""
    async_eval_python: str | None = None
    """Python interpreter of the default evaluation command (e.g. another environment's); None: this one."""
    async_eval_device: str = "auto"
    """Where async evaluation processes compute (set through their CUDA_VISIBLE_DEVICES): auto (the last GPU
    this process sees: with torchrun's ranks on the first GPUs, a free one if any, else the last rank's, rank
    0's only on a one-GPU machine; nothing changes without GPUs or under submitit, whose scheduler assigns
    them), cpu (no GPU), or cuda:N (the N-th GPU this process sees; subprocess launcher only)."""
    async_eval_max_pending: int = 1
    """Evaluations running at once; a checkpoint saved while that many run follows async_eval_when_full."""
    async_eval_when_full: str = "wait"
    """wait (training pauses until an evaluation finishes) or skip (that checkpoint is not evaluated; logged)."""
    async_eval_timeout_s: float = 3600
    """An evaluation running longer is stopped and logged as failed (0: no limit)."""
    async_eval_wait_at_end_s: float = 3600
    """At the end, training waits at most this long for evaluations still running; later ones are logged by
    `vlmtrain eval --checkpoint RUN_DIR --all`."""

    def _check_lmms_eval(self) -> None:
        if self.lmms_eval_limit is not None and self.lmms_eval_limit < 1:
            raise ConfigError(f"lmms_eval_limit must be >= 1, or None for every document; got {self.lmms_eval_limit}.")

    def _check_async_eval(self) -> None:
        """The async_eval_* arguments (and the saved checkpoints async_eval needs)."""
        check_choice("async_eval_launcher", self.async_eval_launcher, ("subprocess", "submitit"))
        check_choice("async_eval_when_full", self.async_eval_when_full, ("wait", "skip"))
        if not re.fullmatch(r"auto|cpu|cuda:\d+", str(self.async_eval_device)):
            raise ConfigError(f"async_eval_device={self.async_eval_device!r}: expected 'auto', 'cpu' or 'cuda:N' "
                              "(N: a GPU index as this process numbers them, e.g. 'cuda:7').")
        if self.async_eval_device.startswith("cuda:") and self.async_eval_launcher != "subprocess":
            raise ConfigError(f"async_eval_device={self.async_eval_device!r} names a GPU of this machine, but "
                              f"async_eval_launcher={self.async_eval_launcher!r} runs evaluations elsewhere: leave "
                              "it 'auto' (the scheduler assigns GPUs, e.g. async_eval_launcher_kwargs "
                              "{gpus_per_node: 1}) or set 'cpu'.")
        if self.async_eval_max_pending < 1:
            raise ConfigError(f"async_eval_max_pending must be >= 1, got {self.async_eval_max_pending}.")
        if self.async_eval_command is not None and not any("{result_file}" in p for p in self.async_eval_command):
            raise ConfigError("async_eval_command must write its metrics to {result_file} (a placeholder in one of "
                              f"its arguments); got {self.async_eval_command!r}.")
        if self.async_eval and self.save_strategy == "no":  # (save_strategy: the core's field)
            raise ConfigError("async_eval evaluates saved checkpoints: set save_strategy to steps or epoch.")
