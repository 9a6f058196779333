"""Deployment files stay in step with the services: one image target and one workload each."""

from __future__ import annotations

import re
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
