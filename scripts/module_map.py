"""Print the one-line-per-module map of docs/architecture.md from the modules' docstrings.

`tests/foundation/test_docs.py` checks that the map in the doc lists every module.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def modules() -> list[Path]:
    found = [*sorted((ROOT / "libs" / "pdserve").rglob("*.py")),
             *sorted((ROOT / "services").rglob("*.py"))]
    return [p for p in found if "proto/v1" not in p.as_posix() and p.name != "__init__.py"
            or p.parent.name in ("pdserve",)]


def first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    line = " ".join(doc.strip().split("\n\n")[0].split())
    head, dot, _ = line.partition(". ")
    return head + "." if dot else line


def main() -> int:
    for path in modules():
        rel = path.relative_to(ROOT).as_posix()
        print(f"| `{rel}` | {first_line(path)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
