"""The deployment files, checked offline: the Dockerfile (hadolint, one slim stage per service,
every dependency pinned), the Kustomize overlays (rendered with kubectl's kustomize and checked
with kubernetes-validate --strict), the compose file and the Grafana dashboard; all of them in
step with the services' settings, ports and metric names."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from pdserve.cli import env_vars

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SERVICES = ("gateway", "router", "prefill", "decode", "kvd")
GRPC_PORTS = {"router": 50051, "prefill": 50061, "decode": 50071, "kvd": 50081}


def _tool(name: str) -> str:
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found is not None, f"{name} missing: see the README's test prerequisites"
    return found


# --- images -----------------------------------------------------------------------------------

def _stages() -> dict[str, tuple[str, str]]:
    """Each named stage of the Dockerfile: (the image or stage it starts from, its text)."""
    text = (DEPLOY / "Dockerfile").read_text()
    parts = re.split(r"^FROM (\S+) AS (\S+)\n", text, flags=re.M)
    return {parts[i + 1]: (parts[i], parts[i + 2]) for i in range(1, len(parts), 3)}


def _chain(stage: str) -> str:
    """A stage's text with that of every stage it builds on."""
    stages = _stages()
    text = ""
    while stage in stages:
        stage, body = stages[stage]
        text = body + text
    return text


def _requirements(name: str) -> dict[str, Requirement]:
    lines = (DEPLOY / "requirements" / f"{name}.txt").read_text().splitlines()
    reqs = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    return {r.name.lower(): r for r in reqs}


def test_one_slim_image_per_service() -> None:
    stages = _stages()
    for service in SERVICES:
        body = _chain(service)
        assert f'ENTRYPOINT ["python", "-m", "services.{service}", "--host", "0.0.0.0"' in body
        assert "USER 10001" in stages[service][1] or "USER 10001" in body
        torch = "torch==" in body
        ucx = "requirements/kvd.txt" in body
        assert torch == (service in ("prefill", "decode")), service
        assert ucx == (service == "kvd"), service
        assert "torch==2.13.0+cpu" in body or not torch
    for gpu in ("gpu-prefill", "gpu-decode"):
        body = _chain(gpu)
        assert "torch==2.13.0+cu130" in body and "requirements/gpu.txt" in body
        assert '"--device", "cuda"' in body and "requirements/kvd.txt" not in body
    text = (DEPLOY / "Dockerfile").read_text()
    assert "[dev]" not in text and "[test]" not in text and "grpcio-tools" not in _chain("runtime")


def test_every_pip_install_is_pinned() -> None:
    for line in re.findall(r"pip install ([^\n&]*)", (DEPLOY / "Dockerfile").read_text()):
        words = [w for w in line.replace("\\", " ").split() if not w.startswith("-")]
        for word in words:
            if word.startswith(("/tmp/requirements/", "/app", "https://")):
                continue
            assert re.fullmatch(r"[\w.-]+==[\w.+]+", word), f"unpinned: {word!r} in {line!r}"
    for name in ("runtime", "kvd", "engine", "gpu", "controller"):
        for req in _requirements(name).values():
            assert len(req.specifier) == 1 and next(iter(req.specifier)).operator == "==", req


def test_requirements_cover_pyproject_exactly_once() -> None:
    """Every runtime dependency of pyproject.toml is pinned in exactly one of the image
    requirement files (torch by the Dockerfile, per target), within the project's range."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {r.name.lower(): r for r in map(Requirement, project["dependencies"])}
    for extra in ("gpu", "controller"):
        declared |= {r.name.lower(): r for r in map(Requirement,
                                                    project["optional-dependencies"][extra])}
    pinned: dict[str, Requirement] = {}
    for name in ("runtime", "kvd", "engine", "gpu", "controller"):
        for key, req in _requirements(name).items():
            assert key not in pinned, f"{key} pinned twice"
            pinned[key] = req
    assert set(pinned) == set(declared) - {"torch"}
    for key, req in pinned.items():
        version = next(iter(req.specifier)).version
        assert declared[key].specifier.contains(version), (key, version, declared[key])
    assert str(declared["torch"].specifier) == "==2.13.0"


_BLOCK = """
import importlib.abc, sys
blocked = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not in this image)")
sys.meta_path.insert(0, Block())
import importlib
for module in sys.argv[2].split(","):
    importlib.import_module(module)
