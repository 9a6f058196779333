"""Helpers for the engine-service tests: in-process servers on port 0 around a shared engine,
real service processes (parsing the ready line), and small gRPC call wrappers."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pdserve.engine.engine import Engine
from pdserve.kvd.bridge import KvBridge
from pdserve.proto.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from pdserve.server import make_server
from services.engine.config import EngineServiceConfig
from services.engine.instance import EngineInstance
from services.engine.server import servicers

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"pdserve (\w+) listening on ([\d.]+):(\d+)")


@functools.cache
def engine(model: str = "tiny", num_blocks: int = 64, tag: str = "", chunk: int = 512) -> Engine:
    """One engine per (model, size, tag, chunk), shared by the tests of a process."""
    cfg = EngineServiceConfig(num_blocks=num_blocks, max_num_batched_tokens=chunk)
    return Engine.from_model(model, cfg.engine_args())


@contextlib.asynccontextmanager
async def serve(config: EngineServiceConfig, eng: Engine,
                kvd_client: Any = None) -> AsyncIterator[Any]:
    """An in-process engine service (its servicers chosen by role) on a free port."""
    inst = EngineInstance(config, eng)
    svc = make_server("127.0.0.1", 0, servicers(inst))
    await svc.server.start()
    await inst.start(svc.port)
    if kvd_client is not None:
        inst.bridge = KvBridge(inst.aengine, kvd_client, "127.0.0.1:1")
        await inst.bridge.register()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}")
    try:
        yield Client(channel, inst)
    finally:
        await channel.close()
        await svc.server.stop(1.0)
        await inst.stop()


@dataclass
class Client:
    channel: grpc.aio.Channel
    instance: EngineInstance | None = None

    @property
    def prefill_stub(self) -> engine_pb2_grpc.PrefillStub:
        return engine_pb2_grpc.PrefillStub(self.channel)

    @property
    def decode_stub(self) -> engine_pb2_grpc.DecodeStub:
        return engine_pb2_grpc.DecodeStub(self.channel)

    @property
    def admin(self) -> engine_pb2_grpc.EngineStub:
        return engine_pb2_grpc.EngineStub(self.channel)

    async def stats(self) -> engine_pb2.EngineStats:
        return await self.admin.Stats(engine_pb2.EngineStatsRequest(), timeout=10)

    async def prefill(self, rid: str, prompt: list[int], max_tokens: int = 8,
                      destination: common_pb2.KvdEndpoint | None = None,
                      timeout: float = 30, **sampling: Any) -> engine_pb2.PrefillResponse:
        req = engine_pb2.PrefillRequest(
            meta=common_pb2.RequestMeta(request_id=rid), prompt_token_ids=prompt,
            sampling=greedy(max_tokens, **sampling), destination=destination)
        return await self.prefill_stub.Prefill(req, timeout=timeout)

    async def decode(self, rid: str, prompt: list[int], max_tokens: int = 8,
                     prefilled: engine_pb2.PrefillResponse | None = None,
                     timeout: float = 30, **sampling: Any) -> list[engine_pb2.DecodeChunk]:
        return [c async for c in self.decode_stream(rid, prompt, max_tokens, prefilled,
                                                   timeout, **sampling)]

    def decode_stream(self, rid: str, prompt: list[int], max_tokens: int = 8,
                      prefilled: engine_pb2.PrefillResponse | None = None,
                      timeout: float = 30, **sampling: Any) -> Any:
        req = engine_pb2.DecodeRequest(
            meta=common_pb2.RequestMeta(request_id=rid), prompt_token_ids=prompt,
            sampling=greedy(max_tokens, **sampling))
        if prefilled is not None:
            req.first_token_id = prefilled.first_token_id
            req.blocks.extend(prefilled.blocks)
            req.source.CopyFrom(prefilled.source)
        return self.decode_stub.Decode(req, timeout=timeout)


def greedy(max_tokens: int, **extra: Any) -> common_pb2.SamplingParams:
    fields = {"max_tokens": max_tokens, "temperature": 0.0, **extra}
    return common_pb2.SamplingParams(**fields)


def tokens_of(chunks: list[engine_pb2.DecodeChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


# -- real processes ---------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONPATH=f"{ROOT}:{ROOT / 'libs'}", PYTHONUNBUFFERED="1")
    env.pop("REDIS_URL", None)
    return env


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[str]
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def spawn_service(service: str, *args: str) -> subprocess.Popen[str]:
    """``python -m services.<service> --port 0 ...`` (not yet ready: see ``wait_ready``)."""
    cmd = [sys.executable, "-m", f"services.{service}", "--host", "127.0.0.1", "--port", "0",
           *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_ready(service: str, popen: subprocess.Popen[str]) -> Proc:
    """Parse the ready line for the bound port."""
    assert popen.stdout is not None and popen.stderr is not None
    line = popen.stdout.readline()
    match = READY.search(line)
    if match is None:
        popen.kill()
        _, err = popen.communicate(timeout=10)
        raise RuntimeError(f"{service} did not start: {line!r}; stderr:\n{err[-3000:]}")
    # Keep draining stdout/stderr so a chatty child never blocks on a full pipe.
    for stream in (popen.stdout, popen.stderr):
        _drain(stream)
    return Proc(service, popen, int(match.group(3)))


def start_service(service: str, *args: str) -> Proc:
    return wait_ready(service, spawn_service(service, *args))


def start_services(*specs: tuple[str, ...]) -> list[Proc]:
    """Start several services at once (model loading overlaps); ``(service, *flags)`` each."""
    popens = [(spec[0], spawn_service(*spec)) for spec in specs]
    procs: list[Proc] = []
    try:
        for service, popen in popens:
            procs.append(wait_ready(service, popen))
    except BaseException:
        for _, popen in popens:
            popen.kill()
        raise
    return procs


def _drain(stream: Any) -> None:
    import threading

    threading.Thread(target=lambda: [None for _ in stream], daemon=True).start()


def stop_all(procs: list[Proc]) -> None:
    """SIGTERM every process at once, then wait (each stops gracefully in parallel)."""
    for p in procs:
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
    for p in procs:
        p.stop()
