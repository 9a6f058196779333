"""Which files of an unpacked FlashInfer wheel pdserve's kernels need (run by build.py).

    python flashinfer_closure.py <site dir holding flashinfer/> <out.json>

Imports FlashInfer from the site dir (CPU torch is enough: nothing is compiled), then:

- Python: every ``flashinfer`` module that importing the entry modules loads, plus every
  flashinfer module those modules name in an import anywhere (also inside functions, which
  run later, at plan or JIT time), transitively;
- JIT: the JitSpecs of the modules pdserve builds (paged decode and prefill, page, norm,
  SiLU-and-mul, RoPE, sampling) give their source files, and generating them opens the
  templates and sources they are rendered or copied from; those and every header they
  ``#include`` (transitively, resolved on FlashInfer's include path) are kept, and every
  template (``*.jinja``) and header at the top of ``data/csrc``.

Writes {"python": [...], "data": [...]}: paths relative to the site dir.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import sys
from pathlib import Path

ENTRIES = ("flashinfer.decode", "flashinfer.prefill", "flashinfer.page", "flashinfer.norm",
           "flashinfer.activation", "flashinfer.rope", "flashinfer.sampling")
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def module_file(name: str, site: Path) -> Path | None:
    parts = name.split(".")
    for candidate in (site.joinpath(*parts).with_suffix(".py"),
                      site.joinpath(*parts, "__init__.py")):
        if candidate.is_file():
            return candidate
    return None


def imported_names(path: Path, package: str) -> set[str]:
    """flashinfer modules named by any import statement in ``path``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("flashinfer")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            if base.startswith("flashinfer"):
                names.add(base)
                names |= {f"{base}.{a.name}" for a in node.names}
    return names


def python_closure(site: Path) -> set[Path]:
    for name in ENTRIES:
        importlib.import_module(name)
    todo = [n for n in sys.modules if n == "flashinfer" or n.startswith("flashinfer.")]
    seen: set[str] = set()
    files: set[Path] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = module_file(name, site)
        if path is None:
            continue  # an attribute imported from a module, not a module
        files.add(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        todo += parents + sorted(imported_names(path, package) - seen)
    return files


OPENED: list[Path] = []


def _record_open(event: str, args: tuple[object, ...]) -> None:
    if event == "open" and isinstance(args[0], str | Path):
        path = Path(args[0])
        if "flashinfer" in path.parts and "data" in path.parts:
            OPENED.append(path)


def jit_sources() -> list[Path]:
    """The sources of the modules pdserve builds, and every file generating them read (the
    generators copy and render templates from ``data/csrc``: an audit hook sees each open)."""
    import torch
    from flashinfer.jit import activation, norm, page, rope, sampling
    from flashinfer.jit.attention import modules

    bf16 = torch.bfloat16
    sys.addaudithook(_record_open)
    specs = [
        modules.gen_batch_decode_module(bf16, bf16, bf16, torch.int32, 128, 128, 0, False,
                                        False),
        modules.gen_batch_prefill_module("fa2", bf16, bf16, bf16, torch.int32, 128, 128, 0,
                                         False, False, False),
        page.gen_page_module(), norm.gen_norm_module(),
        activation.gen_act_and_mul_module("silu"), rope.gen_rope_module(),
        sampling.gen_sampling_module(),
    ]
    return [*(Path(s) for spec in specs for s in spec.sources), *OPENED]


def include_closure(sources: list[Path], include_dirs: list[Path]) -> set[Path]:
    seen: set[Path] = set()
    todo = list(sources)
    while todo:
        path = todo.pop().resolve()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        for inc in INCLUDE.findall(path.read_text(encoding="utf-8", errors="replace")):
            for base in (path.parent, *include_dirs):
                if (base / inc).is_file():
                    todo.append(base / inc)
                    break
    return seen


def main() -> int:
    site, out = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
    sys.path.append(str(site))  # after PYTHONPATH: this Python's own tvm_ffi comes first
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0")
    data = site / "flashinfer" / "data"
    python = python_closure(site)
    include_dirs = [data / "include", data / "csrc", data / "cutlass" / "include",
                    data / "cutlass" / "tools" / "util" / "include", data / "spdlog" / "include",
                    data / "cccl" / "cub", data / "cccl" / "libcudacxx" / "include",
                    data / "cccl" / "thrust"]
    headers = include_closure(jit_sources(), include_dirs)
    csrc = data / "csrc"
    extra = [p for p in csrc.iterdir() if p.suffix in (".jinja", ".h", ".cuh", ".inc")]
    kept = {p.resolve() for p in (*headers, *extra)} | set(
        (data / "include").rglob("*")) | set((data / "spdlog").rglob("*"))
    in_data = sorted(str(p.relative_to(site)) for p in kept
                     if p.is_file() and p.resolve().is_relative_to(data.resolve()))
    json.dump({"python": sorted(str(p.relative_to(site)) for p in python), "data": in_data},
              out.open("w"), indent=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
