"""What the CLI runs: build a Trainer from a RunConfig (:func:`vlmtrain.compose.build`), then train, evaluate,
generate or run the demo.

Heavy modules (torch, transformers, the Trainer, data sources) are imported inside the functions, so a
bad config fails in the time it takes to read YAML.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import time
from pathlib import Path
from typing import Any

from vlmtrain.checkpoint_paths import check_writable, resolve_checkpoint
from vlmtrain.compose import build
from vlmtrain.config import ConfigError, RunConfig, load_run_config, save_run_config

DEMO_CONFIG = "shapes-tiny.yaml"
logger = logging.getLogger(__name__)


def resume_arg(value: str | None) -> str | bool | None:
    """TrainingArguments.resume_from_checkpoint as Trainer.train takes it: 'true'/'latest' -> True."""
    if value is None or value.lower() in ("", "false", "none", "no"):
        return None
    return True if value.lower() in ("true", "latest", "yes") else value


def train(cfg: RunConfig) -> dict[str, Any]:
    """Train as configured (resuming if train.resume_from_checkpoint says so); return the final metrics,
    including a final evaluation when there is an eval set."""
    return _train(cfg)[1]


def _train(cfg: RunConfig, console: Any = None, resume: str = "--train.resume_from_checkpoint true"
           ) -> tuple[Any, dict[str, Any]]:
    """console: a callback that replaces the progress bar and log lines (the demo's EvalLinesCallback);
    resume: what a preempted run tells the user to resubmit with."""
    check_writable(cfg.train.output_dir, "--train.output_dir")  # one line now, not a traceback after loading
    if cfg.train.max_steps <= 0 and cfg.train.max_steps != -1 and os.environ.get("RANK", "0") == "0":
        # transformers trains by epochs for any max_steps <= 0 without a word; a typed -5 deserves one
        logger.warning("train.max_steps=%d is not positive: training for train.num_train_epochs=%s epochs, as "
                       "transformers does for any max_steps <= 0 (its default is -1).", cfg.train.max_steps,
                       cfg.train.num_train_epochs)
    trainer = build(cfg)
    if console is not None:
        from vlmtrain.logging.console import PrinterCallback, ProgressCallback

        trainer.pop_callback(ProgressCallback)
        trainer.pop_callback(PrinterCallback)
        trainer.add_callback(console)
    if trainer.rank == 0:
        save_run_config(cfg, cfg.train.output_dir)
    out = trainer.train(resume_from_checkpoint=resume_arg(cfg.train.resume_from_checkpoint))
    metrics = {"global_step": out.global_step, "training_loss": out.training_loss, **(out.metrics or {})}
    if trainer.preempted:  # no time for a final evaluation: the checkpoint is what matters
        metrics["preempted"] = True
        logger.warning("preempted at step %d; checkpoint saved in %s. Resubmit with %s to continue.",
                       out.global_step, cfg.train.output_dir, resume)
        return trainer, metrics
    if getattr(trainer, "eval_dataset", None) is not None:
        if str(getattr(cfg.train.eval_strategy, "value", cfg.train.eval_strategy)) == "no" and trainer.rank == 0:  # (a transformers example script's --do_eval)
            logger.warning("train.eval_strategy is 'no': evaluating the trained model once on the eval set, as "
                           "vlmtrain train does after training (data.num_eval: 0, or no eval data, skips it).")
        metrics.update(_final_evaluation(trainer, cfg, out.global_step))
    metrics.update(_summary(cfg, metrics))
    return trainer, metrics


def _final_evaluation(trainer: Any, cfg: RunConfig, last_step: int) -> dict[str, Any]:
    """The eval metrics of the trained model: an evaluation the run already made of its last step (inline or
    async) rather than a second one. Rank 0 decides: it alone logs the asynchronous evaluations, and evaluate() is
    a collective every rank must enter (or none), so its decision reaches every rank."""
    from vlmtrain.evaluation.async_eval import BOOKKEEPING
    from vlmtrain.trainer import distributed as dist

    state = trainer.state  # (load_best_model_at_end: the model is now the best step's)
    step = state.best_global_step if cfg.train.load_best_model_at_end and state.best_model_checkpoint else last_step
    last = [h for h in state.log_history if h.get("step") == step
            and any(k.startswith("eval_") and k.endswith("loss") for k in h)]
    made = {k: v for h in last for k, v in h.items() if k.startswith("eval_") and k not in BOOKKEEPING} or None
    made = dist.broadcast_object(made, src=0)
    return made if made is not None else trainer.evaluate()


def evaluate(cfg: RunConfig, checkpoint: str | None = None, result_file: str | None = None) -> dict[str, Any]:
    """Evaluate the configured model, or the weights of a checkpoint (logged at its step), on the eval set;
    with result_file, also write the metrics there atomically (what async evaluation reads)."""
    from vlmtrain.evaluation.async_eval import write_result
    from vlmtrain.evaluation.lmms import check_run_args, lmms_eval_for_run
    from vlmtrain.trainer.checkpoint import checkpoint_step

    ckpt = resolve_checkpoint(checkpoint, cfg.train.output_dir) if checkpoint else None
    cfg = _apart_from_the_run(cfg)
    check_writable(cfg.train.output_dir, "--train.output_dir")  # metrics.jsonl goes there
    check_run_args(cfg.train, ckpt)  # train.lmms_eval_tasks: fail before any work
    trainer = build(cfg, checkpoint=ckpt)
    step = checkpoint_step(ckpt) if ckpt else None
    trainer.state.global_step = step or 0  # rows and per-sample files carry the checkpoint's step
    metrics = trainer.evaluate()
    metrics = {**metrics, **_summary(cfg, metrics), **lmms_eval_for_run(cfg.train, ckpt)}
    if result_file is not None and trainer.rank == 0:
        write_result(result_file, step, ckpt or "", metrics)
    return metrics


def evaluate_all(run_dir: str, cfg: RunConfig) -> dict[int, dict[str, Any]]:
    """Evaluate every complete checkpoint of run_dir that metrics.jsonl has no evaluation for (async
    evaluations still running when training ended, or never run); a result already on disk is logged without
    evaluating again. Rows are appended to metrics.jsonl (marked eval_async); returns them by step."""
    from vlmtrain.evaluation import async_eval
    from vlmtrain.trainer.checkpoint import checkpoint_step, list_checkpoints

    changed = _data_changes(cfg, run_dir)
    if changed:
        raise ConfigError(f"vlmtrain eval --all appends the run's own evaluations to its metrics.jsonl, but "
                          f"{', '.join(changed)} differ from the run's config.yaml: drop those overrides, or "
                          f"evaluate one checkpoint (recorded apart, under {os.path.join(run_dir, EVALS)}/).")
    done, rows = async_eval.evaluated_steps(run_dir), {}
    for path in list_checkpoints(run_dir):
        step = checkpoint_step(path)
        if step in done:
            continue
        result = os.path.join(run_dir, async_eval.DIR, f"step-{step}.json")
        if async_eval.read_result(result) is None:
            scratch = os.path.join(run_dir, async_eval.DIR, f"step-{step}")
            evaluate(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=scratch)), path,
                     result_file=result)
        rows[step] = async_eval.log_result(run_dir, step)
    return rows


EVALS = "evals"  # <run>/evals/<name>/: evaluations of the run's checkpoints on other data than the run's


def _data_changes(cfg: RunConfig, run_dir: str) -> list[str]:
    """The data.* keys of ``cfg`` that differ from the run's own (``run_dir``/config.yaml; none without one)."""
    import yaml

    from vlmtrain.config import DataConfig

    saved = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(saved):
        return []
    with open(saved) as f:
        theirs = (yaml.safe_load(f) or {}).get("data") or {}

    def as_saved(data: DataConfig) -> dict[str, Any]:
        return yaml.safe_load(yaml.safe_dump(dataclasses.asdict(data)))

    ours = as_saved(cfg.data)
    theirs = {**as_saved(DataConfig()), **theirs}  # (a key newer than the run's file: its default)
    return [f"data.{key}" for key in sorted(set(ours) | set(theirs)) if ours.get(key) != theirs.get(key)]


def _apart_from_the_run(cfg: RunConfig) -> RunConfig:
    """An evaluation on other data than the run's (a data.* key differs from train.output_dir's config.yaml) is
    written under ``<output_dir>/evals/<name>/`` (its own metrics.jsonl and sample files; ``name``: the eval
    file's, else a digest of the data settings): the run's rows, sample files and report stay the run's own."""
    import hashlib
    import json

    changed = _data_changes(cfg, cfg.train.output_dir)
    if not changed:
        return cfg
    data = dataclasses.asdict(cfg.data)
    name = Path(cfg.data.eval_file).stem if "data.eval_file" in changed and cfg.data.eval_file else \
        "data-" + hashlib.sha1(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:8]
    out = os.path.join(cfg.train.output_dir, EVALS, name)
    logger.warning("%s differ from the run's config.yaml: this evaluation is written to %s, not to the run's "
                   "metrics.jsonl", ", ".join(changed), out)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=out))


