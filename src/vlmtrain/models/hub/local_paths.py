"""Local model directories vs Hub ids, for ``model.pretrained`` and a LoRA adapter's base model.

A local directory is stored absolute wherever it outlives the working directory (a LoRA adapter's
``base_model_name_or_path``), and read back relative to the working directory, else to the checkpoint. A value
that can only be a path (see :func:`looks_like_path`) and names no directory is a ConfigError naming the setting
and the path, never transformers' ``Repo id must be ...`` or a network error; anything else is a Hub id."""

from __future__ import annotations

import json
import os

from vlmtrain.errors import ConfigError

ADAPTER_CONFIG = "adapter_config.json"


def looks_like_path(value: str) -> bool:
    """True when ``value`` cannot be a Hub id (``name`` or ``org/name``): absolute, ``~``, ``./``, ``../``,
    a backslash or more than one ``/``, an existing file, a name the Hub refuses, or ``dir/name`` whose ``dir``
    is a local directory (``runs/tiny-qwen3vl`` when ``runs/`` exists)."""
    if os.path.isabs(value) or value.startswith(("~", ".")) or "\\" in value or value.count("/") > 1:
        return True
    if os.path.isfile(value) or ("/" in value and os.path.isdir(value.split("/", 1)[0])):
        return True
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        return True
    return False


def check_local_model(value: str, key: str) -> None:
    """A ConfigError naming ``key`` and the path when ``value`` looks like a local path (:func:`looks_like_path`)
    but is no directory; a directory or a Hub id passes."""
    if os.path.isdir(value) or not looks_like_path(value):
        return
    where = os.path.abspath(os.path.expanduser(value))
    what = "is a file, not a model directory" if os.path.isfile(value) else "does not exist"
    first = value.split("/", 1)[0]
    hub_like = value.count("/") == 1 and not value.startswith((".", "~")) and os.path.isdir(first)
    note = (f" ({first}/ is a local directory, so {value!r} is read as a path, not a Hub id; for the Hub model, "
            f"run from a directory without {first}/.)") if hub_like else ""
    raise ConfigError(f"{key}: {value!r} {what} ({where}). Expected a directory written by save_pretrained (an "
                      f"offline tiny one: python scripts/build_tiny_hub.py qwen3_vl DIR) or a Hub id such as "
                      f"'Qwen/Qwen3-VL-8B-Instruct'.{note}")


def absolute_if_local(value: str) -> str:
    """``value`` made absolute when it names a local directory (a Hub id is left as it is)."""
    return os.path.abspath(value) if os.path.isdir(value) else value


def adapter_base(checkpoint: str) -> str | None:
    """The base model of a LoRA checkpoint (``base_model_name_or_path`` in its adapter_config.json), resolved:
    a directory as given (absolute, or relative to the working directory), else relative to the checkpoint;
    a value that looks like a path and is neither is a ConfigError naming the file, the setting and the path.
    None when the checkpoint holds no adapter."""
    path = os.path.join(checkpoint, ADAPTER_CONFIG)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"{path} names no base_model_name_or_path: cannot tell which model the adapter is for. "
                          f"Set it to the base model's directory or Hub id.")
    if os.path.isdir(base):
        return base
    beside = os.path.join(checkpoint, base)
    if not os.path.isabs(base) and os.path.isdir(beside):
        return os.path.normpath(beside)
    if looks_like_path(base):
        tried = " or ".join(dict.fromkeys(os.path.abspath(p) for p in (os.path.expanduser(base), beside)))
        raise ConfigError(f"{path}: base_model_name_or_path {base!r} names no directory (tried {tried}): the LoRA "
                          f"adapter needs the base model it was trained on. Put that model there, or set "
                          f"base_model_name_or_path in {path} to its directory or Hub id.")
    return base


def base_not_loadable(checkpoint: str, base: str, err: Exception) -> ConfigError:
    """The error for an adapter's base that is no directory and that transformers could not load as a Hub id
    (e.g. a bare relative name an older checkpoint recorded)."""
    path = os.path.join(checkpoint, ADAPTER_CONFIG)
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return ConfigError(f"{path}: base_model_name_or_path {base!r} is no directory here or beside the checkpoint, "
                       f"and transformers could not load it as a Hub id ({first}). Set base_model_name_or_path in "
                       f"{path} to the base model's directory or Hub id.")
