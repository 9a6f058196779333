"""``python -m pdserve_bench.gpu``: run the device check (see the package docstring)."""

from __future__ import annotations

import sys

from pdserve_bench.gpu.check import main

if __name__ == "__main__":
    sys.exit(main())
