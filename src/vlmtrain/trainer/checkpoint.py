"""Checkpoint directories: atomic writes, discovery of the newest complete one, rotation, RNG state.

A checkpoint is written into a hidden temporary directory and renamed to `checkpoint-<step>` only when
every file is on disk, so a crash mid-save never leaves a directory that resume would pick up.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .distributed import barrier, failed_ranks
from .model_files import DCP_DIR, MODEL_NAME, CheckpointError, PlainModelFiles  # noqa: F401 (for callers)

PREFIX = "checkpoint"
TMP_PREFIX = ".tmp-checkpoint-"
STATE_NAME = "trainer_state.json"
ARGS_NAME = "training_args.bin"  # torch.save(args), as transformers writes it (never read back on resume)
REQUIRED = (STATE_NAME, "optimizer.pt", "scheduler.pt")  # plus the model's files (its model_files part's)
_CKPT_RE = re.compile(rf"^{PREFIX}-(\d+)$")


def checkpoint_step(path: str) -> int | None:
    m = _CKPT_RE.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def list_checkpoints(output_dir: str) -> list[str]:
    """Complete checkpoints in output_dir, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        if checkpoint_step(name) is not None and os.path.isfile(os.path.join(path, STATE_NAME)):
            found.append(path)
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(output_dir: str) -> str | None:
    ckpts = list_checkpoints(output_dir)
    return ckpts[-1] if ckpts else None


def check_complete(path: str, rank: int = 0, files: Any = PlainModelFiles) -> None:
    """A CheckpointError naming what ``path`` lacks: its files, or the model's as the ``files`` format needs them."""
    if not os.path.isdir(path):
        raise CheckpointError(f"resume_from_checkpoint={path!r} does not exist (or is not a directory).")
    if os.path.isdir(os.path.join(path, DCP_DIR)):  # FSDP: model and optimizer shards in DCP format
        required = (STATE_NAME, "scheduler.pt", os.path.join(DCP_DIR, ".metadata"))
    else:
        required = REQUIRED
    missing = [f for f in required if not os.path.isfile(os.path.join(path, f))] + files.missing_weight_files(path)
    if not any(os.path.isfile(os.path.join(path, name)) for name in rng_state_names(rank, fallback=True)):
        missing.append(rng_state_names(rank)[0])
    if missing:
        raise CheckpointError(f"Checkpoint {path!r} is incomplete: missing {missing}. Resume from another "
                              f"checkpoint or pass resume_from_checkpoint=True to pick the newest complete one.")


def remove_stale_tmp(output_dir: str) -> None:
    """Delete half-written checkpoints left by a crash; put back one caught mid-swap by a re-save."""
    if not os.path.isdir(output_dir):
        return
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        if name.startswith(TMP_PREFIX):
            shutil.rmtree(path, ignore_errors=True)
        elif name.endswith(".old") and checkpoint_step(name[:-4]) is not None:
            if os.path.exists(path[:-4]):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.replace(path, path[:-4])


# -- RNG ----------------------------------------------------------------------------------------------
# transformers' layout: rng_state.pth for a single process, rng_state_<rank>.pth for each of several; both read.
def rng_state_name(rank: int, world_size: int) -> str:
    """The RNG file a process writes: rng_state.pth alone, rng_state_<rank>.pth when world_size > 1."""
    return "rng_state.pth" if world_size <= 1 else f"rng_state_{rank}.pth"


def rng_state_names(rank: int, fallback: bool = False) -> tuple[str, ...]:
    """The RNG files a process may read, in order: rng_state.pth only for rank 0 (a single process wrote it);
    with ``fallback``, then rank 0's (a rank the checkpoint's fewer processes did not have starts from it)."""
    own = ("rng_state.pth", f"rng_state_{rank}.pth") if rank == 0 else (f"rng_state_{rank}.pth",)
    return own + rng_state_names(0) if fallback and rank else own


