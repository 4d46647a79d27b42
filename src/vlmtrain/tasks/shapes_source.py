"""data.source: shapes — synthetic shapes-VQA (one or two rendered images per question), with the demo's
per-question-type evaluation, its single/multi-image summary and its report against blank images."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlmtrain.data.registry import DataSource
from vlmtrain.errors import ConfigError


@dataclass
class ShapesOptions:
    """The shapes task's own `data.*` keys."""

    multi_image_fraction: float = 0.25
    """(shapes) Fraction of training questions about two images."""
    questions_per_sample: int = 1
    """(shapes) Training samples ask up to this many questions about their image(s), as one multi-turn
    conversation (evaluation stays one question per sample)."""
    side_fraction: float = 0.0
    """(shapes) Fraction of position questions asked as absolute side questions ("Is the circle left or
    right?"); extra turns then draw from side questions too. A stepping stone to relative position."""
    side_warmup_steps: int = 0
    """(shapes) For this many first training steps every position question is a side question (the training
    sampler gives each sample the step it feeds, so data-loader workers and resumes see the same questions)."""
    lookup_warmup_steps: int = 0
    """(shapes) For this many first training steps only look-up questions are asked (colour, shape,
    position/side, multi_color, multi_count), colour and shape ones about 2-4 objects: no answer without
    finding the named object(s). Follows the step as side_warmup_steps does."""
    qtype_weights: dict[str, float] | None = None
    """(shapes) Relative weights of question types within their group (single or multi image) when a training
    question's type is drawn, e.g. {multi_count: 2}; types not named weigh 1."""


def check_options(data: Any) -> None:
    for name, low in (("questions_per_sample", 1), ("side_warmup_steps", 0), ("lookup_warmup_steps", 0)):
        if getattr(data, name) < low:
            raise ConfigError(f"data.{name} must be >= {low}, got {getattr(data, name)}.")
    for name in ("multi_image_fraction", "side_fraction"):
        if not 0 <= getattr(data, name) <= 1:
            raise ConfigError(f"data.{name} must be in [0, 1], got {getattr(data, name)}.")
    from vlmtrain.tasks.shapes import QTYPES, bad_qtype_weights

    bad = bad_qtype_weights(data.qtype_weights)
    if bad:
        raise ConfigError(f"data.qtype_weights must map question types {list(QTYPES)} to weights > 0, got {bad}.")


def check(cfg: Any) -> None:
    for name in ("side_warmup_steps", "lookup_warmup_steps"):
        if getattr(cfg.data, name) and cfg.data.pack_window:
            raise ConfigError(f"data.{name} needs data.pack_window: null (the warm-up follows the training "
                              "step, which the sampler gives each sample; packing windows streams them instead).")


def build(cfg: Any) -> dict[str, Any]:
    """Training questions, and one eval set per question type (eval_<type>_exact_match)."""
    from vlmtrain.tasks.shapes import QTYPES, ShapesVQA

    d = cfg.data
    train = ShapesVQA("train", d.num_train, seed=d.seed, multi_image_fraction=d.multi_image_fraction,
                      questions_per_sample=d.questions_per_sample, side_fraction=d.side_fraction,
                      side_warmup_steps=d.side_warmup_steps, lookup_warmup_steps=d.lookup_warmup_steps,
                      qtype_weights=d.qtype_weights)
    evals = {q: ShapesVQA("val", d.num_eval, seed=d.seed, qtypes=[q]) for q in QTYPES}
    return {"train_dataset": train, "eval_dataset": evals}


def summary(metrics: dict[str, Any], prefix: str = "eval") -> dict[str, float]:
    """Single- and multi-image exact match of a shapes-VQA evaluation: the mean over the question types of
    each group (every type has the same number of eval samples)."""
    from vlmtrain.tasks.shapes import MULTI_IMAGE_QTYPES, SINGLE_IMAGE_QTYPES

    out = {}
    for group, qtypes in (("single_image", SINGLE_IMAGE_QTYPES), ("multi_image", MULTI_IMAGE_QTYPES)):
        values = [metrics.get(f"{prefix}_{q}_exact_match") for q in qtypes]
        if all(v is not None for v in values):
            out[f"{prefix}_{group}_exact_match"] = sum(values) / len(values)
    return out


def untrained(data: Any, step: int) -> dict[str, str]:
    """The question types that the training questions of steps 0 to step - 1 never asked, each with the
    `data.*` key that says so (an evaluation then scores them near 0: by design, not a failure)."""
    from vlmtrain.tasks.shapes import LOOKUP_QTYPES, MULTI_IMAGE_QTYPES, QTYPES, ShapesVQA

    train = ShapesVQA("train", 1, seed=data.seed, multi_image_fraction=data.multi_image_fraction,
                      questions_per_sample=data.questions_per_sample, side_fraction=data.side_fraction,
                      side_warmup_steps=data.side_warmup_steps, lookup_warmup_steps=data.lookup_warmup_steps,
                      qtype_weights=data.qtype_weights)
    asked, why = train.qtypes_asked_before(step), {}
    for q in (q for q in QTYPES if q not in asked and step > 0):
        if q not in LOOKUP_QTYPES and step <= data.lookup_warmup_steps:
            why[q] = f"data.lookup_warmup_steps: {data.lookup_warmup_steps} asks look-up questions only until then"
        elif q in MULTI_IMAGE_QTYPES and data.multi_image_fraction <= 0:
            why[q] = "data.multi_image_fraction: 0 asks no two-image questions"
        elif q not in MULTI_IMAGE_QTYPES and data.multi_image_fraction >= 1:
            why[q] = "data.multi_image_fraction: 1 asks only two-image questions"
        elif q == "side":
            why[q] = "data.side_fraction: 0 asks no side questions"
        else:
            why[q] = "the training questions do not include this type"
    return why


