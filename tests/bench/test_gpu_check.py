"""The device check's plumbing on CPU (``--smoke``: tiny shapes, no FlashInfer); the GPU run
itself is scripts/device_check.sh's (docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": f"{ROOT / 'libs'}:{ROOT}"}


def test_smoke_parity_writes_one_report(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pdserve_bench.gpu", "--smoke", "--parts", "a",
                           "--out", str(out)], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)
    report = json.loads(out.read_text())
    assert proc.returncode == 0, (proc.stderr[-2000:], report)
    assert set(report["parts"]) == {"a_qwen_float32", "a_llama_float32", "a_qwen_bfloat16",
                                    "a_llama_bfloat16"}
    for name in ("a_qwen_float32", "a_llama_float32"):
        assert report["parts"][name]["identical"] is True
    assert report["machine"]["torch"] == torch.__version__
    assert report["ok"] is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_gpu_it_says_to_use_smoke(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pdserve_bench.gpu", "--out",
                           str(tmp_path / "r.json")], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "python -m pdserve_bench.gpu: error: no CUDA device: run with --smoke for the CPU "
        "plumbing check")


def test_device_check_without_its_bundle_says_how_to_build_it(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "PDSERVE_GPU_BUNDLE": str(tmp_path / "none")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == (f"device_check: {tmp_path / 'none'}/site.tar.xz is missing: run "
                           "python scripts/gpu_bundle/build.py where PyPI is reachable, and "
                           f"bring {tmp_path / 'none'} along\n")