def generate(checkpoint: str, prompt: str, images: list[str] | None = None, max_new_tokens: int = 32,
             videos: list[str] | None = None) -> str:
    """Answer one prompt (with images and videos, for a VLM) from a trained checkpoint, greedily."""
    from vlmtrain.models.kinds import kind_of_checkpoint

    ckpt = resolve_checkpoint(checkpoint, checkpoint)
    from vlmtrain.trainer.model_files import has_sharded_weights

    if has_sharded_weights(ckpt):
        raise ConfigError(f"{ckpt} holds FSDP shards: run `vlmtrain export --checkpoint {ckpt}` first.")
    kind = kind_of_checkpoint(ckpt)
    if not videos:
        return kind.generate(ckpt, prompt, images, max_new_tokens)
    for video in videos:
        if not os.path.isfile(video):
            raise ConfigError(f"--video {video!r} does not exist (or is not a file).")
    if kind.load_for_inference is None:  # (videos go through the Hub families' processors)
        raise ConfigError(f"--video: {ckpt} is a {kind.name!r} model, which takes no videos (videos: Hub VLM "
                          f"checkpoints of Qwen3-VL / Qwen2.5-VL).")
    from vlmtrain.inference import load_for_inference

    return load_for_inference(ckpt, device="cpu", dtype="float32").generate(prompt, images=images or [],
                                                                           videos=videos,
                                                                           max_new_tokens=max_new_tokens)


