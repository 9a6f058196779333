"""Make ``pdserve`` importable from the source tree when it is not installed."""

import sys
from pathlib import Path

_LIBS = Path(__file__).resolve().parents[2] / "libs"
if str(_LIBS) not in sys.path:
    sys.path.insert(0, str(_LIBS))
