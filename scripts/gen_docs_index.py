"""Write docs/index.md, the documentation site's home page, from README.md (one text, two places).

    python scripts/gen_docs_index.py           # rewrite docs/index.md
    python scripts/gen_docs_index.py --check   # exit 1 if the committed page differs (what the tests check)

Only the links change: `docs/PAGE.md` becomes `PAGE.md`, and files outside docs/ (CHANGELOG.md, LICENSE) point
to their site page or become plain names.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "index.md"


def render(readme: str) -> str:
    text = re.sub(r"\]\(docs/", "](", readme)
    text = text.replace("[CHANGELOG.md](CHANGELOG.md)", "[the changelog](changelog.md)")
    text = text.replace("[LICENSE](LICENSE)", "the `LICENSE` file")
    note = ("<!-- Generated from README.md by scripts/gen_docs_index.py: edit README.md, then run "
            "`python scripts/gen_docs_index.py`. -->\n\n")
    return note + text


def main(argv: list[str]) -> int:
    text = render((ROOT / "README.md").read_text())
    if "--check" in argv:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print("docs/index.md is stale: run python scripts/gen_docs_index.py")
            return 1
        return 0
    PAGE.write_text(text)
    print("wrote docs/index.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
