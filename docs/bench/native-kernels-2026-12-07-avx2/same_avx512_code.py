"""Whether the AVX-512 kernels compile to the same instructions before and after the SIMD layer
(cpu_simd.h) and the per-file target pragmas: a machine without AVX-512 cannot run them, so this
compares their code. Compiles the kernels' files of commit OLD (the whole module built with
-mavx512f/bw/vl/dq) and of the working tree (the module built with -mavx2 -mfma, the AVX-512
files under a target pragma) to object files with cpp_extension's flags, disassembles every
function of the AVX-512 kernels (namespaces avx512, avx512bf16; the elementwise loops) and
compares them instruction by instruction, with addresses, constant-pool labels and the
namespace names taken out.

    python docs/bench/native-kernels-2026-12-07-avx2/same_avx512_code.py [OLD]   (default 5612820)
"""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
import tempfile
from collections import defaultdict
from pathlib import Path

from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parents[3]
CSRC = "libs/pdserve/attention/csrc"
OLD_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
NEW_FLAGS = ["-mavx2", "-mfma"]
OLD_FILES = ["cpu_decode_attention.cpp", "cpu_decode_attention_bf16.cpp", "cpu_elementwise.cpp"]
NEW_FILES = ["cpu_kernels_avx512.cpp", "cpu_decode_attention_bf16.cpp"]
PADDING = re.compile(r"(cs )?(nop|xchg %ax,%ax)")  # between functions, not run


def compile_all(src: Path, files: list[str], flags: list[str], out: Path) -> list[Path]:
    includes = [f"-isystem{p}" for p in cpp_extension.include_paths()]
    includes.append(f"-isystem{sysconfig.get_paths()['include']}")
    objects = []
    for name in files:
        obj = out / (name + ".o")
        subprocess.run(["c++", "-DTORCH_EXTENSION_NAME=x", "-DTORCH_API_INCLUDE_EXTENSION_H",
                        *includes, "-fPIC", "-std=c++20", "-O3", "-fopenmp", *flags, "-c",
                        str(src / name), "-o", str(obj)], check=True)
        objects.append(obj)
    return objects


def functions(objects: list[Path]) -> dict[str, list[str]]:
    """Kernel functions (demangled, namespace-normalised name) -> normalised instructions."""
    found: dict[str, list[str]] = defaultdict(list)
    for obj in objects:
        text = subprocess.run(["objdump", "-d", "-r", "-C", "--no-show-raw-insn",
                               "--no-addresses", str(obj)],
                              check=True, capture_output=True, text=True).stdout
        name = None
        for line in text.splitlines():
            head = re.match(r"^<(.*)>:$", line)
            if head:
                name = head.group(1)
                keep = ("avx512" in name or "norm_rows" in name or "silu" in name) \
                    and "decode_attention(" not in name
                name = norm(name) if keep else None
                continue
            if name is None or not line.strip() or PADDING.match(line.strip()):
                continue
            found[name].append(norm(line.strip()))
    return found


def norm(s: str) -> str:
    s = s.replace("(anonymous namespace)::", "").replace("avx512bf16::", "BF16::")
    s = s.replace("avx512::", "")
    s = re.sub(r"\.LC\d+", ".LC", s)
    s = re.sub(r"\b[0-9a-f]+ <", "<", s)  # a branch's absolute address; <sym+off> stays
    return re.sub(r"\s+", " ", s)


def main() -> int:
    old = sys.argv[1] if len(sys.argv) > 1 else "5612820"
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        (base / "old").mkdir()
        (base / "new").mkdir()
        src = base / "old-src"
        src.mkdir()
        for name in subprocess.run(["git", "ls-tree", "--name-only", f"{old}:{CSRC}"], cwd=ROOT,
                                   check=True, capture_output=True, text=True).stdout.split():
            (src / name).write_bytes(subprocess.run(
                ["git", "show", f"{old}:{CSRC}/{name}"], cwd=ROOT, check=True,
                capture_output=True).stdout)
        a = functions(compile_all(src, OLD_FILES, OLD_FLAGS, base / "old"))
        b = functions(compile_all(ROOT / CSRC, NEW_FILES, NEW_FLAGS, base / "new"))
    same = [n for n in a if n in b and a[n] == b[n]]
    kernels = [n for n in a if re.match(r"void (BF16::)?one_head<", n)]
    print(f"{old} (module flags {' '.join(OLD_FLAGS)}) vs the working tree "
          f"({' '.join(NEW_FLAGS)}, AVX-512 by target pragma)")
    print(f"functions: {len(a)} before, {len(b)} after; identical instructions: {len(same)}")
    for n in sorted(set(a) | set(b)):
        if n not in same:
            print(f"DIFFERS: {n}: {len(a.get(n, []))} vs {len(b.get(n, []))} instructions")
    total = sum(len(a[n]) for n in same)
    print(f"instructions compared: {total}")
    same_kernels = [n for n in kernels if n in same]
    print(f"the attention kernel bodies (one_head<dtype, head_dim>, avx512 and avx512bf16): "
          f"{len(same_kernels)} of {len(kernels)} identical, "
          f"{sum(len(a[n]) for n in same_kernels)} instructions")
    return 0 if kernels and len(same_kernels) == len(kernels) else 1


if __name__ == "__main__":
    raise SystemExit(main())