"""


@pytest.mark.parametrize(("modules", "absent"), [
    ("services.gateway.__main__,services.router.__main__", "torch,safetensors,transformers,ucxx"),
    ("services.kvd.__main__", "torch,safetensors,transformers"),
    ("services.prefill.__main__,services.decode.__main__", "ucxx,transformers"),
])
def test_each_image_runs_without_what_it_leaves_out(modules: str, absent: str) -> None:
    proc = subprocess.run([sys.executable, "-c", _BLOCK, absent, modules], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_dockerfile_is_hadolint_clean_without_ignores() -> None:
    path = DEPLOY / "Dockerfile"
    assert "hadolint ignore" not in path.read_text()
    proc = subprocess.run([_tool("hadolint"), str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_bake_builds_every_final_target() -> None:
    text = (DEPLOY / "docker-bake.hcl").read_text()
    targets = set(re.findall(r'^target "([\w-]+)"', text, flags=re.M)) - {"_common"}
    assert targets == set(SERVICES) | {"gpu-prefill", "gpu-decode"}
    assert targets <= set(_stages())
    for target in targets:
        assert f'target   = "{target}"' in text
    assert "docker-bake.hcl" in (ROOT / "Makefile").read_text()


# --- Kubernetes --------------------------------------------------------------------------------

def _render(tmp_path: Path, overlay: str, components: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """An overlay rendered by kubectl's kustomize, with extra components added."""
    source = DEPLOY / "k8s" / "overlays" / overlay
    if components:
        work = tmp_path / "k8s"
        shutil.copytree(DEPLOY / "k8s", work)
        source = work / "overlays" / overlay
        kustomization = yaml.safe_load((source / "kustomization.yaml").read_text())
        kustomization["components"] = [f"../../components/{c}" for c in components]
        (source / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    proc = subprocess.run([_tool("kubectl"), "kustomize", str(source)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def _validate(tmp_path: Path, docs: list[dict[str, Any]]) -> None:
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    proc = subprocess.run([_tool("kubernetes-validate"), "--strict", "--quiet", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _workloads(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "DaemonSet")}


def _containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for w in _workloads(docs).values()
            for c in w["spec"]["template"]["spec"]["containers"]}


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_overlays_render_and_pass_strict_validation(tmp_path: Path, overlay: str) -> None:
    docs = _render(tmp_path, overlay)
    _validate(tmp_path, docs)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert set(_workloads(docs)) == set(SERVICES) | {"redis"}
    assert _workloads(docs)["kvd"]["kind"] == "DaemonSet"
    assert ("PersistentVolumeClaim", "models") in kinds
    for name in ("router", "gateway", "prefill", "decode"):
        assert ("PodDisruptionBudget", name) in kinds, name
    assert all(d["metadata"].get("namespace") == "pdserve"
               for d in docs if d["kind"] != "Namespace")


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_every_container_has_resources_probes_and_known_settings(tmp_path: Path,
                                                                 overlay: str) -> None:
    known = set(env_vars())
    for name, container in _containers(_render(tmp_path, overlay)).items():
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][kind]), (name, kind)
        probes = {"readinessProbe", "livenessProbe"} | ({"startupProbe"} if name != "redis"
                                                        else set())
        assert probes <= set(container), (name, probes - set(container))
        if name in GRPC_PORTS:
            for probe in probes:
                assert container[probe]["grpc"]["port"] == GRPC_PORTS[name], (name, probe)
        ours = {e["name"] for e in container.get("env", [])
                if e["name"].startswith("PDSERVE_") or e["name"] == "REDIS_URL"}
        assert ours <= known, (name, ours - known)


def test_secrets_referenced_are_the_ones_make_secrets_writes(tmp_path: Path) -> None:
    docs = _render(tmp_path, "cpu")
    keys = {(ref["name"], ref["key"]) for c in _containers(docs).values()
            for e in c.get("env", []) if (ref := e.get("valueFrom", {}).get("secretKeyRef"))}
    script = (DEPLOY / "make-secrets.sh").read_text()
    assert {name for name, _ in keys} == {"pdserve-secrets"}
    for _, key in keys:
        assert f"--from-file=deploy/secrets/{key}" in script, key
    volumes = [v for w in _workloads(docs).values() for v in w["spec"]["template"]["spec"]
               .get("volumes", []) if "secret" in v]
    assert [v["secret"]["secretName"] for v in volumes] == ["pdserve-api-keys"]
    assert "pdserve-api-keys" in script and "--from-file=keys=deploy/secrets/keys" in script


def test_metrics_are_scraped_where_the_services_serve_them(tmp_path: Path) -> None:
    """Prometheus annotations name each service's metrics port: its gRPC port + 1000 (the
    services' default), and the container exposes it."""
    for name, workload in _workloads(_render(tmp_path, "cpu")).items():
        if name not in GRPC_PORTS:
            continue
        template = workload["spec"]["template"]
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(GRPC_PORTS[name] + 1000)
        (container,) = template["spec"]["containers"]
        assert {"containerPort": GRPC_PORTS[name] + 1000, "name": "metrics"} in container["ports"]
    (monitor,) = yaml.safe_load_all(
        (DEPLOY / "k8s" / "components" / "prometheus-operator" / "podmonitors.yaml").read_text())
    (selects,) = monitor["spec"]["selector"]["matchExpressions"]
    assert set(selects["values"]) == set(GRPC_PORTS)
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_autoscaling_scales_the_engines_on_a_documented_queue_metric(tmp_path: Path) -> None:
    docs = _render(tmp_path, "cpu")
    documented = _documented_metrics()
    scalers = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs
               if d["kind"] == "HorizontalPodAutoscaler"}
    assert set(scalers) == {"prefill", "decode"}
    for hpa in scalers.values():
        (metric,) = hpa["spec"]["metrics"]
        assert metric["pods"]["metric"]["name"] in documented


