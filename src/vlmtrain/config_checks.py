"""Checks of a run configuration before jsonargparse sees it: unknown sections and keys (with the nearest
valid ones), missing config files, and jsonargparse's errors translated into ones that name the key."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from typing import Any, Literal

import yaml

from vlmtrain.errors import ConfigError


def _sections() -> dict[str, type]:
    from vlmtrain.config import SECTIONS  # (vlmtrain.config imports this module: look them up when called)

    return SECTIONS


# -- key and type checks -----------------------------------------------------------------------------
def _nearest(word: str, choices: list[str]) -> list[str]:
    near = difflib.get_close_matches(word, choices, n=3, cutoff=0.6)
    # Abbreviations ('lr', 'batch') are too short for difflib's ratio; substring matches catch them.
    near += [c for c in choices if len(word) >= 2 and (word in c or c in word) and c not in near]
    return near[:3]


def _unknown(kind: str, name: str, choices: list[str], where: str, prefix: str = "") -> ConfigError:
    near = _nearest(name.rsplit(".", 1)[-1], [c.rsplit(".", 1)[-1] for c in choices])
    full = [f"{prefix}{n}" for n in near]
    if full:
        hint = f" Did you mean {' or '.join(repr(n) for n in full)}?"
    else:
        hint = f" Valid {kind}s{f' in {prefix[:-1]!r}' if prefix else ''}: {', '.join(choices)}."
    place = "on the command line" if where == "the command line" else f"in {where}"
    return ConfigError(f"unknown {kind} {name!r} {place}.{hint}")


def field_names(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(_sections()[section])]


def check_keys(data: Any, where: str) -> None:
    """Raise ConfigError for anything in a {section: {key: value}} mapping that RunConfig has no field for."""
    if data is None:  # an empty file: all defaults
        return
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping with sections {list(_sections())}, got {type(data).__name__}.")
    for section, body in data.items():
        if section not in _sections():
            raise _unknown("section", str(section), list(_sections()), where)
        check_section_keys(section, body, where)


def check_section_keys(section: str, body: Any, where: str) -> None:
    """Raise ConfigError for a section that is not a mapping or has a key its dataclass does not define."""
    if body is None:
        return
    if not isinstance(body, dict):
        raise ConfigError(f"section {section!r} in {where} must be a mapping of keys to values, got {body!r}.")
    names = field_names(section)
    for key in body:
        if key not in names:
            raise _unknown("key", f"{section}.{key}", names, where, prefix=f"{section}.")


def type_name(section: str, key: str) -> str:
    hint = typing.get_type_hints(_sections()[section])[key]
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    # (the class's own annotation: a dataclass field's .type may have been rewritten, e.g. by HfArgumentParser)
    annotation = next(k.__annotations__[key] for k in _sections()[section].__mro__
                      if key in vars(k).get("__annotations__", {}))
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def _members(section: str, key: str) -> tuple[Any, ...]:
    """The types a key accepts: the members of a union, else the type itself."""
    hint = typing.get_type_hints(_sections()[section])[key]
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def allows_none(section: str, key: str) -> bool:
    return any(t is Any or t is type(None) for t in _members(section, key))


def translate_error(err: Exception) -> ConfigError:
    """Turn a jsonargparse error into a ConfigError that names the key (and the expected type)."""
    msg = str(err)
    m = re.search(r'Parser key "(\w+)\.(\w+)"', msg)
    if m and m.group(1) in _sections() and m.group(2) in field_names(m.group(1)):
        section, key = m.groups()
        got = re.findall(r"(?:Got value|Given value): (.*)", msg)
        value = got[-1].strip() if got else "?"
        value = {"None": "null", "True": "true", "False": "false"}.get(value, value)  # as YAML writes them
        hint = ""
        if str in _members(section, key) and re.fullmatch(r"true|false|[-+.\deE]+", value):
            hint = f" (quote it to pass a string: '{value}')"
        return ConfigError(f"{section}.{key}: expected {type_name(section, key)}, got {value}{hint}.")
    m = re.search(r"Group '(\w+)' does not accept option '([\w.]+)'", msg)
    if m and m.group(1) in _sections():
        return _unknown("key", f"{m.group(1)}.{m.group(2)}", field_names(m.group(1)), "a config file",
                        prefix=f"{m.group(1)}.")
    return ConfigError(f"invalid configuration: {msg}")


# -- command-line checks -------------------------------------------------------------------------------
def check_argv(parser: Any, argv: list[str]) -> None:
    """Check option names and the config files they point to, before jsonargparse sees them."""
    known = set(parser._option_string_actions)  # argparse's registry of every option string
    for i, token in enumerate(argv):
        if token == "--":
            break
        if not token.startswith("--"):
            continue
        name = token.split("=", 1)[0]
        value = token.split("=", 1)[1] if "=" in token else (argv[i + 1] if i + 1 < len(argv) else None)
        if name in known:
            section = name[2:]
            if name == "--config" or section in _sections():  # a whole file, or one section's file
                _check_file(value, section if section in _sections() else None)
            continue
        section, _, key = name[2:].partition(".")
        key = key.split(".", 1)[0].rstrip("+")
        if section in _sections() and key in field_names(section) and "dict" in type_name(section, key):
            continue  # --model.config.hidden_size 64 sets one entry of a dict-typed key
        if section in _sections():
            raise _unknown("key", f"{section}.{key}", field_names(section), "the command line",
                           prefix=f"{section}.")
        if key:
            raise _unknown("section", section, list(_sections()), "the command line")
        opts = sorted(o for o in known if o.startswith("--"))
        near = difflib.get_close_matches(name, opts, n=3)
        hint = f" Did you mean {' or '.join(near)}?" if near else " See --help."
        raise ConfigError(f"unknown option {name!r}.{hint}")


def _check_file(path: str | None, section: str | None) -> None:
    if path is None or not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path!r}.")
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if data is None:
        raise ConfigError(f"{path} is empty; expected a mapping with sections {list(_sections())}.")
    if section is None:
        check_keys(data, path)
    else:
        check_section_keys(section, data, path)


def normalize_overrides(overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{'train.learning_rate': 3e-4} and {'train': {'learning_rate': 3e-4}} -> the nested form."""
    nested: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        if "." in key:
            section, name = key.split(".", 1)
            nested.setdefault(section, {})[name] = value
        elif isinstance(value, dict) and key in _sections():
            nested.setdefault(key, {}).update(value)
        else:
            raise _unknown("section", key, list(_sections()), "overrides")
    return nested
