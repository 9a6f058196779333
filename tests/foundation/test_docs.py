"""docs/architecture.md lists every module, one line each (from scripts/module_map.py)."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_architecture_lists_every_module() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rows = subprocess.run([sys.executable, str(ROOT / "scripts" / "module_map.py")],
                          capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(rows) > 50
    missing = [row.split("|")[1].strip() for row in rows if row.split("|")[1] not in doc]
    assert not missing, f"add these modules to docs/architecture.md: {missing}"
    lines = doc.splitlines()
    start = lines.index("| module | what it is |") + 2
    listed = itertools.takewhile(lambda line: line.startswith("| `"), lines[start:])
    stale = [line.split("|")[1].strip() for line in listed if line not in rows]
    assert not stale, f"stale rows (run scripts/module_map.py --write): {stale}"


def test_readme_shows_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make run" in readme and "make test" in readme
