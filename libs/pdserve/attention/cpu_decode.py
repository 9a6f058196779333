"""A native decode attention for CPU engines: ``csrc/cpu_decode_attention.cpp``, built once.

Why not torch's SDPA: in a decode step each sequence has one new query token, and with grouped
KV heads the 4-8 query heads of a KV head are its queries; SDPA's flash kernel (built for blocks
of many queries) then costs ~40-70 ns per (sequence, KV head, key) in bfloat16 on an AMX Xeon,
0.38-0.65 ms per layer at 32 sequences of ~160 tokens: 15-25% of a decode step. The kernel
scores 4 keys at a time for every query head of a KV head (in bfloat16 with ``vdpbf16ps`` where
the CPU has AVX-512-BF16, else widened to float32 with FMA; 16 lanes of AVX-512, or of AVX2 as
two 8-lane halves), reads each sequence's own length
(no mask), and runs the softmax in float32: alone, 2.2x faster than SDPA on the same K/V at 158
keys in bfloat16 and 1.8x at 1024 (float32 1.6x and 1.4x; docs/benchmarks.md, "Native CPU
kernels"). No library on PyPI ships such a kernel for torch 2.13 on CPU (Intel's extension for
PyTorch, whose paged attention did, ended with torch 2.8), so it is ours.

Built with ``torch.utils.cpp_extension.load`` (the machine's C++ compiler and ninja) into
``$PDSERVE_KERNEL_CACHE`` (default ``~/.cache/pdserve/kernels``), in a directory named by a hash
of the sources, the flags and torch's version: the first engine on a machine waits for the build
(~25-90 s on 2 cores), later ones load the built module directly (no compiler then). ``make setup``
and the CPU engine image build it ahead: ``python -c "from pdserve.attention import cpu_decode;
cpu_decode.main()"``. The flags name the instruction sets, not ``-march=native``, so a module
built on one machine runs on any CPU that has them (checked at load). GCC and clang (``$CXX``, as
cpp_extension takes it) both build it; with clang the kernels' loops run on the calling thread
(``CLANG_CFLAGS``).

``mode`` (``EngineArgs.native_kernels``, ``--native-kernels``): "auto" uses it where the CPU has
AVX2 and FMA (AVX-512 F, BW, VL and DQ, and AVX-512-BF16, are used where present: ``isa()``) and
the build works, otherwise
SDPA (one log line says why); "on" raises instead; "off" never builds it. The same module
carries bfloat16 RMSNorm (with the residual add), SiLU-and-mul and RoPE
(``csrc/cpu_elementwise.cpp``), which ``models/kernels.py`` uses under the same mode, and the
sampler's float32 argmax (``argmax``), in both dtypes.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import struct
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pdserve import env
from pdserve.cpuinfo import cpu_flags
from pdserve.procs import pid_alive

MODES = ("auto", "on", "off")
NAME = "pdserve_cpu_decode_attention"
SOURCE = Path(__file__).with_name("csrc") / "cpu_decode_attention.cpp"
# The same module carries bfloat16 RMSNorm and SiLU-and-mul (models/kernels.py, CpuKernels).
# The module is compiled for AVX2 and FMA; the kernels' templates (the _impl.h headers, over
# cpu_simd.h's vectors) are compiled once for that, once for AVX-512 F, BW, VL and DQ, and once
# more with AVX-512-BF16 (bfloat16 attention scores with vdpbf16ps), each of the AVX-512 files
# under a target pragma of its own; the module runs the widest the CPU has (``isa()``).
SOURCES = (SOURCE, SOURCE.with_name("cpu_elementwise.cpp"),
           SOURCE.with_name("cpu_kernels_avx2.cpp"), SOURCE.with_name("cpu_kernels_avx512.cpp"),
           SOURCE.with_name("cpu_decode_attention_bf16.cpp"))
HEADERS = tuple(SOURCE.with_name(name) for name in (
    "cpu_kernels.h", "cpu_simd.h", "cpu_decode_attention_impl.h", "cpu_elementwise_impl.h"))
CFLAGS = ["-O3", "-fopenmp", "-mavx2", "-mfma"]
# With clang, no -fopenmp: torch's OpenMP is GCC's libgomp, and clang's -fopenmp would link
# LLVM's libomp beside it (two runtimes in one process, the kernels' threads not torch's). The
# kernels' at::parallel_for then runs on the calling thread.
CLANG_CFLAGS = [f for f in CFLAGS if f != "-fopenmp"]
CPU_FLAGS = ("avx2", "fma")
HEAD_DIMS = (32, 64, 96, 128, 256)
MAX_GROUPS = 8

log = logging.getLogger(__name__)

DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]

_lock = threading.Lock()
_built: tuple[Any, str] | None = None  # (the module or None, why not)


def missing_cpu_flags(flags: set[str] | None = None) -> list[str]:
    have = cpu_flags() if flags is None else flags
    return [f for f in CPU_FLAGS if f not in have]


def compiler() -> str:
    """The C++ compiler ``cpp_extension`` runs: ``$CXX``, else ``c++``."""
    return os.environ.get("CXX", "c++")


def cflags() -> list[str]:
    """The flags for ``compiler()``: ``CLANG_CFLAGS`` where it says it is clang, else
    ``CFLAGS`` (GCC, or a compiler that cannot be asked: the build says why)."""
    return _cflags(compiler())


@functools.cache
def _cflags(cxx: str) -> list[str]:
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    return CLANG_CFLAGS if "clang" in version.lower() else CFLAGS


def build_dir(flags: list[str] | None = None) -> Path:
    """Where the module built with ``flags`` (default ``cflags()``) lies."""
    root = Path(env.kernel_cache() or Path.home() / ".cache" / "pdserve" / "kernels")
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS)
                         + " ".join(cflags() if flags is None else flags).encode()
                         + torch.__version__.encode()).hexdigest()[:16]
    return root / f"cpu_decode_attention-{key}"


def _build() -> tuple[Any, str]:
    missing = missing_cpu_flags()
    if missing:
        return None, f"the CPU lacks {', '.join(missing)}"
    return build()


def build() -> tuple[Any, str]:
    """Load the module built for this source, building it first where it is not (whatever
    this CPU runs: an image may be built on another machine); (kernel, "") or (None, why)."""
    try:
        flags = cflags()
        path = build_dir(flags)  # reads the sources; a home directory may be missing
        built = path / f"{NAME}.so"
        module = _load_built(built) if built.is_file() else None
        if module is None:
            module = _build_staged(path, flags)
    except Exception as exc:  # no compiler, no ninja, a failed build: SDPA serves instead
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return None, f"the build failed: {first[:300]}"
    return module, ""


def _build_staged(path: Path, flags: list[str]) -> Any:
    """Build in a directory of this process's own, then move it to ``path`` whole: a build
    killed half way (an object file cut short, which ninja would link from) never lies where
    engines look, and engines building at once never write the same files. Where another
    engine's build landed first, its module stays and this one's directory goes."""
    if path.parent.exists() and not path.parent.is_dir():
        raise NotADirectoryError(f"the kernel cache {path.parent} is not a directory "
                                 f"({env.KERNEL_CACHE_VAR}, default ~/.cache/pdserve/kernels)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f"{path.name}.lock"), "a") as lock:
        # Engines started together (pdserve up starts them side by side): one builds, the
        # others wait here and load its module. The lock goes with a process that dies.
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = path / f"{NAME}.so"
        module = _load_built(built) if built.is_file() else None
        return module if module is not None else _build_locked(path, flags)


def _build_locked(path: Path, flags: list[str]) -> Any:
    from torch.utils import cpp_extension

    for stage in path.parent.glob(f"{path.name}.build-*"):  # left by builds that were killed
        pid = stage.name.rpartition("-")[2]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(stage, ignore_errors=True)
    stage = path.with_name(f"{path.name}.build-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        module = cpp_extension.load(name=NAME, sources=[str(p) for p in SOURCES],
                                    extra_cflags=flags, build_directory=str(stage),
                                    verbose=False)
        if not whole_elf(path / f"{NAME}.so"):
            shutil.rmtree(path, ignore_errors=True)  # what a killed build left before this
        try:
            os.rename(stage, path)
        except OSError as exc:  # another engine's whole build is there
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return module


def whole_elf(path: Path) -> bool:
    """Whether ``path`` holds every byte its 64-bit ELF headers point at. A shared object cut
    short (a build killed while linking) passes ``dlopen``'s checks and then kills the
    process with SIGBUS when a page past the end is touched, so it is looked at first. (A
    dependency such as pyelftools for these three reads did not seem worth it.)"""
    try:
        data = path.read_bytes()
        if data[:5] != b"\x7fELF\x02":
            return False
        phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
        if phoff + phnum * phentsize > len(data) or shoff + shnum * shentsize > len(data):
            return False
        segments = (struct.unpack_from("<8xQ16xQ", data, phoff + i * phentsize)
                    for i in range(phnum))  # each program header's p_offset and p_filesz
        return all(offset + filesz <= len(data) for offset, filesz in segments)
    except (OSError, struct.error):
        return False


def _load_built(built: Path) -> Any:
    """The module built before (or into an image): no compiler is needed to load it. One that
    is cut short or does not load (a build killed while linking, a disk error) is removed, so
    that it is built again rather than leaving every later engine on SDPA; None then."""
    error = "the file is cut short or not a 64-bit ELF shared object"
    if whole_elf(built):
        try:
            spec = importlib.util.spec_from_file_location(NAME, built)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        except ImportError as exc:
            error = str(exc)[:300]
    log.warning("native CPU kernels: the built module does not load; building it again",
                extra={"fields": {"path": str(built), "error": error}})
    built.unlink(missing_ok=True)
    return None


def load(mode: str = "auto") -> DecodeKernel | None:
    """The kernel (built on first use, once per process), or None under "off" or, under
    "auto", where it cannot run here; "on" raises ValueError naming why it cannot."""
    built = module(mode)
    return None if built is None else built.decode_attention  # type: ignore[no-any-return]


def module(mode: str = "auto") -> Any:
    """The built module (``decode_attention``, ``rms_norm_bf16``, ``add_rms_norm_bf16``,
    ``silu_and_mul_bf16``, ``rope_qk_bf16``, ``argmax_f32``), on ``load``'s terms."""
    global _built
    if mode not in MODES:
        raise ValueError(f"native_kernels must be one of {MODES}, got {mode!r}")
    if mode == "off":
        return None
    with _lock:
        if _built is None:
            _built = _build()
            kernel, reason = _built
            if kernel is None:
                log.info("native CPU kernels: not used (torch's SDPA and elementwise ops)",
                         extra={"fields": {"reason": reason}})
            else:  # the instruction set they run with on this CPU
                log.info("native CPU kernels: in use", extra={"fields": {"isa": kernel.isa()}})
    kernel, reason = _built
    if kernel is None and mode == "on":
        raise ValueError(f"native_kernels 'on': the native CPU kernels cannot run here: "
                         f"{reason}")
    return kernel


