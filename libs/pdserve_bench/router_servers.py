"""The servers ``pdserve bench router`` runs in child processes: instant engines and a bare
gRPC relay (``python -m pdserve_bench.router_servers engines|relay ...``)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc

from pdserve.proto.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc


class InstantEngine(engine_pb2_grpc.PrefillServicer, engine_pb2_grpc.DecodeServicer,
                    engine_pb2_grpc.EngineServicer):
    """Answers at once: all the time measured is RPC and routing, none is model work."""

    def __init__(self, name: str, role: common_pb2.Role, num_tokens: int) -> None:
        self.name, self.role, self.num_tokens = name, role, num_tokens

    async def Prefill(self, request: Any, context: Any) -> engine_pb2.PrefillResponse:  # noqa: N802
        return engine_pb2.PrefillResponse(first_token_id=1, text="a")

    async def Decode(self, request: Any, context: Any,  # noqa: N802
                     ) -> AsyncIterator[engine_pb2.DecodeChunk]:
        for i in range(self.num_tokens):
            last = i == self.num_tokens - 1
            yield engine_pb2.DecodeChunk(
                token_ids=[2 + i], text="b",
                finish_reason=(common_pb2.FINISH_REASON_LENGTH if last
                               else common_pb2.FINISH_REASON_UNSPECIFIED))

    async def Stats(self, request: Any, context: Any) -> engine_pb2.EngineStats:  # noqa: N802
        return engine_pb2.EngineStats(instance_id=self.name, role=self.role, model="tiny",
                                      kv_blocks_free=100000)

    async def Abort(self, request: Any, context: Any) -> engine_pb2.AbortResponse:  # noqa: N802
        return engine_pb2.AbortResponse(found=False)


class BareRelay(router_pb2_grpc.RouterServicer):
    """The least a router can do (Prefill, then relay Decode; no checks, no choice): the cost
    of the extra grpc.aio hop itself, to tell it apart from the router's own work."""

    def __init__(self, prefill: str, decode: str) -> None:
        self.prefill = engine_pb2_grpc.PrefillStub(grpc.aio.insecure_channel(prefill))
        self.decode = engine_pb2_grpc.DecodeStub(grpc.aio.insecure_channel(decode))

    async def Generate(self, request: Any, context: Any,  # noqa: N802
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        ids, sampling = list(request.prompt_token_ids.ids), request.sampling
        first = await self.prefill.Prefill(engine_pb2.PrefillRequest(
            prompt_token_ids=ids, sampling=sampling))
        yield router_pb2.GenerateResponse(token_ids=[first.first_token_id], text=first.text)
        async for chunk in self.decode.Decode(engine_pb2.DecodeRequest(
                prompt_token_ids=ids, sampling=sampling, first_token_id=first.first_token_id)):
            yield router_pb2.GenerateResponse(token_ids=chunk.token_ids, text=chunk.text,
                                              finish_reason=chunk.finish_reason)


async def _serve_relay(prefill: str, decode: str) -> None:
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(BareRelay(prefill, decode), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"relay listening on 127.0.0.1:{port}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def _serve_engines(num_tokens: int) -> None:
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    ports, servers = [], []  # servers kept referenced: a collected grpc.aio server stops
    for name, role in (("prefill-0", common_pb2.ROLE_PREFILL),
                       ("decode-0", common_pb2.ROLE_DECODE)):
        server = grpc.aio.server()
        servers.append(server)
        engine = InstantEngine(name, role, num_tokens)
        engine_pb2_grpc.add_PrefillServicer_to_server(engine, server)
        engine_pb2_grpc.add_DecodeServicer_to_server(engine, server)
        engine_pb2_grpc.add_EngineServicer_to_server(engine, server)
        checker = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(checker, server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await checker.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"engines listening on 127.0.0.1:{ports[0]} 127.0.0.1:{ports[1]}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until parent exits


def main(argv: list[str]) -> int:
    if argv[:1] == ["engines"] and len(argv) == 2:
        asyncio.run(_serve_engines(int(argv[1])))
    elif argv[:1] == ["relay"] and len(argv) == 3:
        asyncio.run(_serve_relay(argv[1], argv[2]))
    else:
        sys.stderr.write("usage: router_servers engines NUM_TOKENS | relay PREFILL DECODE\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
