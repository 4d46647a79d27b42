"""GRPO's completions table (``log_completions``), as TRL 1.16's GRPOTrainer gathers it: the last generation
batch's rows of every process, rank 0's first (TRL's ``gather_object`` order), each with its prompt, completion,
each reward function's reward (a column per function, under its name, as TRL's table), the weighted reward and
the advantage; ``num_completions_to_print`` rows of it drawn at random, as TRL's printed sample (None: all);
``log_unique_prompts``: each prompt's first row only (as TRL's logged table), before the draw."""

from __future__ import annotations

import random
from typing import Any

import torch

from ..trainer import distributed as dist

CORE_COLUMNS = ("prompt", "completion", "reward", "advantage")


def completions_table(prompts: list, completions: list, per_func: torch.Tensor, names: list[str],
                      rewards: torch.Tensor, advantages: torch.Tensor, count: int | None, seed: str,
                      unique_prompts: bool = False) -> list[dict[str, Any]]:
    """The table's rows: ``prompts`` / ``completions`` this process's (gathered here: every process calls it, in
    step), ``per_func`` [rows, functions], ``rewards`` and ``advantages`` already every process's. A sample of
    ``count`` rows keeps the table's order; its draw is seeded by ``seed`` (the same on every process and after a
    resume; Python's global random state is left alone)."""
    everyone = dist.all_gather_objects((list(prompts), list(completions)))
    all_prompts = [p for part in everyone for p in part[0]]
    all_completions = [c for part in everyone for c in part[1]]
    funcs = per_func.tolist()
    rows = [{"prompt": p, "completion": c, "reward": r,
             **{n: v for n, v in zip(names, f, strict=True) if n not in CORE_COLUMNS}, "advantage": a}
            for p, c, f, r, a in zip(all_prompts, all_completions, funcs, rewards.tolist(), advantages.tolist(),
                                     strict=True)]
    if unique_prompts:  # (TRL compares prompts by their text: chat messages too)
        firsts = {str(row["prompt"]): i for i, row in reversed(list(enumerate(rows)))}
        rows = [rows[i] for i in sorted(firsts.values())]
    if count is not None and count < len(rows):  # (TRL: a random sample of that many; 0 or fewer: none)
        keep = sorted(random.Random(seed).sample(range(len(rows)), max(count, 0)))
        rows = [rows[i] for i in keep]
    return rows
