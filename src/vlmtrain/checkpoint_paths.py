"""A checkpoint as a user names it (``--checkpoint``, load_for_inference, lmms-eval's model_args): a checkpoint
directory, a run directory (its newest complete checkpoint-N/) or 'latest' (the run's output_dir)."""

from __future__ import annotations

import os

from vlmtrain.errors import ConfigError


def resolve_checkpoint(path: str, output_dir: str) -> str:
    """A checkpoint dir; 'latest' or a run dir (holding checkpoint-N/) means its newest complete checkpoint."""
    from vlmtrain.models.model_files import MODEL_FILES
    from vlmtrain.trainer.checkpoint import latest_checkpoint

    run_dir = output_dir if path == "latest" else path
    if not os.path.isdir(run_dir):
        raise ConfigError(f"checkpoint {path!r} does not exist (or is not a directory).")
    if MODEL_FILES.has_model_files(run_dir):  # full (one file or sharded), LoRA adapter, or FSDP shards
        return run_dir
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise ConfigError(f"{run_dir!r} holds neither model.safetensors nor a complete checkpoint-N/ directory.")
    return latest
