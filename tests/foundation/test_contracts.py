"""The v1 contracts change only compatibly: ``buf lint`` and ``buf breaking`` (as ``make lint``
runs them), and the breaking check itself shown to fail on incompatible edits of a copy."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASELINE = ROOT / "protos" / "v1-baseline.json"
COMMON = "pdserve/v1/common.proto"
ROUTER = "pdserve/v1/router.proto"


@pytest.fixture(scope="module")
def buf() -> str:
    local = ROOT / "node_modules" / ".bin" / "buf"
    exe = str(local) if local.exists() else shutil.which("buf")
    if exe is None:
        pytest.fail("buf not found: run `make setup` (npm ci installs @bufbuild/buf)")
    return exe


def _run(buf: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([buf, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def _copy(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(ROOT / "protos" / "pdserve", tmp_path / "protos" / "pdserve")
    return tmp_path


def _edit(root: Path, name: str, old: str, new: str) -> None:
    path = root / "protos" / name
    text = path.read_text()
    assert old in text, f"{old!r} not in {name}"
    path.write_text(text.replace(old, new, 1))


def test_lint_and_breaking_pass_on_the_repo(buf: str) -> None:
    lint = _run(buf, ROOT, "lint")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    breaking = _run(buf, ROOT, "breaking", "--against", str(BASELINE))
    assert breaking.returncode == 0, breaking.stdout + breaking.stderr


@pytest.mark.parametrize(("name", "old", "new", "reported"), [
    (COMMON, "uint32 max_tokens = 1;", "uint32 max_new_tokens = 1;",
     'Field "1" on message "SamplingParams" changed name from "max_tokens" to "max_new_tokens"'),
    (COMMON, "optional float temperature = 2;", "optional float temperature = 42;",
     'Previously present field "2" with name "temperature" on message "SamplingParams" was '
     "deleted"),
    (COMMON, "optional int32 top_k = 4;", "optional int64 top_k = 4;",
     'Field "4" with name "top_k" on message "SamplingParams" changed type from "int32" to '
     '"int64"'),
    (ROUTER, "  rpc ClusterState(ClusterStateRequest) returns (ClusterStateResponse);\n", "",
     'Previously present RPC "ClusterState" on service "Router" was deleted'),
    (ROUTER, "service Router {", "service RouterService {",
     'Previously present service "Router" was deleted'),
], ids=["rename-field", "renumber-field", "change-type", "delete-rpc", "rename-service"])
def test_breaking_fails_on_an_incompatible_change(buf: str, tmp_path: Path, name: str, old: str,
                                                  new: str, reported: str) -> None:
    root = _copy(tmp_path)
    assert _run(buf, root, "breaking", "--against", str(BASELINE)).returncode == 0
    _edit(root, name, old, new)
    result = _run(buf, root, "breaking", "--against", str(BASELINE))
    assert result.returncode != 0
    assert reported in result.stdout, result.stdout + result.stderr


def test_breaking_accepts_a_compatible_addition(buf: str, tmp_path: Path) -> None:
    root = _copy(tmp_path)
    _edit(root, COMMON, "  optional uint32 logprobs = 10;\n",
          "  optional uint32 logprobs = 10;\n  // Locally typical sampling mass in (0, 1].\n"
          "  optional float typical_p = 41;\n")
    result = _run(buf, root, "breaking", "--against", str(BASELINE))
    assert result.returncode == 0, result.stdout + result.stderr


def test_lint_holds_new_services_to_the_standard_rules(buf: str, tmp_path: Path) -> None:
    """The v1 names are exempt one by one (buf:lint:ignore at each), not by a rule turned off."""
    root = _copy(tmp_path)
    _edit(root, ROUTER, "message ChatMessage {",
          "// Admin calls.\nservice Admin {\n  // Reload.\n"
          "  rpc Reload(ListModelsRequest) returns (ListModelsResponse);\n}\n\n"
          "message ChatMessage {")
    result = _run(buf, root, "lint")
    assert result.returncode != 0
    assert 'Service name "Admin" should be suffixed with "Service".' in result.stdout
    assert 'RPC request type "ListModelsRequest" should be named "ReloadRequest"' in result.stdout
