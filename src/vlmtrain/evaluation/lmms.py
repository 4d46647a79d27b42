"""lmms-eval tasks on a vlmtrain checkpoint: the metrics come back as ``eval_lmms_<task>_<metric>``.

lmms-eval is an optional extra that is installed without its dependencies (they would replace torch):
``pip install 'vlmtrain[lmms]' && pip install --no-deps lmms-eval==0.7.3``. A task is lmms-eval's own
YAML; a local one (``dataset_path: json`` with ``data_files`` next to the YAML, images by path) runs with
no network (shapes_task.py writes an example). The model is :class:`~vlmtrain.evaluation.lmms_model.VlmtrainLMM`
(greedy generation only), also reachable from lmms-eval's CLI as ``--model vlmtrain``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from vlmtrain.errors import ConfigError

LMMS_EVAL_VERSION = "0.7.3"
INSTALL_HINT = f"pip install 'vlmtrain[lmms]' && pip install --no-deps lmms-eval=={LMMS_EVAL_VERSION}"
PREFIX = "eval_lmms_"
logger = logging.getLogger(__name__)


def require_lmms_eval() -> None:
    """Raise a ConfigError with the install command when lmms_eval (or a module it imports) is missing."""
    try:
        import lmms_eval.evaluator  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"lmms-eval tasks need the lmms extra ({err}): {INSTALL_HINT}") from None


def lmms_eval_metrics(checkpoint: str, tasks: list[str], include_path: str | None = None, limit: int | None = None,
                      device: str | None = None, max_new_tokens: int = 32) -> dict[str, float]:
    """Run lmms-eval tasks on a checkpoint (a checkpoint-N/ dir, or a run dir: its newest checkpoint).

    tasks are names that include_path's YAML files define (searched recursively) or, when some are not
    there, lmms-eval's built-in tasks (most download from the Hub). limit caps the documents per task.
    Returns ``eval_lmms_<task>_<metric>`` (``_<filter>`` appended for a filter other than none).
    """
    require_lmms_eval()
    from lmms_eval import evaluator

    from vlmtrain.evaluation.lmms_model import VlmtrainLMM

    if not tasks:
        raise ConfigError("lmms_eval_tasks is empty: name at least one lmms-eval task.")
    _check_single_process()
    task_manager = _task_manager(tasks, include_path)
    model = VlmtrainLMM(checkpoint, device=device, max_new_tokens=max_new_tokens)
    out = evaluator.simple_evaluate(model=model, tasks=list(tasks), task_manager=task_manager, limit=limit,
                                    log_samples=False, bootstrap_iters=0, verbosity="WARNING")
    if out is None:
        raise RuntimeError("lmms-eval returned no results (it reports them on RANK 0 only; check $RANK).")
    return flatten_results(out["results"])


def flatten_results(results: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """lmms-eval's {task: {"exact_match,none": 0.5, "exact_match_stderr,none": ..., "alias": ...}} ->
    {"eval_lmms_<task>_exact_match": 0.5}; standard errors, aliases and non-numbers are left out."""
    flat: dict[str, float] = {}
    for task, values in results.items():
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            if metric == "alias" or "_stderr" in metric or isinstance(value, bool):
                continue
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            suffix = "" if filter_name in ("", "none") else f"_{filter_name}"
            flat[f"{PREFIX}{task}_{metric}{suffix}"] = float(value)
    return flat


def lmms_eval_manifest() -> Any:
    """lmms-eval's entry point (group lmms_eval.models): `lmms-eval --model vlmtrain --model_args
    checkpoint=DIR` finds the model without importing vlmtrain first."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest("vlmtrain", simple_class_path="vlmtrain.evaluation.lmms_model.VlmtrainLMM")


def _task_manager(tasks: list[str], include_path: str | None) -> Any:
    """Index include_path alone when it defines every task (lmms-eval's hundreds of built-in task dirs are
    slow to scan and need the Hub); otherwise the built-in tasks too."""
    import os

    from lmms_eval.tasks import TaskManager

    if include_path is not None and not os.path.isdir(include_path):
        raise ConfigError(f"lmms_eval_include_path {include_path!r} is not a directory of lmms-eval task YAMLs.")
    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=include_path, include_defaults=True)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f"in {include_path} or " if include_path else ""
        local = f" ({include_path} defines: {', '.join(_local_tasks(include_path)) or 'none'})" if include_path else ""
        raise ConfigError(f"lmms-eval task(s) {unknown} not found {where}among lmms-eval's built-in tasks{local}.")
    return manager


def _local_tasks(include_path: str) -> list[str]:
    from lmms_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=False).all_tasks


def _check_single_process() -> None:
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("lmms-eval tasks run in one process: run `vlmtrain eval` without torchrun (async "
                          "evaluation does) to evaluate lmms_eval_tasks.")


def check_run_args(args: Any, checkpoint: str | None) -> None:
    """Before any work: lmms_eval_tasks need a checkpoint, one process and lmms-eval installed."""
    if not args.lmms_eval_tasks:
        return
    if checkpoint is None:
        raise ConfigError("train.lmms_eval_tasks run on a checkpoint's weights: pass --checkpoint (a "
                          "checkpoint-N/ dir or a run dir).")
    _check_single_process()
    require_lmms_eval()


def lmms_eval_for_run(args: Any, checkpoint: str | None) -> dict[str, float]:
    """TrainingArguments' lmms_eval_tasks on checkpoint, as eval_lmms_* metrics; {} when none are set."""
    if not args.lmms_eval_tasks:
        return {}
    check_run_args(args, checkpoint)
    return lmms_eval_metrics(checkpoint, args.lmms_eval_tasks, args.lmms_eval_include_path, args.lmms_eval_limit,
                             max_new_tokens=args.generation_max_new_tokens)
