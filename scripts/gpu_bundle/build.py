"""Build the bundle the device check installs from, on a machine that reaches PyPI.

    python scripts/gpu_bundle/build.py            -> .gpu-bundle/ (git-ignored), ~30-40 MB

The GPU machine has Python 3.12, a CUDA torch, nvcc, triton, transformers, grpcio and protobuf,
but no package index, and at most 64 MiB travel with a call. So the wheels pdserve needs there
are downloaded here (``pip download``, for CPython 3.12 on manylinux x86-64), unpacked into one
site directory, trimmed, and packed as ``.gpu-bundle/site.tar.xz``:

- flashinfer-python: only what paged attention, norm, activation, RoPE and sampling need
  (``flashinfer_closure.py``: the Python modules they import, the JIT sources and headers
  their modules compile), with a package ``__init__`` importing just those; FlashInfer
  JIT-compiles them there with the machine's nvcc. apache-tvm-ffi whole (its headers and
  library are what the kernels link against).
- ucxx and its libraries (the kvds' UCX data plane, for the disaggregated part): no static
  libraries, headers, tools or perftest; each shared library once, its other names symlinks.
- gRPC health and reflection, a protobuf and grpcio as new as the generated stubs need,
  OpenTelemetry's API and SDK, redis: pure Python or one extension each.

``.gpu-bundle/proto/`` gets the generated stubs (``scripts/gen_protos.py``), which the device
check copies into place when the checkout lacks them; ``.gpu-bundle/cuda-include/`` cuBLAS's and
cuRAND's headers, which FlashInfer's norm kernels include (a toolkit of nvcc alone lacks them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64")
FLASHINFER = "flashinfer-python==0.7.4"
TVM_FFI = "apache-tvm-ffi==0.1.15.post2"
PACKAGES = (
    FLASHINFER, TVM_FFI,
    "ucxx-cu13==0.52.0", "libucxx-cu13==0.52.0", "libucx-cu13==1.22.0", "rmm-cu13==26.10.0",
    "librmm-cu13==26.10.0",
    "grpcio==1.85.3", "grpcio-health-checking==1.85.1", "grpcio-reflection==1.85.1",
    "protobuf==7.36.2", "opentelemetry-api==1.45.2", "opentelemetry-sdk==1.45.2",
    "opentelemetry-semantic-conventions==0.66b2", "redis==8.1.0",
)
# FlashInfer's norm kernels include cuBLAS's and cuRAND's headers, which a toolkit of nvcc alone
# lacks: their headers (only), for CUDA 13, go to .gpu-bundle/cuda-include.
HEADERS = ("nvidia-cublas==13.0.2.14", "nvidia-curand==10.4.5.25")
# For the closure analysis only, on this machine's Python: FlashInfer's pure-Python imports.
ANALYSIS_DEPS = ("requests", "einops", "tabulate", "click", TVM_FFI)
MAX_BYTES = 56 << 20  # leaves the checkout room under the 64 MiB a call may carry
MINIMAL_INIT = '''"""FlashInfer, trimmed by pdserve's GPU bundle (scripts/gpu_bundle): paged
attention, norm, activation, RoPE and sampling only."""

from . import activation, decode, norm, page, prefill, rope, sampling
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .prefill import BatchPrefillWithPagedKVCacheWrapper
from .version import __version__
'''


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def download(dest: Path) -> list[Path]:
    platform_args = [a for p in PLATFORMS for a in ("--platform", p)]
    pip("download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
        "--implementation", "cp", *platform_args, "-d", str(dest), *PACKAGES)
    return sorted(dest.glob("*.whl"))


def drop(name: str) -> bool:
    """Members of any wheel the device never uses."""
    parts = name.split("/")
    return ("__pycache__" in parts or name.endswith((".a", ".pyx", ".pxd"))
            or "perftest" in name or (parts[0] == "libucx" and parts[1:2] == ["bin"])
            or (parts[0] in ("libucxx", "librmm", "libucx") and "include" in parts)
            or "/cmake/" in name or "/pkgconfig/" in name)


def unpack(wheel: Path, site: Path) -> None:
    """Extract a wheel into the site directory (``*.data/{purelib,platlib}`` merged in);
    of a library stored under several names, one copy and symlinks for the others. Of
    FlashInfer's wheel only the ``flashinfer`` package (it also carries other top-level ones)."""
    only = ("flashinfer/", "flashinfer_python-") if wheel.name.startswith("flashinfer_") else ("",)
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist()
                 if not n.endswith("/") and not drop(n) and n.startswith(only)]
        for name in names:
            parts = name.split("/")
            if parts[0].endswith(".data"):
                if parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            target = site.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            soname = _soname(target.name)
            sibling = f"{name[: -len(target.name)]}{soname}"
            if soname is not None and soname != target.name and sibling in names:
                target.unlink(missing_ok=True)
                target.symlink_to(soname)
                continue
            with zf.open(name) as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst)


