"""Checks of a run configuration before jsonargparse sees it: unknown sections and keys (with the nearest
valid ones), missing config files, and jsonargparse's errors translated into ones that name the key.

Each check takes the sections it checks against (``{section: its dataclass}``, vlmtrain.config's SECTIONS) as
its first argument: this module sits below the config that uses it."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

import yaml

from vlmtrain.errors import ConfigError

Sections = Mapping[str, type]


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


def field_names(sections: Sections, section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(sections[section])]


def check_keys(sections: Sections, data: Any, where: str) -> None:
    """Raise ConfigError for anything in a {section: {key: value}} mapping that RunConfig has no field for."""
    if data is None:  # an empty file: all defaults
        return
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping with sections {list(sections)}, "
                          f"got {type(data).__name__}.")
    for section, body in data.items():
        if section not in sections:
            raise _unknown("section", str(section), list(sections), where)
        check_section_keys(sections, section, body, where)


def check_section_keys(sections: Sections, section: str, body: Any, where: str) -> None:
    """Raise ConfigError for a section that is not a mapping or has a key its dataclass does not define."""
    if body is None:
        return
    if not isinstance(body, dict):
        raise ConfigError(f"section {section!r} in {where} must be a mapping of keys to values, got {body!r}.")
    names = field_names(sections, section)
    for key in body:
        if key not in names:
            raise _unknown("key", f"{section}.{key}", names, where, prefix=f"{section}.")


def type_name(sections: Sections, section: str, key: str) -> str:
    hint = typing.get_type_hints(sections[section])[key]
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    # (the class's own annotation: a dataclass field's .type may have been rewritten, e.g. by HfArgumentParser)
    annotation = next(k.__annotations__[key] for k in sections[section].__mro__
                      if key in vars(k).get("__annotations__", {}))
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def _members(sections: Sections, section: str, key: str) -> tuple[Any, ...]:
    """The types a key accepts: the members of a union, else the type itself."""
    hint = typing.get_type_hints(sections[section])[key]
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def allows_none(sections: Sections, section: str, key: str) -> bool:
    return any(t is Any or t is type(None) for t in _members(sections, section, key))


def translate_error(sections: Sections, err: Exception) -> ConfigError:
    """Turn a jsonargparse error into a ConfigError that names the key (and the expected type)."""
    msg = str(err)
    m = re.search(r'Parser key "(\w+)\.(\w+)"', msg)
    if m and m.group(1) in sections and m.group(2) in field_names(sections, m.group(1)):
        section, key = m.groups()
        got = re.findall(r"(?:Got value|Given value): (.*)", msg)
        value = got[-1].strip() if got else "?"
        value = {"None": "null", "True": "true", "False": "false"}.get(value, value)  # as YAML writes them
        hint = ""
        if str in _members(sections, section, key) and re.fullmatch(r"true|false|[-+.\deE]+", value):
            hint = f" (quote it to pass a string: '{value}')"
        expected = type_name(sections, section, key)
        return ConfigError(f"{section}.{key}: expected {expected}, got {value}{hint}.")
    m = re.search(r"Group '(\w+)' does not accept option '([\w.]+)'", msg)
    if m and m.group(1) in sections:
        return _unknown("key", f"{m.group(1)}.{m.group(2)}", field_names(sections, m.group(1)),
                        "a config file", prefix=f"{m.group(1)}.")
    return ConfigError(f"invalid configuration: {msg}")


# -- command-line checks -------------------------------------------------------------------------------
def check_argv(sections: Sections, parser: Any, argv: list[str]) -> None:
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
            if name == "--config" or section in sections:  # a whole file, or one section's file
                _check_file(sections, value, section if section in sections else None)
            continue
        section, _, key = name[2:].partition(".")
        key = key.split(".", 1)[0].rstrip("+")
        if (section in sections and key in field_names(sections, section)
                and "dict" in type_name(sections, section, key)):
            continue  # --model.config.hidden_size 64 sets one entry of a dict-typed key
        if section in sections:
            raise _unknown("key", f"{section}.{key}", field_names(sections, section), "the command line",
                           prefix=f"{section}.")
        if key:
            raise _unknown("section", section, list(sections), "the command line")
        opts = sorted(o for o in known if o.startswith("--"))
        near = difflib.get_close_matches(name, opts, n=3)
        hint = f" Did you mean {' or '.join(near)}?" if near else " See --help."
        raise ConfigError(f"unknown option {name!r}.{hint}")


def _check_file(sections: Sections, path: str | None, section: str | None) -> None:
    if path is None or not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path!r}.")
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if data is None:
        raise ConfigError(f"{path} is empty; expected a mapping with sections {list(sections)}.")
    if section is None:
        check_keys(sections, data, path)
    else:
        check_section_keys(sections, section, data, path)


def normalize_overrides(sections: Sections, overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{'train.learning_rate': 3e-4} and {'train': {'learning_rate': 3e-4}} -> the nested form."""
    nested: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        if "." in key:
            section, name = key.split(".", 1)
            nested.setdefault(section, {})[name] = value
        elif isinstance(value, dict) and key in sections:
            nested.setdefault(key, {}).update(value)
        else:
            raise _unknown("section", key, list(sections), "overrides")
    return nested
