"""``python -m services.decode``: the engine service with decode defaults."""

from __future__ import annotations

import sys

from services.decode.config import DecodeConfig
from services.engine.server import main_of

main = main_of(DecodeConfig)

if __name__ == "__main__":
    sys.exit(main())
