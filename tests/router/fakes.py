"""Scripted engines and a prefix index for router tests: real grpc.aio servers on loopback.

A ``FakeEngine`` serves Prefill, Decode, Engine and grpc health like an engine would, answers
at once, and records what it was sent (requests, metadata, deadlines, aborts, cancellations).
Scripts are lists consumed one call at a time: ``prefill_errors`` / ``decode_errors`` hold a
status code (fail) or None (behave) per call. ``pause()`` makes it answer nothing, health checks
included, until ``resume()``, as a SIGSTOP'd process (``decode_pause_after``: by itself, after
that many chunks of a stream).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.proto.v1 import common_pb2, engine_pb2, engine_pb2_grpc

ROLES = {"prefill": common_pb2.ROLE_PREFILL, "decode": common_pb2.ROLE_DECODE,
         "colocated": common_pb2.ROLE_COLOCATED}


@dataclass
class Seen:
    prefills: list[engine_pb2.PrefillRequest] = field(default_factory=list)
    decodes: list[engine_pb2.DecodeRequest] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    time_remaining: list[float | None] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)  # request ids whose stream was cancelled


class _PausableHealth(health.aio.HealthServicer):
    def __init__(self, running: asyncio.Event) -> None:
        super().__init__()
        self.running = running

    async def Check(self, request: health_pb2.HealthCheckRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        await self.running.wait()
        return await super().Check(request, context)


class FakeEngine(engine_pb2_grpc.PrefillServicer, engine_pb2_grpc.DecodeServicer,
                 engine_pb2_grpc.EngineServicer):
    def __init__(self, name: str, role: str, node: str = "", num_tokens: int = 3,
                 first_token: int = 7) -> None:
        self.name, self.role, self.node = name, role, node or f"node-{name}"
        self.num_tokens, self.first_token = num_tokens, first_token
        self.prefill_errors: list[grpc.StatusCode | None] = []
        self.decode_errors: list[grpc.StatusCode | None] = []
        self.decode_fail_after: int | None = None  # chunks streamed before failing
        self.decode_hang = False  # stream one chunk, then wait until cancelled
        self.prefill_hang = False
        self.prefill_finish = common_pb2.FINISH_REASON_UNSPECIFIED
        # awaited with each PrefillRequest, before it answers
        self.on_prefill: Callable[[engine_pb2.PrefillRequest], Awaitable[None]] | None = None
        self.stats = engine_pb2.EngineStats()
        self.stats_delay = 0.0
        self.seen = Seen()
        self.server: grpc.aio.Server | None = None
        self.running = asyncio.Event()  # cleared: paused
        self.running.set()
        self.decode_pause_after: int | None = None  # chunks streamed before pausing itself
        self.decode_first_delay = 0.0  # seconds before the first chunk (alive, answering)
        self.health = _PausableHealth(self.running)
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> FakeEngine:
        self.server = grpc.aio.server()
        engine_pb2_grpc.add_PrefillServicer_to_server(self, self.server)
        engine_pb2_grpc.add_DecodeServicer_to_server(self, self.server)
        engine_pb2_grpc.add_EngineServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port or self.port}")
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        return self

    def pause(self) -> None:
        self.running.clear()

    def resume(self) -> None:
        self.running.set()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None

    def _record(self, context: grpc.aio.ServicerContext) -> None:
        md = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        self.seen.metadata.append(md)
        self.seen.time_remaining.append(context.time_remaining())

    async def Prefill(self, request: engine_pb2.PrefillRequest,  # noqa: N802
                      context: grpc.aio.ServicerContext) -> engine_pb2.PrefillResponse:
        self.seen.prefills.append(request)
        self._record(context)
        await self.running.wait()
        error = self.prefill_errors.pop(0) if self.prefill_errors else None
        if error is not None:
            await context.abort(error, f"{self.name}: scripted {error.name}")
        if self.prefill_hang:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.seen.cancelled.append(request.meta.request_id)
                raise
        if self.on_prefill is not None:
            await self.on_prefill(request)
        bs = 4
        blocks = [common_pb2.BlockRef(hash=i.to_bytes(32, "big"), node_id=self.node)
                  for i in range(len(request.prompt_token_ids) // bs)]
        return engine_pb2.PrefillResponse(
            first_token_id=self.first_token, blocks=blocks, text=f"<{self.first_token}>",
            cached_tokens=0, finish_reason=self.prefill_finish,
            model_version=self.stats.model_version,
            source=common_pb2.KvdEndpoint(node_id=self.node, address="127.0.0.1:1"))

    async def Decode(self, request: engine_pb2.DecodeRequest,  # noqa: N802
                     context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.DecodeChunk]:
        self.seen.decodes.append(request)
        self._record(context)
        error = self.decode_errors.pop(0) if self.decode_errors else None
        if error is not None:
            await context.abort(error, f"{self.name}: scripted {error.name}")
        try:
            await asyncio.sleep(self.decode_first_delay)
            for i in range(self.num_tokens):
                if i == self.decode_pause_after:
                    self.pause()
                await self.running.wait()
                if self.decode_fail_after is not None and i == self.decode_fail_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}: died")
                last = i == self.num_tokens - 1 and not self.decode_hang
                yield engine_pb2.DecodeChunk(
                    token_ids=[100 + i], text=f"t{i}",
                    finish_reason=(common_pb2.FINISH_REASON_LENGTH if last
                                   else common_pb2.FINISH_REASON_UNSPECIFIED),
                    usage=common_pb2.Usage(cached_tokens=4,
                                           model_version=self.stats.model_version)
                    if last else None)
                if self.decode_hang:
                    await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.seen.cancelled.append(request.meta.request_id)
            raise

    async def Stats(self, request: engine_pb2.EngineStatsRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> engine_pb2.EngineStats:
        await asyncio.sleep(self.stats_delay)  # a busy engine answers late
        await self.running.wait()
        out = engine_pb2.EngineStats()
        out.CopyFrom(self.stats)
        out.instance_id, out.role, out.model = self.name, ROLES[self.role], "tiny"
        out.kvd.node_id, out.kvd.address = self.node, "127.0.0.1:1"
        if not out.kv_blocks_free:
            out.kv_blocks_free = 1000
        return out

    async def Abort(self, request: engine_pb2.AbortRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> engine_pb2.AbortResponse:
        self.seen.aborts.append(request.request_id)
        return engine_pb2.AbortResponse(found=True)


class FakeIndex:
    """An in-memory ``PrefixIndex`` double: node -> set of block hashes it holds."""

    def __init__(self) -> None:
        self.held: dict[str, set[bytes]] = {}
        self.num_lookups = 0

    def add(self, node: str, hashes: Sequence[bytes]) -> None:
        self.held.setdefault(node, set()).update(hashes)

    async def lookup(self, hashes: Sequence[bytes]) -> dict[str, int]:
        self.num_lookups += 1
        out = {}
        for node, have in self.held.items():
            n = 0
            while n < len(hashes) and hashes[n] in have:
                n += 1
            if n:
                out[node] = n
        return out


class RedisSetIndex:
    """A Redis-backed index double (one SET of nodes per block hash), for outage tests: one
    pipelined round trip per lookup, like the real index."""

    def __init__(self, url: str) -> None:
        import redis.asyncio as aioredis

        self.redis = aioredis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)

    async def add(self, node: str, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            await self.redis.sadd(b"idx:" + h, node)

    async def lookup(self, hashes: Sequence[bytes]) -> dict[str, int]:
        pipe = self.redis.pipeline(transaction=False)
        for h in hashes:
            pipe.smembers(b"idx:" + h)
        sets = await pipe.execute()
        out: dict[str, int] = {}
        alive: set[bytes] | None = None
        for i, members in enumerate(sets):
            alive = set(members) if alive is None else alive & set(members)
            for node in alive:
                out[node.decode()] = i + 1
        return out
