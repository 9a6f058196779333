"""The Kubernetes actuator against a fake API server: a real HTTP server in the test that
records each request and answers as the API server does; the official client talks real HTTP
to it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from pdserve.controller.actuator import ActuationError
from pdserve.controller.k8s import Deployments, KubernetesActuator, api_client
from pdserve.controller.optimizer import Plan

PREFIX = "/apis/apps/v1/namespaces/pdserve/deployments/"


class FakeApiServer(ThreadingHTTPServer):
    def __init__(self, replicas: dict[str, int]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.replicas = dict(replicas)
        self.requests: list[tuple[str, str, str, Any]] = []  # method, path, content type, body


class _Handler(BaseHTTPRequestHandler):
    server: FakeApiServer

    def log_message(self, *_: Any) -> None:
        pass

    def _answer(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _scale(self, name: str) -> dict[str, Any]:
        n = self.server.replicas[name]
        return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                "metadata": {"name": name, "namespace": "pdserve"},
                "spec": {"replicas": n}, "status": {"replicas": n}}

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.server.requests.append((self.command, self.path,
                                     self.headers.get("Content-Type", ""), body))
        name = self.path.removeprefix(PREFIX).split("/")[0].split("?")[0]
        if not self.path.startswith(PREFIX) or not self.path.split("?")[0].endswith("/scale"):
            return self._answer(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
        if name not in self.server.replicas:
            return self._answer(404, {"kind": "Status", "code": 404, "reason": "NotFound",
                                      "message": f'deployments.apps "{name}" not found'})
        if self.command == "PATCH":
            self.server.replicas[name] = body["spec"]["replicas"]
        return self._answer(200, self._scale(name))

    do_GET = do_PATCH = _handle


@pytest.fixture
def api_server() -> Iterator[FakeApiServer]:
    server = FakeApiServer({"prefill": 2, "decode": 2})
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _actuator(server: FakeApiServer, dry_run: bool = False,
              deployments: Deployments = Deployments()) -> KubernetesActuator:
    host = f"http://127.0.0.1:{server.server_address[1]}"
    return KubernetesActuator(api_client(host=host), deployments, dry_run)


async def test_scales_through_the_scale_subresource(api_server: FakeApiServer) -> None:
    act = _actuator(api_server)
    changed = await act.apply(Plan(3, 1))
    assert [c.address for c in changed] == ["prefill", "decode"]
    patches = [(m, p, ct, b) for m, p, ct, b in api_server.requests if m == "PATCH"]
    assert [(p, b) for _, p, _, b in patches] == [
        (PREFIX + "prefill/scale", {"spec": {"replicas": 3}}),
        (PREFIX + "decode/scale", {"spec": {"replicas": 1}})]
    assert all(ct.endswith("patch+json") for _, _, ct, _ in patches)
    assert api_server.replicas == {"prefill": 3, "decode": 1}
    api_server.requests.clear()
    assert await act.apply(Plan(3, 1)) == []  # already so: read, no patch
    assert [m for m, *_ in api_server.requests] == ["GET", "GET"]


async def test_dry_run_only_logs(api_server: FakeApiServer,
                                 caplog: pytest.LogCaptureFixture) -> None:
    act = _actuator(api_server, dry_run=True)
    with caplog.at_level("INFO"):
        assert await act.apply(Plan(1, 3)) == []
    assert api_server.requests == []
    assert act.calls == [("prefill", 1), ("decode", 3)]
    assert sum("would scale" in r.getMessage() for r in caplog.records) == 2


async def test_colocated_plans_and_api_errors_are_named(api_server: FakeApiServer) -> None:
    with pytest.raises(ActuationError, match="a colocated plan needs a colocated Deployment"):
        await _actuator(api_server).apply(Plan(0, 0, 4))
    act = _actuator(api_server, deployments=Deployments(colocated="colocated"))
    with pytest.raises(ActuationError,
                       match="read scale of deployment pdserve/colocated failed: 404"):
        await act.apply(Plan(0, 0, 4))
    api_server.replicas["colocated"] = 0
    await act.apply(Plan(0, 0, 4))
    assert api_server.replicas == {"prefill": 0, "decode": 0, "colocated": 4}
