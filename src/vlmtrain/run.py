"""What the CLI runs: build a Trainer from a RunConfig, then train, evaluate, predict or run the demo.

Heavy modules (torch, transformers, the Trainer, data sources) are imported inside the functions, so a
bad config fails in the time it takes to read YAML.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlmtrain.config import ConfigError, RunConfig, load_run_config, save_run_config

DEMO_CONFIG = "shapes-tiny.yaml"
logger = logging.getLogger(__name__)


def build(cfg: RunConfig, checkpoint: str | None = None) -> Any:
    """Build the data, the model (initialized under cfg.train.seed) and a Trainer; with checkpoint, the
    model weights are loaded from that checkpoint directory."""
    parts = _build_addition(cfg) if cfg.model.kind == "causal_lm" else _build_vqa(cfg, checkpoint)
    if cfg.data.pack_window and getattr(parts["data_collator"], "pack_length", None):
        _window_packing(cfg, parts)
    if checkpoint is not None:
        from vlmtrain.trainer.checkpoint import load_model_weights

        load_model_weights(parts["model"], checkpoint)

    from vlmtrain.trainer import DatasetStepCallback, Trainer

    step_keyed = hasattr(parts["train_dataset"], "set_step")  # e.g. shapes' side warm-up
    return Trainer(parts["model"], cfg.train, data_collator=parts["data_collator"],
                   train_dataset=parts["train_dataset"],
                   eval_dataset=parts["eval_dataset"] if cfg.data.num_eval > 0 else None,
                   processing_class=parts["tokenizer"], compute_metrics=parts["compute_metrics"],
                   callbacks=[DatasetStepCallback()] if step_keyed else None)


def _build_addition(cfg: RunConfig) -> dict[str, Any]:
    from vlmtrain.data.addition import build_addition
    from vlmtrain.data.packing import PackingCollator
    from vlmtrain.models.causal_lm import build_causal_lm, check_model_type

    if cfg.model.pretrained is None:
        check_model_type(cfg.model.config)  # a bad model_type fails before any data is built
    parts = build_addition(num_train=cfg.data.num_train, num_eval=cfg.data.num_eval,
                           num_digits=cfg.data.num_digits, seed=cfg.data.seed)
    parts["model"] = build_causal_lm(config=cfg.model.config or None, pretrained=cfg.model.pretrained,
                                     tokenizer=parts["tokenizer"], seed=cfg.train.seed)
    padded, pad_id = parts["data_collator"], parts["tokenizer"].pad_token_id
    parts["data_collator"] = _collator(cfg, parts["model"], len(parts["tokenizer"]), padded,
                                       lambda n: PackingCollator(n, pad_id, padding_collator=padded))
    parts.update(padded_collator=padded, process=_tokenized)
    return parts


def _tokenized(sample: dict[str, Any]) -> dict[str, Any]:
    return sample  # addition samples come tokenized (a module-level function: it goes to DataLoader workers)


def _build_vqa(cfg: RunConfig, checkpoint: str | None = None) -> dict[str, Any]:
    """A VLM on shapes-VQA or the_cauldron JSONL: tokenizer, model, processor, collator, exact-match metric.
    Shapes evaluation is one eval set per question type (eval_<type>_exact_match). With a checkpoint, its
    saved tokenizer is used (the one the weights were trained with)."""
    import torch

    from vlmtrain.data.addition import exact_match_metric
    from vlmtrain.data.processing import VLMProcessor, build_chat_tokenizer
    from vlmtrain.data.vlm_collate import VLMCollator
    from vlmtrain.models.build import build_vlm, resolve_config

    m, d = cfg.model, cfg.data
    for key, spec, causal in (("model.vision", m.vision, False), ("model.text", m.text, True)):
        if isinstance(spec, dict):
            resolve_config(spec, key, causal)  # unknown model types fail before any data is built
    train, evals = _vqa_datasets(cfg)
    saved = checkpoint if checkpoint and os.path.isfile(os.path.join(checkpoint, "tokenizer_config.json")) else None
    if m.tokenizer is not None or saved:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(saved or m.tokenizer)
    else:
        first = itertools.islice(iter(train), 2000)  # (a stream has no len: its first samples)
        texts = [v for sample in first for t in (sample.get("texts") or [])
                 if isinstance(t, dict) for v in t.values() if isinstance(v, str)]
        tokenizer = build_chat_tokenizer(texts, vocab_size=d.tokenizer_vocab_size)
    torch.manual_seed(cfg.train.seed)
    model = build_vlm(m.vision, m.text, pixel_shuffle_factor=m.pixel_shuffle_factor,
                      projector_type=m.projector_type, tokenizer=tokenizer, load_backbone=m.load_backbone,
                      vision_position_scale=m.vision_position_scale)
    processor = VLMProcessor(tokenizer, image_size=model.config.image_size,
                             image_token_length=model.config.image_token_length, max_length=d.max_length,
                             max_images=d.max_images, split_large_images=d.split_large_images,
                             mean=d.image_mean, std=d.image_std)
    # Saved with the weights (config.json), so `vlmtrain generate` preprocesses images as training did.
    model.config.preprocessing = {"image_mean": list(d.image_mean), "image_std": list(d.image_std),
                                  "split_large_images": d.split_large_images}
    padded = VLMCollator(processor)
    return {"model": model, "tokenizer": tokenizer, "train_dataset": train, "eval_dataset": evals,
            "data_collator": _collator(cfg, model, len(tokenizer), padded,
                                       lambda n: VLMCollator(processor, n, d.max_images_per_pack)),
            "compute_metrics": exact_match_metric(tokenizer), "padded_collator": padded,
            "process": processor.process}


def _window_packing(cfg: RunConfig, parts: dict[str, Any]) -> None:
    """data.pack_window: train on rows packed from windows of consecutive samples (PackedDataset)."""
    from vlmtrain.data.pack_stream import PackedDataset, RowCollator
    from vlmtrain.data.sources import IndexedSource, StreamingDataset

    d, train = cfg.data, parts["train_dataset"]
    if not isinstance(train, StreamingDataset):  # map-style: the same samples as a stream of shuffled blocks
        train = StreamingDataset([IndexedSource(train, name=d.source)], seed=d.seed)
    pack_length = parts["data_collator"].pack_length
    parts["train_dataset"] = PackedDataset(train, parts["process"], pack_length,
                                           parts["tokenizer"].pad_token_id, window=d.pack_window,
                                           max_images_per_pack=d.max_images_per_pack)
    parts["data_collator"] = RowCollator(parts["padded_collator"])


def _collator(cfg: RunConfig, model: Any, vocab_size: int, padded: Any, packed: Callable[[int], Any]) -> Any:
    """The packing collator (``packed(pack_length)``) if data.packing allows it and the model passes
    :func:`check_packing`, else the padding one."""
    from vlmtrain.data.packing import check_packing

    d = cfg.data
    if d.packing is False:
        return padded
    error = check_packing(model, vocab_size)
    if error > 1e-4:
        message = (f"{type(model).__name__} does not keep packed samples apart (logits differ by {error:.2g} "
                   f"from unpacked runs): its attention ignores restarting position_ids.")
        if d.packing:
            raise ConfigError(f"data.packing=true but {message} Set data.packing: false.")
        logger.warning("%s Training with padding instead of packing.", message)
        return padded
    return packed(d.pack_length or (d.max_length if cfg.model.kind == "vlm" else 64))


def _vqa_datasets(cfg: RunConfig) -> tuple[Any, Any]:
    d = cfg.data
    if d.source == "shapes":
        from vlmtrain.data.synthetic import QTYPES, ShapesVQA

        train = ShapesVQA("train", d.num_train, seed=d.seed, multi_image_fraction=d.multi_image_fraction,
                          questions_per_sample=d.questions_per_sample, side_fraction=d.side_fraction,
                          side_warmup_steps=d.side_warmup_steps)
        evals = {q: ShapesVQA("val", d.num_eval, seed=d.seed, qtypes=[q]) for q in QTYPES}
        return train, evals
    from vlmtrain.data.cauldron import read_cauldron_jsonl
    from vlmtrain.data.sources import apply_filters
    from vlmtrain.data.streams import build_stream, config_filters

    try:
        filters = config_filters(d.min_ratings, d.filter)
        evals = read_cauldron_jsonl(d.eval_file, load_images=False) if d.eval_file else None
        if d.source == "stream":
            return build_stream(d.sources or [], seed=d.seed, filters=filters), evals
    except ValueError as err:
        raise ConfigError(str(err)) from None
    # Images stay paths: the processor opens them, skipping (and counting) missing or corrupt ones.
    train = read_cauldron_jsonl(d.train_file, load_images=False)
    kept = [s for s, reason in (apply_filters(filters, s) for s in train) if reason is None]
    if len(kept) < len(train):
        logger.warning("data filters dropped %d of %d training samples", len(train) - len(kept), len(train))
    return kept, evals


def resume_arg(value: str | None) -> str | bool | None:
    """TrainingArguments.resume_from_checkpoint as Trainer.train takes it: 'true'/'latest' -> True."""
    if value is None or value.lower() in ("", "false", "none", "no"):
        return None
    return True if value.lower() in ("true", "latest", "yes") else value


def resolve_checkpoint(path: str, output_dir: str) -> str:
    """A checkpoint dir; 'latest' or a run dir (holding checkpoint-N/) means its newest complete checkpoint."""
    from vlmtrain.trainer.checkpoint import latest_checkpoint
    from vlmtrain.trainer.fsdp import has_sharded_weights

    run_dir = output_dir if path == "latest" else path
    if not os.path.isdir(run_dir):
        raise ConfigError(f"checkpoint {path!r} does not exist (or is not a directory).")
    if os.path.isfile(os.path.join(run_dir, "model.safetensors")) or has_sharded_weights(run_dir):
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
    if trainer.rank == 0:
        save_run_config(cfg, cfg.train.output_dir)
    out = trainer.train(resume_from_checkpoint=resume_arg(cfg.train.resume_from_checkpoint))
    metrics = {"global_step": out.global_step, "training_loss": out.training_loss, **(out.metrics or {})}
    if trainer.preempted:  # no time for a final evaluation: the checkpoint is what matters
        metrics["preempted"] = True
        logger.warning("preempted at step %d; checkpoint saved in %s. Resubmit with "
                       "--train.resume_from_checkpoint true to continue.", out.global_step, cfg.train.output_dir)
        return trainer, metrics
    if getattr(trainer, "eval_dataset", None) is not None:
        # Reuse an evaluation the run already made at its last step rather than running it twice.
        last = [h for h in trainer.state.log_history if h.get("step") == out.global_step
                and any(k.startswith("eval_") and k.endswith("loss") for k in h)]
        metrics.update({k: v for h in last for k, v in h.items() if k.startswith("eval_")} if last
                       else trainer.evaluate())
    if cfg.data.source == "shapes":
        metrics.update(shapes_summary(metrics))
    return trainer, metrics


def evaluate(cfg: RunConfig, checkpoint: str | None = None) -> dict[str, Any]:
    """Evaluate the configured model, or the weights of a checkpoint, on the eval set."""
    ckpt = resolve_checkpoint(checkpoint, cfg.train.output_dir) if checkpoint else None
    metrics = build(cfg, checkpoint=ckpt).evaluate()
    return {**metrics, **shapes_summary(metrics)} if cfg.data.source == "shapes" else metrics


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


def generate(checkpoint: str, prompt: str, images: list[str] | None = None, max_new_tokens: int = 32) -> str:
    """Answer one prompt (with images, for a VLM) from a trained checkpoint, greedily."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = resolve_checkpoint(checkpoint, checkpoint)
    if not os.path.isfile(os.path.join(ckpt, "model.safetensors")):
        raise ConfigError(f"{ckpt} holds FSDP shards: run `vlmtrain export --checkpoint {ckpt}` first.")
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    with open(os.path.join(ckpt, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    if model_type == "vlmtrain_vlm":
        from vlmtrain.data.processing import SkipSample, VLMProcessor
        from vlmtrain.models.vlm import VisionLanguageModel

        model = VisionLanguageModel.from_pretrained(ckpt)
        processor = VLMProcessor.for_checkpoint(tokenizer, model.config, max_images=len(images or []))
        try:  # the template needs an answer to build the sample; generation starts before it
            sample = processor.process({"images": list(images or []), "texts": [{"user": prompt, "assistant": "-"}]})
        except SkipSample as e:
            raise ConfigError(f"cannot use this input: {e.reason} ({e})") from None
        inputs = {"input_ids": sample["prompt_input_ids"][None], "pixel_values": sample["pixel_values"]}
    else:
        if images:
            raise ConfigError(f"{ckpt} holds a text-only model: --image cannot be used with it.")
        model = AutoModelForCausalLM.from_pretrained(ckpt)
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        if tokenizer.bos_token_id is not None:
            ids = torch.cat([torch.tensor([[tokenizer.bos_token_id]]), ids], dim=1)
        inputs = {"input_ids": ids}
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    model.eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def find_demo_config(name: str = DEMO_CONFIG) -> Path:
    """configs/<name> of the repository (or of the current directory)."""
    candidates = [Path(__file__).resolve().parents[2] / "configs" / name, Path.cwd() / "configs" / name]
    for path in candidates:
        if path.is_file():
            return path
    raise ConfigError(f"cannot find configs/{name} (looked in {', '.join(str(c.parent) for c in candidates)}).")


def shapes_summary(metrics: dict[str, Any], prefix: str = "eval") -> dict[str, float]:
    """Single- and multi-image exact match of a shapes-VQA evaluation: the mean over the question types of
    each group (every type has the same number of eval samples)."""
    from vlmtrain.data.synthetic import MULTI_IMAGE_QTYPES, SINGLE_IMAGE_QTYPES

    out = {}
    for group, qtypes in (("single_image", SINGLE_IMAGE_QTYPES), ("multi_image", MULTI_IMAGE_QTYPES)):
        values = [metrics.get(f"{prefix}_{q}_exact_match") for q in qtypes]
        if all(v is not None for v in values):
            out[f"{prefix}_{group}_exact_match"] = sum(values) / len(values)
    return out


def demo(output_dir: str | None = None, config: str | None = None) -> dict[str, Any]:
    """Train the demo config (configs/shapes-tiny.yaml unless ``config`` names another) on CPU and print
    the results (per question type and against blank images for shapes-VQA) and where everything went."""
    path = Path(config) if config else find_demo_config()
    if not path.is_file():
        raise ConfigError(f"demo config {str(path)!r} does not exist.")
    cfg = load_run_config(path, {"train.output_dir": output_dir} if output_dir else None)
    start = time.perf_counter()
    trainer, metrics = _train(cfg)
    seconds = time.perf_counter() - start
    out = cfg.train.output_dir
    if cfg.model.kind == "vlm" and cfg.data.source == "shapes":
        blank = _blank_image_metrics(trainer)
        metrics.update(blank)
        report = _shapes_table(metrics, blank) + "\n" + _shapes_examples(trainer)
    else:
        exact, loss = _pick(metrics, "eval_exact_match", "exact_match"), _pick(metrics, "eval_loss")
        report = (f"  eval exact-match: {exact}   eval loss: {loss}\n"
                  f"  held-out examples (Trainer.predict): {_examples(trainer)}")
    print(f"\nvlmtrain demo ({path.name}): {metrics.get('global_step')} steps, {seconds:.0f}s in all\n"
          f"{report}\n"
          f"  checkpoints: {os.path.join(out, 'checkpoint-*')}/\n"
          f"  metrics:     {os.path.join(out, 'metrics.jsonl')}\n"
          f"  config:      {os.path.join(out, 'config.yaml')}\n"
          f"  next: vlmtrain eval --config {path} --checkpoint {out}")
    return metrics


def _pick(metrics: dict[str, Any], *names: str) -> str:
    value = next((metrics[n] for n in names if n in metrics), None)
    return "n/a" if value is None else f"{value:.4f}"


def _blank_image_metrics(trainer: Any) -> dict[str, float]:
    """Exact match on the same eval questions with empty images (keys blank_<type>_exact_match, ...)."""
    from vlmtrain.data.synthetic import BlankImages

    metrics = trainer.evaluate({q: BlankImages(ds) for q, ds in trainer.eval_dataset.items()},
                               metric_key_prefix="blank")
    return {**metrics, **shapes_summary(metrics, "blank")}


def _shapes_table(metrics: dict[str, Any], blank: dict[str, Any]) -> str:
    from vlmtrain.data.synthetic import CHANCE, MULTI_IMAGE_QTYPES, QTYPES, SINGLE_IMAGE_QTYPES

    def row(name: str, key: str, chance: float) -> str:
        return (f"  {name:<22}{metrics.get(f'eval_{key}_exact_match', float('nan')):>8.3f}"
                f"{blank.get(f'blank_{key}_exact_match', float('nan')):>14.3f}{chance:>8.3f}")

    rows = [f"  {'held-out exact match':<22}{'model':>8}{'blank images':>14}{'chance':>8}"]
    for group, qtypes in (("single_image", SINGLE_IMAGE_QTYPES), ("multi_image", MULTI_IMAGE_QTYPES)):
        rows += [row(q, q, CHANCE[q]) for q in qtypes]
        rows.append(row(group.replace("_", "-") + " (mean)", group, sum(CHANCE[q] for q in qtypes) / len(qtypes)))
    rows += [row(f"{q} (not in a mean)", q, CHANCE[q]) for q in QTYPES
             if q not in SINGLE_IMAGE_QTYPES + MULTI_IMAGE_QTYPES and f"eval_{q}_exact_match" in metrics]
    return "\n".join(rows)


def _shapes_examples(trainer: Any) -> str:
    """One held-out question per type with the model's generated answer and the truth."""
    names = list(trainer.eval_dataset)
    samples = [trainer.eval_dataset[q][0] for q in names]
    texts = trainer.predict(samples).texts or [""] * len(samples)
    lines = ["  held-out examples (Trainer.predict):"]
    for q, sample, answer in zip(names, samples, texts):
        turn = sample["texts"][-1]
        lines.append(f"    [{q}] {turn['user']} -> {answer!r} (truth {turn['assistant']!r})")
    return "\n".join(lines)


def _examples(trainer: Any, n: int = 5) -> str:
    """A few held-out prompts with the model's generated answers."""
    if trainer.eval_dataset is None or not trainer.args.predict_with_generate:
        return "n/a"
    subset = [trainer.eval_dataset[i] for i in range(min(n, len(trainer.eval_dataset)))]
    texts = trainer.predict(subset).texts or []
    tok = trainer.processing_class
    prompts = [tok.decode(s["prompt_input_ids"], skip_special_tokens=True) for s in subset]
    return ", ".join(f"{p}{t}" for p, t in zip(prompts, texts))