def chance() -> dict[str, float]:
    """Exact match of random answers, per question type, for the single-/multi-image means and for all eval
    sets together."""
    from vlmtrain.tasks.shapes import CHANCE, MULTI_IMAGE_QTYPES, SINGLE_IMAGE_QTYPES

    out = {f"{q}_exact_match": p for q, p in CHANCE.items()}
    out["exact_match"] = sum(CHANCE.values()) / len(CHANCE)  # one eval set of data.num_eval per type
    for group, qtypes in (("single_image", SINGLE_IMAGE_QTYPES), ("multi_image", MULTI_IMAGE_QTYPES)):
        out[f"{group}_exact_match"] = sum(CHANCE[q] for q in qtypes) / len(qtypes)
    return out


def demo_report(trainer: Any, metrics: dict[str, Any]) -> str:
    """Per-type exact match next to blank images and chance (blank_* keys are added to metrics), then a few
    held-out questions per type, right and wrong ones, with the model's answer and the truth."""
    if not isinstance(trainer.eval_dataset, dict):
        return ""
    blank = _blank_image_metrics(trainer)
    metrics.update(blank)
    return _table(metrics, blank) + "\n" + _examples(trainer)


def _blank_image_metrics(trainer: Any) -> dict[str, float]:
    """Exact match on the same eval questions with empty images (keys blank_<type>_exact_match, ...)."""
    from vlmtrain.tasks.shapes import BlankImages

    metrics = trainer.evaluate({q: BlankImages(ds) for q, ds in trainer.eval_dataset.items()},
                               metric_key_prefix="blank")
    return {**metrics, **summary(metrics, "blank")}


def _table(metrics: dict[str, Any], blank: dict[str, Any]) -> str:
    from vlmtrain.tasks.shapes import CHANCE, MULTI_IMAGE_QTYPES, QTYPES, SINGLE_IMAGE_QTYPES

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


def _examples(trainer: Any, per_kind: int = 2, pool: int = 12) -> str:
    """Up to ``per_kind`` right and ``per_kind`` wrong answers per question type, from the first ``pool``
    held-out questions of each type (one Trainer.predict call): question, the model's answer, the truth."""
    names = list(trainer.eval_dataset)
    samples = {q: [trainer.eval_dataset[q][i] for i in range(min(pool, len(trainer.eval_dataset[q])))]
               for q in names}
    flat = [s for q in names for s in samples[q]]
    texts = iter(trainer.predict(flat).texts or [""] * len(flat))
    lines = ["  held-out examples (question -> the model's answer; truth when wrong):"]
    for q in names:
        right: list[str] = []
        wrong: list[str] = []
        for sample in samples[q]:
            answer, turn = next(texts).strip(), sample["texts"][-1]
            if answer == turn["assistant"]:
                right.append(f"    [{q}] right: {turn['user']} -> {answer!r}")
            else:
                wrong.append(f"    [{q}] wrong: {turn['user']} -> {answer!r} (truth {turn['assistant']!r})")
        lines += right[:per_kind] + wrong[:per_kind]
    return "\n".join(lines)


def stream_source(spec: dict[str, Any], seed: int = 0) -> Any:
    """A ``data.sources`` entry of kind shapes: ``num_samples`` training questions (``seed``,
    ``multi_image_fraction``, ``questions_per_sample``, ``name``) as one indexed source of the stream."""
    from vlmtrain.data.sources import IndexedSource
    from vlmtrain.tasks.shapes import ShapesVQA

    data = ShapesVQA("train", int(spec.get("num_samples", 10000)), seed=int(spec.get("seed", seed)),
                     multi_image_fraction=float(spec.get("multi_image_fraction", 0.25)),
                     questions_per_sample=int(spec.get("questions_per_sample", 1)))
    return IndexedSource(data, name=spec.get("name", "shapes"))


def command_line_source(spec: str) -> Any:
    """``shapes[:N]`` for ``vlmtrain data to-wds`` / ``inspect``: N (default 1000) training questions."""
    from vlmtrain.data.sources import IndexedSource
    from vlmtrain.tasks.shapes import ShapesVQA

    n = int(spec.split(":", 1)[1]) if ":" in spec else 1000
    return IndexedSource(ShapesVQA("train", n, multi_image_fraction=0.4), name="shapes")


SOURCE = DataSource("shapes", kinds=("vlm", "hub_vlm"), build=build, options=ShapesOptions,
                    check_options=check_options, check=check, summary=summary, demo_report=demo_report,
                    untrained=untrained, chance=chance)
