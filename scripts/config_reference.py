"""Print the README's config reference tables from the config dataclasses' field docstrings.

    python scripts/config_reference.py model|data|train
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys

from vlmtrain.config import SECTIONS


def table(section: str) -> str:
    cls = SECTIONS[section]
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):  # (data: sources' options)
        body = ast.parse(inspect.getsource(klass)).body[0].body
        docs.update({node.target.id: " ".join(nxt.value.value.split())
                     for node, nxt in zip(body, body[1:]) if isinstance(node, ast.AnnAssign)
                     and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)})
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append(f"| `{f.name}` | `{default!r}` | {docs.get(f.name, '').replace('|', '/')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(sys.argv[1]))
