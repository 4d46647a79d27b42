"""What the CLI runs: build a Trainer from a RunConfig, then train, evaluate, predict or run the demo.

Heavy modules (torch, transformers, the Trainer, data sources) are imported inside the functions, so a
bad config fails in the time it takes to read YAML.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from vlmtrain.config import ConfigError, RunConfig, load_run_config, save_run_config

DEMO_CONFIG = "addition-tiny.yaml"


def build(cfg: RunConfig, checkpoint: str | None = None) -> Any:
    """Build the data, the model (initialized under cfg.train.seed) and a Trainer; with checkpoint, the
    model weights are loaded from that checkpoint directory."""
    if cfg.model.kind == "causal_lm" and cfg.model.pretrained is None:
        from vlmtrain.models.causal_lm import check_model_type

        check_model_type(cfg.model.config)  # a bad model_type fails before any data is built
    if cfg.data.source == "addition":
        from vlmtrain.data.addition import build_addition

        data = build_addition(num_train=cfg.data.num_train, num_eval=cfg.data.num_eval,
                              num_digits=cfg.data.num_digits, seed=cfg.data.seed)
    else:  # unreachable through the parser (Literal); kept for Python users building RunConfig by hand
        raise ConfigError(f"data.source={cfg.data.source!r} is not supported; use 'addition'.")
    tokenizer = data["tokenizer"]

    if cfg.model.kind == "causal_lm":
        from vlmtrain.models.causal_lm import build_causal_lm

        model = build_causal_lm(config=cfg.model.config or None, pretrained=cfg.model.pretrained,
                                tokenizer=tokenizer, seed=cfg.train.seed)
    else:
        raise ConfigError(f"model.kind={cfg.model.kind!r} is not supported; use 'causal_lm'.")
    if checkpoint is not None:
        from vlmtrain.trainer.checkpoint import load_model_weights

        load_model_weights(model, checkpoint)

    from vlmtrain.trainer import Trainer

    return Trainer(model, cfg.train, data_collator=data["data_collator"], train_dataset=data["train_dataset"],
                   eval_dataset=data["eval_dataset"] if cfg.data.num_eval > 0 else None,
                   processing_class=tokenizer, compute_metrics=data["compute_metrics"])


def resume_arg(value: str | None) -> str | bool | None:
    """TrainingArguments.resume_from_checkpoint as Trainer.train takes it: 'true'/'latest' -> True."""
    if value is None or value.lower() in ("", "false", "none", "no"):
        return None
    return True if value.lower() in ("true", "latest", "yes") else value


def resolve_checkpoint(path: str, output_dir: str) -> str:
    """A checkpoint dir; 'latest' or a run dir (holding checkpoint-N/) means its newest complete checkpoint."""
    from vlmtrain.trainer.checkpoint import latest_checkpoint

    run_dir = output_dir if path == "latest" else path
    if not os.path.isdir(run_dir):
        raise ConfigError(f"checkpoint {path!r} does not exist (or is not a directory).")
    if os.path.isfile(os.path.join(run_dir, "model.safetensors")):
        return run_dir
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise ConfigError(f"{run_dir!r} holds neither model.safetensors nor a complete checkpoint-N/ directory.")
    return latest


def train(cfg: RunConfig) -> dict[str, Any]:
    """Train as configured (resuming if train.resume_from_checkpoint says so); return the final metrics,
    including a final evaluation when there is an eval set."""
    return _train(cfg)[1]


def _train(cfg: RunConfig) -> tuple[Any, dict[str, Any]]:
    trainer = build(cfg)
    save_run_config(cfg, cfg.train.output_dir)
    out = trainer.train(resume_from_checkpoint=resume_arg(cfg.train.resume_from_checkpoint))
    metrics = {"global_step": out.global_step, "training_loss": out.training_loss, **(out.metrics or {})}
    if getattr(trainer, "eval_dataset", None) is not None:
        # Reuse an evaluation the run already made at its last step rather than running it twice.
        last = [h for h in trainer.state.log_history if h.get("step") == out.global_step
                and any(k.startswith("eval_") and k.endswith("loss") for k in h)]
        metrics.update({k: v for h in last for k, v in h.items() if k.startswith("eval_")} if last
                       else trainer.evaluate())
    return trainer, metrics


def evaluate(cfg: RunConfig, checkpoint: str | None = None) -> dict[str, Any]:
    """Evaluate the configured model, or the weights of a checkpoint, on the eval set."""
    ckpt = resolve_checkpoint(checkpoint, cfg.train.output_dir) if checkpoint else None
    return build(cfg, checkpoint=ckpt).evaluate()


def predict(cfg: RunConfig, checkpoint: str) -> list[str]:
    """Generate answers for the eval set with a checkpoint's weights; return the decoded texts."""
    ckpt = resolve_checkpoint(checkpoint, cfg.train.output_dir)
    args = dataclasses.replace(cfg.train, predict_with_generate=True)  # predict means generate here
    trainer = build(dataclasses.replace(cfg, train=args), checkpoint=ckpt)
    if trainer.eval_dataset is None:
        raise ConfigError("predict needs an eval set: set data.num_eval > 0.")
    out = trainer.predict(trainer.eval_dataset)
    if out.texts is not None:
        return list(out.texts)
    ids = [[int(t) for t in row if t >= 0] for row in out.predictions]  # drop -100 padding
    return trainer.processing_class.batch_decode(ids, skip_special_tokens=True)


