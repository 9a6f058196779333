"""The code's shape holds: no import cycle, libraries never import services, every setting and
``PDSERVE_*`` variable declared once, and the runtime installs and imports without the
benchmark extra."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve import cli, env

ROOT = Path(__file__).resolve().parents[2]
CODE_ROOTS = {"pdserve": ROOT / "libs" / "pdserve",
              "pdserve_bench": ROOT / "libs" / "pdserve_bench",
              "services": ROOT / "services"}


def _modules() -> dict[str, Path]:
    """Every first-party module name -> its file (generated protobuf stubs left out)."""
    out = {}
    for top, root in CODE_ROOTS.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            if "proto" in rel.parts:
                continue
            parts = [top, *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(path: Path, name: str, known: dict[str, Path]) -> Iterator[str]:
    """First-party modules ``name`` imports anywhere in its file (function-local included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: set(_imports(path, name, known)) for name, path in known.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle() -> None:
    graph = _graph()
    assert len(graph) > 100
    assert "services.engine.instance" in graph["services.prefill.servicer"]  # the graph is real
    assert _cycles(graph) == []


def test_libraries_never_import_services() -> None:
    graph = _graph()
    bad = {m: sorted(t for t in targets if t.startswith("services"))
           for m, targets in graph.items() if m.startswith("pdserve")}
    assert {m: t for m, t in bad.items() if t} == {}
    # and the runtime never imports the benchmark extra
    runtime = [m for m in graph if not m.startswith("pdserve_bench")]
    assert [m for m in runtime if any(t.startswith("pdserve_bench") for t in graph[m])] == []


def test_prefill_and_decode_do_not_import_each_other() -> None:
    graph = _graph()
    for a, b in (("services.prefill", "services.decode"), ("services.decode", "services.prefill")):
        assert not [m for m in graph if m.startswith(a) and any(t.startswith(b) for t in graph[m])]


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _configs() -> list[type[env.ServiceConfig]]:
    return [cli._load(target) for target in cli.CONFIGS]


def test_every_config_field_is_a_declared_setting_with_its_env_twin() -> None:
    for cls in _configs():
        fields = dataclasses.fields(cls)
        assert fields and all("setting" in f.metadata for f in fields), cls
        flags = env.flags_of(cls)
        assert [f.dest for f in flags] == [f.name for f in fields]
        for f in flags:
            assert f.env in ("REDIS_URL", f"PDSERVE_{cls.SERVICE.upper()}_{f.dest.upper()}")
            # the default passes its own kind: the one check that runs on flags and in code
            assert f.setting.kind.check(f.default) == f.default


def _string_constants(path: Path) -> Iterator[tuple[int, str]]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_variable_names_are_spelled_only_in_the_declaration() -> None:
    """A ``PDSERVE_*`` (or REDIS_URL) name written out anywhere else would be a second
    declaration, or a read that bypasses the one module."""
    declaration = ROOT / "libs" / "pdserve" / "env.py"
    found = [f"{path.relative_to(ROOT)}:{line}: {value}"
             for path in _modules().values() if path != declaration
             for line, value in _string_constants(path)
             if value == "REDIS_URL" or (value.startswith("PDSERVE_") and value.isupper())]
    assert found == []


def test_pdserve_env_lists_every_declared_variable() -> None:
    listed = cli.env_vars()
    for cls in _configs():
        for f in env.flags_of(cls):
            assert listed[f.env] == f.setting.kind.accepted
    assert set(env.COMMON_VARS) <= set(listed)


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"block_size": 0}, "--block-size: invalid value 0 (accepted: an integer 1..1024)"),
    ({"block_size": 2048}, "--block-size: invalid value 2048 (accepted: an integer 1..1024)"),
    ({"poll_interval": 0.0}, "--poll-interval: invalid value 0.0"),
    ({"prefill": ("nowhere",)}, "--prefill: invalid value ('nowhere',)"),
])
def test_a_config_built_in_code_gets_the_flags_checks(kwargs: dict[str, object],
                                                      needle: str) -> None:
    from services.router.config import RouterConfig

    with pytest.raises(env.ConfigError) as err:
        RouterConfig(decode=("127.0.0.1:1",), **kwargs)  # type: ignore[arg-type]
    assert needle in str(err.value)


# Importing every runtime module with the benchmark extra made unimportable.
_BLOCKED_IMPORT = """
import importlib, importlib.abc, pkgutil, sys
BLOCKED = ("matplotlib", "httpx", "pdserve_bench")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
sys.meta_path.insert(0, Block())
import pdserve, services
GPU_EXTRA = ("pdserve.attention.flashinfer_backend",)  # the gpu extra's, imported lazily
names = [m.name for pkg in (pdserve, services)
         for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")
         if m.name not in GPU_EXTRA]
for name in names:
    importlib.import_module(name)
assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED]
print(len(names))
"""


def test_every_runtime_module_imports_without_the_bench_extra() -> None:
    proc = subprocess.run([sys.executable, "-c", _BLOCKED_IMPORT], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.strip()) > 80


def test_pdserve_bench_without_the_extra_says_how_to_get_it() -> None:
    code = ("import importlib.util, sys\n"
            "real = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda n, *a: None if n == 'matplotlib' else real(n, *a)\n"
            "from pdserve.cli import main\n"
            "sys.exit(main(['bench', 'engine']))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert ("pdserve bench: error: the benchmarks are an optional extra and matplotlib cannot "
            "be imported; install it with pip install 'pdserve[bench]'") in proc.stderr


def test_the_wheel_pulls_matplotlib_only_with_the_bench_extra(tmp_path: Path) -> None:
    """What ``pip install .`` installs: the built wheel's own metadata."""
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("pdserve-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        requires = [line.split(":", 1)[1].strip() for line in zf.read(meta).decode().splitlines()
                    if line.startswith("Requires-Dist:")]
    by_name = {r.split(";")[0].split(">")[0].split("=")[0].strip(): r for r in requires}
    assert by_name["matplotlib"].endswith('extra == "bench"')
    assert by_name["httpx"].endswith('extra == "bench"')
    assert 'extra ==' not in by_name["grpcio"]


_NO_TORCH = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "transformers", "safetensors"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
sys.meta_path.insert(0, Block())
import services.router.__main__, services.kvd.__main__, services.gateway.__main__
from services.router.model import load_model_spec
print(load_model_spec("tiny").fingerprint)
"""


def test_router_kvd_and_gateway_run_without_torch() -> None:
    """Their images carry no torch: the router reads a model's tokenizer and fingerprint
    from its files, the kvd moves bytes, the gateway speaks HTTP."""
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "tiny@0"
