"""The device check's driver: every part in turn, one JSON report rewritten after each part
(a part that fails records its error; the others still run). See the package docstring.

    python -m pdserve_bench.gpu --out report.json [--parts abcd] [--smoke]

``--smoke`` runs the same code on CPU with tiny shapes (no FlashInfer: parts a, b, d only),
so the check's plumbing is tested where no GPU is.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[3]


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "torch_cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count)
    for name in ("flashinfer", "transformers", "ucxx"):
        try:
            info[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            info[name] = f"unavailable: {type(exc).__name__}: {exc}"
    return info


def run_part(report: dict[str, Any], key: str, fn: Callable[[], Any], out: Path) -> None:
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - one part's failure is that part's result
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-4000:]}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    report["parts"][key] = result
    report["elapsed_s"] = round(time.perf_counter() - report["_t0"], 1)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    write(report, out)


def write(report: dict[str, Any], out: Path) -> None:
    public = {k: v for k, v in report.items() if not k.startswith("_")}
    out.write_text(json.dumps(public, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve_bench.gpu", description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--parts", default="abcd")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    args = p.parse_args(argv)
    from pdserve_bench.gpu import attention_bw, disagg, parity, throughput

    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: run with --smoke for the CPU plumbing check")
    big = {"qwen": "tiny-qwen" if args.smoke else "qwen2.5-0.5b",
           "llama": "tiny-llama" if args.smoke else "llama3-8b-4l"}
    report: dict[str, Any] = {"_t0": time.perf_counter(), "machine": machine(), "parts": {}}
    jit = None
    if device.type == "cuda" and set(args.parts) & set("abcd"):
        jit = subprocess.Popen([sys.executable, "-m", "pdserve_bench.gpu.jit"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    work = Path(tempfile.mkdtemp(prefix="pdserve-device-check-"))
    new_tokens = 8 if args.smoke else parity.NEW_TOKENS
    if "a" in args.parts:  # float32 first: it needs no FlashInfer module
        for short in ("qwen", "llama"):
            run_part(report, f"a_{short}_float32", lambda s=short: parity.check_float32(  # type: ignore[misc]
                big[s], device, new_tokens), args.out)
    _wait(jit, report)
    if "a" in args.parts:
        for short in ("qwen", "llama"):
            run_part(report, f"a_{short}_bfloat16", lambda s=short: parity.check_bfloat16(  # type: ignore[misc]
                big[s], device, new_tokens), args.out)
    if "c" in args.parts and not args.smoke:
        run_part(report, "c", lambda: attention_bw.check(device), args.out)
    if "b" in args.parts:
        conc = (1, 4) if args.smoke else (1, 32, 128)
        run_part(report, "b", lambda: throughput.check(
            big["qwen"], device, conc, new_tokens=16 if args.smoke else 128), args.out)
    if "d" in args.parts:
        run_part(report, "d", lambda: disagg.check(big["qwen"], device, work, ROOT), args.out)
    report["ok"] = all(part.get("ok") for part in report["parts"].values())
    write(report, args.out)
    print(json.dumps({k: v.get("ok") for k, v in report["parts"].items()}))
    return 0 if report["ok"] else 1


def _wait(jit: subprocess.Popen[str] | None, report: dict[str, Any]) -> None:
    """Wait for the JIT warm-up (once) and record what it said."""
    if jit is None or "jit" in report:
        return
    output, _ = jit.communicate()
    report["jit"] = {"exit_code": jit.returncode, "output": output[-3000:]}
