"""What the run report reads from a run dir, shared by the page (report.py) and its gallery (report_gallery.py):
JSONL rows and the names of the per-step eval sample files."""

from __future__ import annotations

import json
import re
from typing import Any

SAMPLES_FILE = re.compile(r"^eval_samples_step_(\d+)\.jsonl$")
"""The name of evaluation's per-step sample file (vlmtrain.logging.eval_samples); group 1 is the step."""


def read_jsonl(path: str) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a JSONL file, and how many non-blank lines were not one (skipped)."""
    rows, bad = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
                rows.append(row)
            else:
                bad += 1
    return rows, bad
