"""A checkpoint as a user names it (``--checkpoint``, load_for_inference, lmms-eval's model_args): a checkpoint
directory, a run directory (its newest complete checkpoint-N/) or 'latest' (the run's output_dir); and the
check that a directory a command writes to can be written, before any model loads."""

from __future__ import annotations

import os
import tempfile

from vlmtrain.errors import ConfigError


def resolve_checkpoint(path: str, output_dir: str) -> str:
    """A checkpoint dir; 'latest' or a run dir (holding checkpoint-N/) means its newest complete checkpoint."""
    from vlmtrain.models.files.model_files import MODEL_FILES
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


def check_writable(directory: str, setting: str) -> None:
    """A ConfigError naming ``setting`` when ``directory`` cannot be created or written (checked by writing a
    temporary file into it, or into its nearest existing parent: permissions alone do not stop root). Leaves
    nothing behind."""
    existing = os.path.abspath(directory)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(20, f"{existing} is a file")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise ConfigError(f"{setting} {directory!r} is not writable ({err.strerror}): choose another "
                          f"{setting}.") from None