def inspect_checks(config: str | None, model: str | None) -> tuple[Any, Any]:
    """What ``vlmtrain data inspect`` checks with: (the raw-sample check the run of ``config`` makes before
    tokenizing, its model kind's ``record_check``, or None for the default; the video planning: the video support
    of ``model``'s family (else of the config's model.pretrained's) for the config's data.video_* settings, or
    those settings alone without a model)."""
    from vlmtrain.config import DataConfig
    from vlmtrain.data.video import VideoSettings
    from vlmtrain.models.kinds import get_kind

    cfg = load_run_config(config) if config else None
    check = None
    key = "--model"
    if cfg is not None:
        if model:  # (--model stands in for model.pretrained, in the checks too)
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, pretrained=model))
        else:
            model, key = cfg.model.pretrained, "model.pretrained"
        kind = get_kind(cfg.model.kind)
        check = kind.record_check(cfg) if kind.record_check is not None else None
        if cfg.train.objective == "grpo":  # (a prompt as the run tokenizes it)
            from vlmtrain.config_grpo import prompt_check

            check = prompt_check(cfg)
        elif cfg.train.objective != "sft":  # (a pair's processing, with its tokens to show)
            from vlmtrain.data.pairs import pair_check

            check = pair_check(kind.pairs(cfg))
    settings = VideoSettings.from_data(cfg.data if cfg is not None else DataConfig())
    if model is None:
        return check, settings
    from vlmtrain.models.families import family_of

    try:
        family = family_of(model, key=key)
    except ConfigError:
        if key == "model.pretrained":  # (the config's model is no Hub VLM, e.g. a causal LM: no video planning)
            return check, settings
        raise
    if family.video is None and key == "model.pretrained":  # (the config's model takes no videos: no planning)
        return check, settings
    if family.video is None:
        raise ConfigError(f"--model {model}: the {family.name} family has no video support in vlmtrain "
                          f"(video: Qwen3-VL, Qwen2.5-VL).")
    return check, family.video(family.load_processor(model), settings)