def find_demo_config() -> Path:
    """configs/addition-tiny.yaml of the repository (or of the current directory)."""
    candidates = [Path(__file__).resolve().parents[2] / "configs" / DEMO_CONFIG, Path.cwd() / "configs" / DEMO_CONFIG]
    for path in candidates:
        if path.is_file():
            return path
    raise ConfigError(f"cannot find configs/{DEMO_CONFIG} (looked in {', '.join(str(c.parent) for c in candidates)}).")


def _pick(metrics: dict[str, Any], *names: str) -> str:
    value = next((metrics[n] for n in names if n in metrics), None)
    return "n/a" if value is None else f"{value:.4f}"


def demo(output_dir: str | None = None) -> dict[str, Any]:
    """Train the tiny addition model of configs/addition-tiny.yaml on CPU and print where everything went."""
    cfg = load_run_config(find_demo_config(), {"train.output_dir": output_dir} if output_dir else None)
    start = time.perf_counter()
    trainer, metrics = _train(cfg)
    seconds = time.perf_counter() - start
    out = cfg.train.output_dir
    examples = _examples(trainer)
    exact, loss = _pick(metrics, "eval_exact_match", "exact_match"), _pick(metrics, "eval_loss")
    print(f"\nvlmtrain demo: {metrics.get('global_step')} steps in {seconds:.0f}s\n"
          f"  eval exact-match: {exact}   eval loss: {loss}\n"
          f"  checkpoints: {os.path.join(out, 'checkpoint-*')}/\n"
          f"  metrics:     {os.path.join(out, 'metrics.jsonl')}\n"
          f"  config:      {os.path.join(out, 'config.yaml')}\n"
          f"  held-out examples (Trainer.predict): {examples}\n"
          f"  next: vlmtrain predict --config {find_demo_config()} --checkpoint {out}")
    return metrics


def _examples(trainer: Any, n: int = 5) -> str:
    """A few held-out prompts with the model's generated answers."""
    if trainer.eval_dataset is None or not trainer.args.predict_with_generate:
        return "n/a"
    subset = [trainer.eval_dataset[i] for i in range(min(n, len(trainer.eval_dataset)))]
    texts = trainer.predict(subset).texts or []
    tok = trainer.processing_class
    prompts = [tok.decode(s["prompt_input_ids"], skip_special_tokens=True) for s in subset]
    return ", ".join(f"{p}{t}" for p, t in zip(prompts, texts))
