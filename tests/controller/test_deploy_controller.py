"""The controller's Kubernetes component renders into both overlays, passes strict validation
and grants the router exactly get/patch on the engine Deployments' scale."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.foundation.test_deploy import _render, _validate, _workloads


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