def rng_state(world_size: int = 1) -> dict:
    """Python's, numpy's, torch's CPU and (on a GPU) CUDA's RNG states, keyed as transformers' rng_state.pth:
    `cuda` is this device's state for a single process, every device's list for several."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        # numpy's state as plain lists so torch.load(weights_only=True) can read it back (numpy takes them too).
        "numpy": [np_state[0], np_state[1].tolist(), np_state[2], np_state[3], np_state[4]],
        "cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all() if world_size > 1 else torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        if isinstance(state["cuda"], torch.Tensor):  # one device's state (a single process)
            torch.cuda.set_rng_state(state["cuda"])
        else:
            torch.cuda.set_rng_state_all(state["cuda"])


def load_rng_state(directory: str, rank: int) -> dict:
    """This process's RNG state from a checkpoint, either layout; transformers' files hold numpy arrays, which
    are allowed here (and only numpy's array types) as transformers itself allows them."""
    path = next(os.path.join(directory, n) for n in rng_state_names(rank, fallback=True)
                if os.path.isfile(os.path.join(directory, n)))
    np_core = getattr(np, "_core", None) or np.core
    allowed = [np_core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True)


# -- the whole checkpoint -------------------------------------------------------------------------------
# A save has three parts, each closed by an agreement of every rank (one rank's error, e.g. a full disk, fails
# them all at once): start_checkpoint (rank 0 makes the temporary directory), write_files (each rank its own
# files; rank 0 also the model) and publish_checkpoint (rank 0 renames the directory into place). Synchronous
# saves run them in a row (write_checkpoint); the checkpoint_writer part's writer, write_files in a thread.
def temp_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"{TMP_PREFIX}{step}")


def capture(work: Callable[[], None]) -> Exception | None:
    """Run work(); return what it raised (None if nothing) for an agreement of every rank to report."""
    try:
        work()
    except Exception as err:  # noqa: BLE001  (reported on every rank by _agree, never swallowed)
        return err
    return None


def _agree(output_dir: str, step: int, rank: int, error: Exception | None) -> None:
    """Every rank learns whether any rank failed; then the partial directory is removed and every rank raises."""
    failed = failed_ranks(error is not None)
    if not failed:
        return
    if rank == 0:
        shutil.rmtree(temp_dir(output_dir, step), ignore_errors=True)
    older = ", ".join(os.path.basename(c) for c in list_checkpoints(output_dir)) or "none"
    if error is None:
        reason = "see that rank's log"
    elif isinstance(error, OSError) and error.strerror:
        reason = error.strerror
    else:
        reason = f"{type(error).__name__}: {error}"
    raise OSError(getattr(error, "errno", None) or errno.EIO,
                  f"could not write {PREFIX}-{step} in {output_dir} (failed on rank(s) {failed}: {reason}). "
                  f"Nothing was replaced; older checkpoints are untouched ({older}) and "
                  f"resume_from_checkpoint=True picks the newest. Free space and resume.") from error


def start_checkpoint(output_dir: str, step: int, rank: int = 0, error: Exception | None = None) -> str:
    """Rank 0 makes an empty temporary directory for checkpoint-<step> (returned); every rank agrees, also on
    ``error`` (something that already failed on this rank, e.g. copying the state for an async save)."""
    tmp = temp_dir(output_dir, step)

    def make() -> None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)

    _agree(output_dir, step, rank, error or capture(make))
    return tmp


def write_files(directory: str, files: dict[str, Any], write_model: Callable[[str], None] | None = None) -> None:
    """write_model(directory) if given, then `files` ({name: object for torch.save, or a dict for JSON if name
    ends in .json}), each flushed to disk (fsync). No collective: safe in a background thread."""
    if write_model is not None:
        write_model(directory)
    for name, obj in files.items():
        path = os.path.join(directory, name)
        if name.endswith(".json"):
            with open(path, "w", encoding="utf-8") as f:
                json.dump(obj, f, indent=2, sort_keys=True)
        else:
            torch.save(obj, path)
    if write_model is not None:
        _fsync_dir(directory)
    else:
        for name in files:
            _fsync_file(os.path.join(directory, name))


