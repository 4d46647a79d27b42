"""Print the README's config reference tables from the config dataclasses' field docstrings.

    python scripts/config_reference.py model|data|train

`train` prints two tables: the arguments vlmtrain implements, then transformers' other TrainingArguments names
(accepted for drop-in scripts; args_compat.py says what each does).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys

from vlmtrain.config import SECTIONS
from vlmtrain.trainer.args import ImplementedArguments
from vlmtrain.trainer.args_compat import TransformersOnlyArguments, describe


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass and of its dataclass bases, whitespace collapsed."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body
        docs.update({node.target.id: " ".join(nxt.value.value.split())
                     for node, nxt in zip(body, body[1:])
                     if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                     and isinstance(nxt.value, ast.Constant)})
    return docs


def table(section: str, only: type | None = None) -> str:
    """Markdown table (key, default, meaning) of a section's fields, or of the fields of one of its bases."""
    cls = SECTIONS[section]
    docs = field_docs(cls)
    names = {f.name for f in dataclasses.fields(only or cls)}
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.name not in names:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        meaning = docs.get(f.name) or describe(f.name)
        rows.append(f"| `{f.name}` | `{default!r}` | {meaning.replace('|', '/')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    if sys.argv[1] == "train":
        print(table("train", ImplementedArguments))
        print("\ntransformers' other TrainingArguments names: a script written for transformers' Trainer passes "
              "them\nunchanged; a value vlmtrain cannot honour is an error that says what to do instead.\n")
        print(table("train", TransformersOnlyArguments))
    else:
        print(table(sys.argv[1]))
