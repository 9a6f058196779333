"""The controller's Kubernetes component renders into both overlays, passes strict validation
and grants the router exactly get/patch on the engine Deployments' scale; the router image (and
only it) carries the kubernetes client that ``--controller kubernetes`` imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.foundation.test_deploy import _BLOCK, ROOT, _chain, _render, _validate, _workloads


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_controller_component_grants_scale_only(tmp_path: Path, overlay: str) -> None:
    docs = _render(tmp_path, overlay, ("controller",))
    _validate(tmp_path, docs)
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    role = by_kind[("Role", "pdserve-controller")]
    assert role["metadata"]["namespace"] == "pdserve"
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments/scale"],
                              "resourceNames": ["prefill", "decode"], "verbs": ["get", "patch"]}]
    binding = by_kind[("RoleBinding", "pdserve-controller")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pdserve-controller",
                                    "namespace": "pdserve"}]
    assert all(d["metadata"].get("namespace") == "pdserve"
               for d in docs if d["kind"] != "Namespace")
    assert ("ServiceAccount", "pdserve-controller") in by_kind
    router = _workloads(docs)["router"]["spec"]["template"]["spec"]
    assert router["serviceAccountName"] == "pdserve-controller"
    assert not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]  # no second scaler


def test_the_router_image_and_no_other_installs_the_controller_extra() -> None:
    assert "-r /tmp/requirements/controller.txt" in _chain("router")
    for image in ("gateway", "kvd", "prefill", "decode", "gpu-prefill", "gpu-decode"):
        assert "controller.txt" not in _chain(image), image


def test_the_kubernetes_back_end_imports_in_the_router_image() -> None:
    # What the router image lacks (torch, the model stack, UCX) is blocked; the k8s actuator and
    # the kubernetes client it drives must still import.
    modules = "services.router.__main__,pdserve.controller.k8s,kubernetes.client"
    proc = subprocess.run([sys.executable, "-c", _BLOCK, "torch,safetensors,transformers,ucxx",
                           modules], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