def publish_checkpoint(output_dir: str, step: int, rank: int = 0, error: Exception | None = None) -> str:
    """Every rank reports whether its writes failed (``error``); if none did, rank 0 renames the temporary
    directory to checkpoint-<step> (replacing an older one of that step) and syncs it. Returns the final path."""
    _agree(output_dir, step, rank, error)  # also: every rank's files are on disk before the rename
    final, tmp = os.path.join(output_dir, f"{PREFIX}-{step}"), temp_dir(output_dir, step)
    if rank == 0:
        _fsync_dir(tmp)
        if os.path.exists(final):  # re-saving a step (e.g. after a resume): swap, then drop the old one
            old = final + ".old"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(output_dir, recursive=False)
    return final


def write_checkpoint(output_dir: str, step: int, files: dict[str, Any], write_model, rank: int = 0,
                     write_sharded=None) -> str:
    """Write `files` (see write_files; names must differ between ranks) plus the model (write_model(dir),
    rank 0) and sharded state (write_sharded(dir), every rank together) into output_dir/checkpoint-<step>,
    atomically. A write that fails on any rank (e.g. a full disk) fails on all."""
    tmp = start_checkpoint(output_dir, step, rank)

    def write() -> None:
        if write_sharded is not None:  # a collective (DCP): before anything that may fail on one rank only
            write_sharded(tmp)
        write_files(tmp, files, write_model if rank == 0 else None)

    final = publish_checkpoint(output_dir, step, rank, capture(write))
    barrier()  # no rank goes on (e.g. to rotate or resume) before the checkpoint is visible
    return final


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: str, recursive: bool = True) -> None:
    for name in os.listdir(path) if recursive else []:
        p = os.path.join(path, name)
        if os.path.isdir(p):
            _fsync_dir(p)
        elif os.path.isfile(p):
            _fsync_file(p)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_torch(path: str) -> Any:
    """torch.load that never unpickles arbitrary objects."""
    return torch.load(path, map_location="cpu", weights_only=True)


def rotate_checkpoints(output_dir: str, limit: int | None, best: str | None, keep: list[str] = (),
                       newest: bool = True) -> list[str]:
    """Delete the oldest checkpoints beyond `limit`; never the best one, one in `keep` or (with `newest`) the
    newest."""
    if not limit:
        return []
    ckpts = list_checkpoints(output_dir)
    kept = {os.path.realpath(p) for p in [best, *keep] if p}
    deletable = [c for c in (ckpts[:-1] if newest else ckpts) if os.path.realpath(c) not in kept]
    deleted = []
    while len(ckpts) - len(deleted) > limit and deletable:
        victim = deletable.pop(0)
        shutil.rmtree(victim, ignore_errors=True)
        deleted.append(victim)
    return deleted


def resume_requested(resume: str | bool | None) -> bool:
    """Whether a resume_from_checkpoint value asks to resume (a path, True, 'true', 'latest')."""
    return not (resume is None or resume is False or (isinstance(resume, str) and resume.lower() in ("", "false", "none")))


def resolve_resume(resume: str | bool | None, output_dir: str, rank: int = 0,
                   files: Any = PlainModelFiles) -> str | None:
    """A complete checkpoint to resume from (its model's files as the ``files`` format writes them): an explicit
    path, or for True/'true'/'latest' the newest complete one in output_dir (None, with a warning, when there is
    none)."""
    if not resume_requested(resume):
        return None
    if resume is True or (isinstance(resume, str) and resume.lower() in ("true", "latest")):
        remove_stale_tmp(output_dir)
        latest = latest_checkpoint(output_dir)
        if latest is None:
            warnings.warn(f"resume_from_checkpoint=True but {output_dir!r} holds no complete checkpoint: "
                          "starting from scratch.", stacklevel=3)
        else:
            check_complete(latest, rank, files)
        return latest
    check_complete(resume, rank, files)
    return resume


def prepare_output_dir(output_dir: str, rank: int = 0) -> None:
    """Fail early, naming the directory, when output_dir cannot be written; clear crash leftovers."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        probe = os.path.join(output_dir, f".write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise PermissionError(f"output_dir {output_dir!r} is not writable ({e.strerror}); choose another "
                              "--train.output_dir.") from e
    if rank == 0:
        remove_stale_tmp(output_dir)
