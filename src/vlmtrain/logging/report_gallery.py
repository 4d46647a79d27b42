"""The run report's gallery: per evaluated step, cards of held-out samples (thumbnails, question, generated
answer or head predictions, truth, right/wrong) from RUN_DIR/eval_samples_step_N.jsonl.

Each step shows at most ``max_cards`` cards, split over the eval sets, half of them wrong answers (what one
looks at) where there are enough. Thumbnails are embedded once (a CSS class per image) however many cards show them.
"""

from __future__ import annotations

import base64
import html
import os
from collections import defaultdict
from typing import Any

from .report_files import SAMPLES_FILE, read_jsonl

_MIME = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg"}


class Thumbnails:
    """Image files under the run dir -> CSS class names; each distinct image embedded once as a data: URI."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.classes: dict[str, str | None] = {}
        self.by_content: dict[str, str] = {}
        self.styles: list[str] = []

    def class_of(self, ref: str) -> str | None:
        if ref not in self.classes:
            from .report_html import thumbnail_style

            path = os.path.normpath(os.path.join(self.run_dir, ref))
            mime = _MIME.get(os.path.splitext(path)[1].lower())
            if mime is None or not os.path.isfile(path):
                self.classes[ref] = None
            else:
                with open(path, "rb") as f:
                    uri = f"data:{mime};base64,{base64.b64encode(f.read()).decode('ascii')}"
                if uri not in self.by_content:  # (the same image in several samples, e.g. a shared scene)
                    self.by_content[uri] = name = f"img{len(self.styles)}"
                    self.styles.append(thumbnail_style(name, uri))
                self.classes[ref] = self.by_content[uri]
        return self.classes[ref]


def sample_files(run_dir: str) -> dict[int, str]:
    """step -> path of each eval_samples_step_N.jsonl in the run dir."""
    found = {}
    for name in os.listdir(run_dir):
        match = SAMPLES_FILE.match(name)
        if match:
            found[int(match.group(1))] = os.path.join(run_dir, name)
    return found


def pick_cards(rows: list[dict[str, Any]], max_cards: int) -> list[dict[str, Any]]:
    """Up to ``max_cards`` rows, the same share for each eval set: half of it wrong answers (the first ones),
    the rest right or unscored ones (more wrong ones when those run short); shown in (set, index) order."""
    by_set: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_set[row.get("set")].append(row)
    share = max(1, max_cards // max(len(by_set), 1))
    picked = []
    for members in by_set.values():
        wrong = [r for r in members if r.get("correct") is False]
        others = [r for r in members if r.get("correct") is not False]
        first = wrong[:max((share + 1) // 2, share - len(others))]
        picked += first + others[:share - len(first)]
    return sorted(picked, key=lambda r: (str(r.get("set") or ""), r.get("index", 0)))


def _text(value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.4g}"
    if value is None or value == "":
        return "<i>none</i>" if value is None else "<i>empty</i>"
    return html.escape(str(value))


def card(row: dict[str, Any], thumbs: Thumbnails) -> str:
    """One sample: thumbnails, question, the model's answer (or head predictions), truth, verdict."""
    correct = row.get("correct")
    kind = "right" if correct is True else "wrong" if correct is False else "unscored"
    images = []
    for ref in row.get("images") or []:
        name = thumbs.class_of(str(ref))
        images.append(f'<span class="thumb {name}" role="img" aria-label="image"></span>' if name else
                      '<span class="thumb missing">missing</span>')
    if not images and row.get("num_images"):
        images = [f'<span class="thumb missing">{row["num_images"]} image(s), no thumbnail</span>']
    lines = [f'<div class="thumbs">{"".join(images)}</div>']
    where = " · ".join(str(p) for p in (row.get("set"), f"#{row.get('index')}", row.get("id")) if p is not None)
    lines.append(f'<div class="set">{html.escape(where)}</div>')
    lines.append(f'<div class="q">{_text(row.get("question"))}</div>')
    if "heads" in row:
        for name, head in (row.get("heads") or {}).items():
            mark = "" if "correct" not in head else " ✓" if head["correct"] else " ✗"
            lines.append(f"<div>{html.escape(name)}: <b>{_text(head.get('predicted'))}</b> "
                         f"(truth {_text(head.get('truth'))}){mark}</div>")
    else:
        lines.append(f"<div>answer: <b>{_text(row.get('generated'))}</b></div>")
        lines.append(f"<div>truth: {_text(row.get('truth'))}</div>")
    verdict = {"right": "✓ right", "wrong": "✗ wrong", "unscored": "not scored"}[kind]
    lines.append(f'<div class="verdict">{verdict}</div>')
    return f'<div class="card {kind}">{"".join(lines)}</div>'


def _scores(rows: list[dict[str, Any]]) -> str:
    """'412/500 right (82.4%); color 90/100, ...' over the scored rows."""
    scored = [r for r in rows if isinstance(r.get("correct"), bool)]
    if not scored:
        return f"{len(rows)} samples (not scored)"
    right = sum(r["correct"] for r in scored)
    text = f"{right}/{len(scored)} right ({100 * right / len(scored):.1f}%)"
    sets = sorted({r.get("set") for r in scored if r.get("set") is not None})
    if len(sets) > 1:
        text += "; " + ", ".join(f"{s} {sum(r['correct'] for r in scored if r.get('set') == s)}/"
                                 f"{sum(r.get('set') == s for r in scored)}" for s in sets)
    return text


def gallery(run_dir: str, max_cards: int) -> tuple[str, list[str], list[str]]:
    """(the gallery's HTML, the thumbnails' CSS rules, warnings about skipped lines), newest step first and
    open, earlier steps folded."""
    files = sample_files(run_dir)
    if not files:
        return ('<p class="note">No eval_samples_step_N.jsonl in the run dir: evaluation during training writes '
                "them when it keeps predictions (predict_with_generate, or score heads).</p>", [], [])
    thumbs, sections, warnings = Thumbnails(run_dir), [], []
    for i, step in enumerate(sorted(files, reverse=True)):
        rows, bad = read_jsonl(files[step])
        if bad:
            warnings.append(f"{os.path.basename(files[step])}: {bad} line(s) were not JSON rows and were skipped.")
        shown = pick_cards(rows, max_cards)
        note = (f"showing {len(shown)} of {len(rows)} samples (up to {max_cards} per step, half of them wrong answers)"
                if len(shown) < len(rows) else f"all {len(rows)} samples")
        cards = "".join(card(row, thumbs) for row in shown)
        sections.append(f'<details class="step"{" open" if i == 0 else ""}><summary>step {step}: '
                        f'{html.escape(_scores(rows))}</summary><p class="note">{note}</p>'
                        f'<div class="cards">{cards}</div></details>')
    toggle = ('<input type="checkbox" id="wrong-only"> <label class="filter" for="wrong-only">show wrong answers '
              'only</label>')
    return f'{toggle}<div class="galleries">{"".join(sections)}</div>', thumbs.styles, warnings