def find_demo_config(name: str = DEMO_CONFIG) -> Path:
    """configs/<name> of the repository (or of the current directory)."""
    candidates = [Path(__file__).resolve().parents[2] / "configs" / name, Path.cwd() / "configs" / name]
    for path in candidates:
        if path.is_file():
            return path
    raise ConfigError(f"cannot find configs/{name} (looked in {', '.join(str(c.parent) for c in candidates)}).")


def _summary(cfg: RunConfig, metrics: dict[str, Any]) -> dict[str, float]:
    """The data source's own summary of an evaluation (e.g. shapes' single/multi-image means)."""
    from vlmtrain.data.registry import get_source

    summary = get_source(cfg.data.source).summary
    return summary(metrics, "eval") if summary is not None else {}


def demo(output_dir: str | None = None, config: str | None = None, seed: int | None = None,
         overrides: dict[str, Any] | None = None, resume: bool = False) -> dict[str, Any]:
    """Train the demo config (configs/shapes-tiny.yaml unless ``config`` names another) on CPU, showing the
    progress bar and a line per evaluation (:func:`demo_console`), and print the results (per question type
    and against blank images for shapes-VQA, with examples), the time spent and where everything went (on a
    CUDA machine with data-loader workers: :func:`demo_workers`). ``seed`` sets both train.seed
    (initialization) and data.seed (the questions); ``overrides`` ({'train.eval_strategy': 'no'}, ...) win
    over the config, the seed and the workers. ``resume``: continue from the newest checkpoint in the output
    directory (a demo stopped by SIGTERM says so)."""
    from vlmtrain.data.registry import get_source

    path = Path(config) if config else find_demo_config()
    if not path.is_file():
        raise ConfigError(f"demo config {str(path)!r} does not exist.")
    settings: dict[str, Any] = {"train.output_dir": output_dir} if output_dir else {}
    if seed is not None:
        settings.update({"train.seed": seed, "data.seed": seed})
    if resume:
        settings["train.resume_from_checkpoint"] = "true"
    cfg = load_run_config(path, {**settings, **(overrides or {})} or None)
    if "train.dataloader_num_workers" not in (overrides or {}):
        cfg.train.dataloader_num_workers = demo_workers(cfg.train.dataloader_num_workers)
    workers = cfg.train.dataloader_num_workers
    start = time.perf_counter()
    source = get_source(cfg.data.source)
    again = " ".join(["vlmtrain demo", *(f"{k} {shlex.quote(str(v))}" for k, v in
                                          (("--config", config), ("--output-dir", output_dir), ("--seed", seed))
                                          if v is not None), "--resume"])
    trainer, metrics = _train(cfg, console=demo_console(cfg), resume=f"`{again}`")
    out = cfg.train.output_dir
    if metrics.get("preempted"):  # the checkpoint is saved; the report waits for the finished run
        return metrics
    if cfg.train.objective == "dpo" and cfg.model.kind == "hub_vlm" and trainer.eval_dataset is not None:
        report = _preference_report(trainer, metrics, cfg)
    elif cfg.train.objective == "grpo" and cfg.model.kind == "hub_vlm" and cfg.data.source == "shapes_pairs":
        report = _grpo_report(metrics, cfg)
    elif source.demo_report is not None:
        report = source.demo_report(trainer, metrics)
    else:
        exact, loss = _pick(metrics, "eval_exact_match", "exact_match"), _pick(metrics, "eval_loss")
        report = (f"  eval exact-match: {exact}   eval loss: {loss}\n"
                  f"  held-out examples (Trainer.predict): {_examples(trainer)}")
    seconds, training = time.perf_counter() - start, metrics.get("train_runtime", float("nan"))
    print(f"\nvlmtrain demo ({path.name}, train.seed {cfg.train.seed}, data.seed {cfg.data.seed}): "
          f"{metrics.get('global_step')} steps\n"
          f"{report}\n"
          f"  time:        {seconds:.0f}s in all: {training:.0f}s training "
          f"({metrics.get('train_steps_per_second', float('nan')):.2f} steps/s"
          f"{f', {workers} data-loader workers' if workers else ''}), {seconds - training:.0f}s "
          "building, final evaluation and this report\n"
          f"  checkpoints: {os.path.join(out, 'checkpoint-*')}/\n"
          f"  metrics:     {os.path.join(out, 'metrics.jsonl')}\n"
          f"  config:      {os.path.join(out, 'config.yaml')}\n"
          f"  report:      {_write_report(out)}\n"
          f"  next: vlmtrain eval --config {os.path.join(out, 'config.yaml')} --checkpoint {out}")  # (its data)
    return metrics