def _soname(filename: str) -> str | None:
    """``libucp.so`` / ``libucp.so.0.0.0`` -> ``libucp.so.0`` (the name the loader records)."""
    stem, sep, _ = filename.partition(".so")
    return f"{stem}.so.0" if sep and filename.startswith("lib") else None


def trim_flashinfer(site: Path, work: Path) -> None:
    (site / "flashinfer" / "__init__.py").write_text(MINIMAL_INIT)
    deps = work / "analysis"
    pip("install", "--quiet", "--target", str(deps), *ANALYSIS_DEPS)
    out = work / "closure.json"
    env = {**os.environ, "PYTHONPATH": str(deps), "FLASHINFER_WORKSPACE_BASE": str(work / "fi"),
           "FLASHINFER_CUDA_ARCH_LIST": "9.0"}
    # ``site``'s tvm_ffi is built for 3.12: the analysis imports this Python's (``deps``,
    # ahead of ``site`` on its path).
    subprocess.run([sys.executable, str(HERE / "flashinfer_closure.py"), str(site), str(out)],
                   check=True, env=env)
    closure = json.loads(out.read_text())
    keep = {site / p for p in closure["python"] + closure["data"]}
    keep.add(site / "flashinfer" / "__init__.py")
    for path in sorted((site / "flashinfer").rglob("*"), reverse=True):
        if path.is_file() and path not in keep:
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()


def cuda_headers(work: Path, bundle: Path) -> None:
    platform_args = [a for p in PLATFORMS for a in ("--platform", p)]
    pip("download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
        "--implementation", "cp", *platform_args, "-d", str(work / "headers"), *HEADERS)
    out = bundle / "cuda-include"
    out.mkdir()
    for wheel in (work / "headers").glob("*.whl"):
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if "/include/" in name and name.endswith(".h"):
                    (out / Path(name).name).write_bytes(zf.read(name))


def pack(site: Path, bundle: Path) -> Path:
    archive = bundle / "site.tar.xz"
    with tarfile.open(archive, "w:xz", preset=6) as tar:
        for path in sorted(site.iterdir()):
            tar.add(path, arcname=path.name)
    return archive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu-bundle")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdserve-bundle-") as tmp:
        work = Path(tmp)
        site = work / "site"
        site.mkdir()
        for wheel in download(work / "wheels"):
            unpack(wheel, site)
        trim_flashinfer(site, work)
        shutil.rmtree(args.out, ignore_errors=True)
        args.out.mkdir(parents=True)
        archive = pack(site, args.out)
        cuda_headers(work, args.out)
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py")], check=True)
    shutil.copytree(ROOT / "libs" / "pdserve" / "proto" / "v1", args.out / "proto")
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    manifest = {"packages": [*PACKAGES, *(f"{h} (headers only)" for h in HEADERS)],
                "bytes": size}
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{archive.relative_to(ROOT) if archive.is_relative_to(ROOT) else archive}: "
          f"{size / 2**20:.1f} MiB in all")
    if size > MAX_BYTES:
        print(f"bundle is over {MAX_BYTES >> 20} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