def test_gpu_overlay_runs_the_cuda_engines_one_gpu_each(tmp_path: Path) -> None:
    containers = _containers(_render(tmp_path, "gpu"))
    for name in ("prefill", "decode"):
        container = containers[name]
        assert container["image"] == f"pdserve/gpu-{name}:0.1.0"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[f"PDSERVE_{name.upper()}_DEVICE"] == "cuda"
    cpu = _containers(_render(tmp_path / "cpu", "cpu"))
    assert cpu["prefill"]["image"] == "pdserve/prefill:0.1.0"
    assert "nvidia.com/gpu" not in cpu["prefill"]["resources"]["limits"]


def test_kvd_pool_memlock_rdma_and_host_network_switches(tmp_path: Path) -> None:
    base = _workloads(_render(tmp_path, "gpu"))["kvd"]["spec"]["template"]["spec"]
    (kvd,) = base["containers"]
    assert "IPC_LOCK" in kvd["securityContext"]["capabilities"]["add"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in kvd["volumeMounts"]
    assert not base.get("hostNetwork") and "rdma/hca_shared_devices_a" not in kvd["resources"][
        "limits"]
    docs = _render(tmp_path, "gpu", ("rdma", "host-network"))
    _validate(tmp_path, docs)
    workloads = _workloads(docs)
    spec = workloads["kvd"]["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["containers"][0]["resources"]["limits"]["rdma/hca_shared_devices_a"] == "1"
    for name in ("prefill", "decode"):
        assert workloads[name]["spec"]["template"]["spec"]["hostNetwork"] is True


# --- compose, dashboard ------------------------------------------------------------------------

def test_compose_runs_the_same_images_with_known_settings() -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == set(SERVICES) | {"redis"}
    known = set(env_vars())
    script = (DEPLOY / "make-secrets.sh").read_text()
    for name in SERVICES:
        service = services[name]
        assert service["image"] == f"pdserve/{name}:${{PDSERVE_TAG:-0.1.0}}"
        ours = {k for k in service["environment"] if k.startswith("PDSERVE_") or k == "REDIS_URL"}
        assert ours <= known, (name, ours - known)
        for secret in service.get("secrets", []):
            assert compose["secrets"][secret]["file"] == f"../secrets/{secret}"
            assert secret in script
    for engine in ("prefill", "decode"):
        assert services[engine]["ipc"] == "service:kvd"
    assert services["kvd"]["ipc"] == "shareable" and services["kvd"]["cap_add"] == ["IPC_LOCK"]


def _documented_metrics() -> set[str]:
    text = (ROOT / "docs" / "observability.md").read_text()
    return set(re.findall(r"^\| \w+ \| `(pdserve_\w+)` \|", text, flags=re.M))


def test_the_dashboard_shows_documented_metrics_only() -> None:
    """Every series the Grafana dashboard queries is one the services serve (documented, and
    checked on the live services by tests/e2e/test_observability.py)."""
    dashboard = json.loads((DEPLOY / "grafana" / "pdserve.json").read_text())
    documented = _documented_metrics()
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\bpdserve_\w+", target["expr"]):
                used.add(re.sub(r"_(bucket|sum|count)$", "", name))
    assert used and used <= documented, used - documented
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("time to first token", "inter-token", "time per output token", "goodput",
                  "queue depth", "kv usage", "prefix", "transfer throughput",
                  "transfer latency"):
        assert topic in titles, topic
