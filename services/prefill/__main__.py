"""``python -m services.prefill``: the engine service with prefill defaults."""

from __future__ import annotations

import sys

from services.engine.server import main_of
from services.prefill.config import PrefillConfig

main = main_of(PrefillConfig)

if __name__ == "__main__":
    sys.exit(main())