def argmax(mode: str = "auto") -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``torch.argmax(rows, -1)`` on the module's ``argmax_f32`` for float32 CPU rows (other
    rows: torch's), exact: the sampler's greedy pick. torch's one-thread CPU argmax took 2.2 ms
    for 32 rows of a 49k vocabulary, this one 0.24 ms. None on ``load``'s terms."""
    built = module(mode)
    if built is None:
        return None

    def rows_argmax(rows: torch.Tensor) -> torch.Tensor:
        if rows.device.type == "cpu" and rows.dtype == torch.float32 and rows.dim() == 2 \
                and rows.shape[1] > 0:
            return built.argmax_f32(rows.contiguous())  # type: ignore[no-any-return]
        return rows.argmax(-1)

    return rows_argmax


def isa(built: Any, dtype: torch.dtype) -> str:
    """The instruction set ``built``'s decode attention runs ``dtype`` with: "avx512bf16"
    (bfloat16 scores with vdpbf16ps), "avx512" or "avx2"; float32 never uses vdpbf16ps."""
    name: str = built.isa()
    return "avx512" if name == "avx512bf16" and dtype != torch.bfloat16 else name


def serves(head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot serve this shape and dtype (None: it can)."""
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} (float32 or bfloat16 only)"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (one of {HEAD_DIMS})"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUPS:
        return (f"{num_heads} query heads over {num_kv_heads} KV heads (at most "
                f"{MAX_GROUPS} per KV head)")
    return None


def main(argv: list[str] | None = None) -> int:
    """Build it now (``make setup``; the CPU engine image with ``--any-cpu``, which builds
    even where this CPU could not run it). Exit 1 only when ``--any-cpu`` fails to build."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO)
    if "--any-cpu" in args:
        kernel, reason = build()
        print("native decode attention:", f"built in {build_dir()}" if kernel else reason)
        return 0 if kernel else 1
    kernel = load("auto")
    print("native decode attention:", f"built in {build_dir()}" if kernel else
          f"not used here: {_built[1] if _built else ''}")
    return 0


