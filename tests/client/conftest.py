"""Client test fixtures: a real router server in-process whose only engine is down (every
Generate is UNAVAILABLE, the other calls work), and TLS certificates made with openssl."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdserve.server import make_server
from services.launcher import free_port
from services.router.__main__ import build_router
from services.router.config import RouterConfig
from services.router.core import Router
from services.router.model import load_model_spec
from services.router.servicer import servicers


@dataclass
class LocalRouter:
    router: Router
    address: str
    invocation_metadata: list[dict[str, Any]]


class Recorder(grpc.aio.ServerInterceptor):
    """Keeps every call's metadata (to see what credentials put on the wire)."""

    def __init__(self, seen: list[dict[str, Any]]) -> None:
        self.seen = seen

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        self.seen.append(dict(details.invocation_metadata or ()))
        return await continuation(details)


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA and a server certificate for localhost / 127.0.0.1 signed by it."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("openssl not found on PATH (Debian: apt-get install openssl)")
    d = tmp_path_factory.mktemp("certs")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for cmd in (["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
                 "-subj", "/CN=pdserve-test-ca"],
                ["req", *ec, "-keyout", "server.key", "-out", "server.csr",
                 "-subj", "/CN=localhost"],
                ["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "san.ext"]):
        subprocess.run([openssl, *cmd], cwd=d, check=True, capture_output=True)
    return d


async def _serve(certs: Path | None) -> AsyncIterator[LocalRouter]:
    # max_wait=0: the dead engine never comes back here, so the router answers at once
    # instead of waiting for a restart (its default, up to 30 s a request). The health check
    # timeout follows the poll interval (at least 2 s): 2 s, not 30, for the dead engine.
    config = RouterConfig(port=0, decode=(f"127.0.0.1:{free_port()}",), poll_interval=2.0,
                          max_wait=0.0)
    router = build_router(config, load_model_spec("tiny"))
    seen: list[dict[str, Any]] = []
    if certs is None:  # as `python -m services.router` serves
        svc = make_server("127.0.0.1", 0, servicers(router))
        server, port = svc.server, svc.port
    else:  # the same servicers behind TLS, recording call metadata
        server = grpc.aio.server(interceptors=[Recorder(seen)])
        for add, servicer, _ in servicers(router):
            add(servicer, server)
        creds = grpc.ssl_server_credentials([((certs / "server.key").read_bytes(),
                                              (certs / "server.pem").read_bytes())])
        port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    await router.start()  # one poll: the only engine is down
    yield LocalRouter(router, f"127.0.0.1:{port}", seen)
    await server.stop(0)
    await router.stop()


@pytest.fixture
async def local_router() -> AsyncIterator[LocalRouter]:
    async for r in _serve(None):
        yield r


@pytest.fixture
async def tls_router(certs: Path) -> AsyncIterator[LocalRouter]:
    async for r in _serve(certs):
        yield r
