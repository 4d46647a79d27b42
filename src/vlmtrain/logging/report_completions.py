"""The run report's completions tables (GRPO's ``log_completions``): each logged step's sample of prompts, their
completions, rewards (the weighted one, then each reward function's) and advantages, as metrics.jsonl keeps them
under ``completions``; the newest steps first shown, the latest one open."""

from __future__ import annotations

import html
import math
from typing import Any

MAX_STEPS = 20
"""Logged steps shown (the newest): a long run logs many."""
TEXT = ("prompt", "completion")
"""The columns shown as text; the others (rewards, advantage) as numbers."""


def _text(value: Any) -> str:
    """A prompt or completion: a string, or chat messages (``role: content`` per message)."""
    if isinstance(value, list):
        value = "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, dict) else str(m)
                          for m in value)
    return html.escape("" if value is None else str(value))


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return "n/a"
    return f"{value:.4g}"


def completions_section(rows: list[dict[str, Any]], max_steps: int = MAX_STEPS) -> str:
    """The section's HTML ('' when no row has completions)."""
    logged = [r for r in rows if isinstance(r.get("completions"), list) and r["completions"]]
    if not logged:
        return ""
    shown = logged[-max_steps:]
    note = f" (the last {len(shown)} of {len(logged)} logged steps)" if len(shown) < len(logged) else ""
    parts = ["<h2>Completions</h2>", f'<p class="note">A sample of each logged step\'s rollouts{note}: '
             "prompt, completion, reward (then each reward function's) and advantage.</p>"]
    for row in reversed(shown):
        table = [c for c in row["completions"] if isinstance(c, dict)]
        columns = list(dict.fromkeys(k for c in table for k in c))  # (the logged order: TRL's table's)
        head = "".join(f"<th>{html.escape(str(k))}</th>" for k in columns)
        body = "".join("<tr>" + "".join(f"<td>{_text(c.get(k)) if k in TEXT else _number(c.get(k))}</td>"
                                        for k in columns) + "</tr>" for c in table)
        parts.append(f'<details class="step"{" open" if row is shown[-1] else ""}><summary>Completions at step '
                     f'{row.get("step")}</summary><div class="table-wrap"><table class="metrics completions">'
                     f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div></details>")
    return "\n".join(parts)
