"""Print the one-line-per-module map of docs/architecture.md from the modules' docstrings;
with ``--write``, replace the map in the doc with it.

`tests/foundation/test_docs.py` checks that the map in the doc is exactly this one.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def modules() -> list[Path]:
    found = [*sorted((ROOT / "libs" / "pdserve").rglob("*.py")),
             *sorted((ROOT / "libs" / "pdserve_bench").rglob("*.py")),
             *sorted((ROOT / "services").rglob("*.py"))]
    return [p for p in found if "proto/v1" not in p.as_posix() and p.name != "__init__.py"
            or p.parent.name in ("pdserve", "pdserve_bench")]


def first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    line = " ".join(doc.strip().split("\n\n")[0].split())
    head, dot, _ = line.partition(". ")
    return head + "." if dot else line


HEADER = "| module | what it is |"


def rows() -> list[str]:
    return [f"| `{p.relative_to(ROOT).as_posix()}` | {first_line(p)} |" for p in modules()]


def write(doc: Path) -> None:
    lines = doc.read_text().split("\n")
    start = lines.index(HEADER) + 2  # past the header and its |---|---| line
    end = start
    while end < len(lines) and lines[end].startswith("| `"):
        end += 1
    doc.write_text("\n".join([*lines[:start], *rows(), *lines[end:]]))


def main() -> int:
    if sys.argv[1:] == ["--write"]:
        write(ROOT / "docs" / "architecture.md")
    else:
        print("\n".join(rows()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