def _preference_report(trainer: Any, metrics: dict[str, Any], cfg: RunConfig) -> str:
    """A DPO demo's report: stage 1 (model.pretrained) beside the trained model's last checkpoint."""
    from vlmtrain.data.registry import get_source
    from vlmtrain.evaluation.preference_demo import report

    source = get_source(cfg.data.source)
    stage2 = resolve_checkpoint(cfg.train.output_dir, cfg.train.output_dir)
    return report(trainer, metrics, cfg.model.pretrained, stage2, source.chance() if source.chance else {})


def _grpo_report(metrics: dict[str, Any], cfg: RunConfig) -> str:
    """The GRPO demo's report: the SFT stage (model.pretrained) beside the trained model's last checkpoint, on
    data.num_eval held-out questions."""
    from vlmtrain.evaluation.grpo_demo import report
    from vlmtrain.tasks.shapes_pairs import ShapesPairs
    from vlmtrain.tasks.shapes_pairs_source import chance

    stage2 = resolve_checkpoint(cfg.train.output_dir, cfg.train.output_dir)
    held_out = ShapesPairs("val", cfg.data.num_eval, seed=cfg.data.seed)
    return report(metrics, cfg.model.pretrained, stage2, held_out, chance()["exact_match"])


def demo_console(cfg: RunConfig) -> Any:
    """What the demo prints while it trains: the progress bar and one line per evaluation, with the data
    source's summary and, for eval sets the training data has not asked yet (a warm-up), why they are at 0."""
    from vlmtrain.data.registry import get_source
    from vlmtrain.logging.console import EvalLinesCallback

    source = get_source(cfg.data.source)
    untrained = (lambda step: source.untrained(cfg.data, step)) if source.untrained is not None else None
    return EvalLinesCallback(summary=source.summary, untrained=untrained)


def demo_workers(configured: int | str, cuda: bool | None = None, cpus: int | None = None) -> int:
    """Data-loader workers for the demo: the config's number, except that a config with none (0 or 'auto') gets
    the ``'auto'`` rule (:func:`vlmtrain.trainer.setup.dataloader_workers`: 4 on a CUDA machine with 6+ cores).
    There the tiny model waits for its data: on one H100 (16 cores) the demo config ran 12-15 steps/s with 0
    workers (data wait 55-60% of the time) and 37.7 with 4 (1.6%). On a CPU machine workers take cores from the
    torch threads (on 2 cores, 4.6 vs 3.8-4.1 steps/s with 1 worker)."""
    import torch

    from vlmtrain.trainer.setup import dataloader_workers

    cuda = torch.cuda.is_available() if cuda is None else cuda
    return dataloader_workers("auto" if configured in (0, "auto") else configured, cuda=cuda, cpus=cpus)


def _write_report(run_dir: str) -> str:
    """RUN_DIR/report.html (vlmtrain report); a failure is logged, not raised: the run itself is done."""
    from vlmtrain.logging.report import write_report

    try:
        return write_report(run_dir)
    except (OSError, ValueError) as err:
        logger.warning("could not write the run report: %s", err)
        return f"n/a ({err})"


def _pick(metrics: dict[str, Any], *names: str) -> str:
    value = next((metrics[n] for n in names if n in metrics), None)
    return "n/a" if value is None else f"{value:.4f}"


def _examples(trainer: Any, n: int = 5) -> str:
    """A few held-out prompts with the model's generated answers."""
    if trainer.eval_dataset is None or not trainer.args.predict_with_generate:
        return "n/a"
    subset = [trainer.eval_dataset[i] for i in range(min(n, len(trainer.eval_dataset)))]
    texts = trainer.predict(subset).texts or []
    tok = trainer.processing_class
    prompts = [tok.decode(s["prompt_input_ids"], skip_special_tokens=True) for s in subset]
    return ", ".join(f"{p}{t}" for p, t in zip(prompts, texts))
