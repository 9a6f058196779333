"""The byte movers ``pdserve bench cluster`` runs inside node namespaces, one process each:

    python -m pdserve_bench.cluster_peers grpc-sink HOST
    python -m pdserve_bench.cluster_peers grpc-source ADDRESS SIZES_MIB REPS
    python -m pdserve_bench.cluster_peers ucx-recv DEVICE SIZES_MIB REPS
    python -m pdserve_bench.cluster_peers ucx-send ADDRESS_HEX DEVICE SIZES_MIB REPS

A sink and a receiver print one line when ready (the sink its port, the receiver its UCX
worker address in hex); a source and a sender print one JSON object: size in MiB -> GB/s,
the median over ``REPS`` runs. gRPC: 1 MiB messages in one client stream, timed until the
sink's reply. Raw ucxx: one tag message per run, timed until the receiver's 8-byte
acknowledgement; UCX is restricted to network transports (``^sm``) on network DEVICE.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

MIB = 1 << 20
_HELLO, _DATA = 1, 1000


def _sizes(text: str) -> list[int]:
    return [int(s) for s in text.split(",")]


async def grpc_sink(host: str) -> None:
    import grpc

    async def sink(it: Any, ctx: Any) -> bytes:
        n = 0
        async for chunk in it:
            n += len(chunk)
        return n.to_bytes(8, "little")

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    handler = grpc.stream_unary_rpc_method_handler(sink)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("b.Sink",
                                                                          {"S": handler})])
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    print(f"pdserve grpcsink listening on {host}:{port}", flush=True)
    await server.wait_for_termination()


async def grpc_source(address: str, sizes: list[int], reps: int) -> dict[int, float]:
    import grpc

    chunk = os.urandom(MIB)
    out = {}
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.stream_unary("/b.Sink/S")
        await call(iter([chunk]), timeout=60)  # connect
        for n in sizes:
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                got = await call(iter([chunk] * n), timeout=300)
                times.append(time.perf_counter() - start)
                assert int.from_bytes(got, "little") == n * MIB
            out[n] = n * MIB / statistics.median(times) / 1e9
    return out


def _ucx_init(device: str) -> Any:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx

    ucxx.init(options={"TLS": "^sm", "NET_DEVICES": device})
    return ucxx


async def ucx_recv(device: str, sizes: list[int], reps: int) -> None:
    import numpy as np

    ux = _ucx_init(device)
    print(ux.get_worker_address().tobytes().hex(), flush=True)
    hello = np.empty(4096, np.uint8)
    await ux.recv(hello, tag=_HELLO)
    size = int.from_bytes(hello[:4].tobytes(), "little")
    peer = ux.get_ucx_address_from_buffer(hello[4:4 + size].tobytes())
    ep = await ux.create_endpoint_from_worker_address(peer)
    buf = np.empty(max(sizes) * MIB, np.uint8)
    ack = np.zeros(8, np.uint8)
    tag = _DATA
    for n in sizes:
        for _ in range(reps + 1):  # one warm-up run per size
            await ux.recv(buf[:n * MIB], tag=tag)
            await ep.send(ack, tag=tag, force_tag=True)
            tag += 1
    await ep.close()


async def ucx_send(address: str, device: str, sizes: list[int], reps: int
                   ) -> dict[int, float]:
    import numpy as np

    ux = _ucx_init(device)
    peer = ux.get_ucx_address_from_buffer(bytes.fromhex(address))
    ep = await ux.create_endpoint_from_worker_address(peer)
    me = ux.get_worker_address().tobytes()
    hello = np.zeros(4096, np.uint8)
    hello[:4] = np.frombuffer(len(me).to_bytes(4, "little"), np.uint8)
    hello[4:4 + len(me)] = np.frombuffer(me, np.uint8)
    await ep.send(hello, tag=_HELLO, force_tag=True)
    buf = np.random.randint(0, 255, max(sizes) * MIB, dtype=np.uint8)
    ack = np.zeros(8, np.uint8)
    tag, out = _DATA, {}
    for n in sizes:
        times = []
        for rep in range(reps + 1):
            start = time.perf_counter()
            await ep.send(buf[:n * MIB], tag=tag, force_tag=True)
            await ux.recv(ack, tag=tag)
            if rep:  # the first is the warm-up
                times.append(time.perf_counter() - start)
            tag += 1
        out[n] = n * MIB / statistics.median(times) / 1e9
    await ep.close()
    return out


def main(argv: list[str]) -> int:
    cmd, args = argv[0], argv[1:]
    if cmd == "grpc-sink":
        asyncio.run(grpc_sink(args[0]))
    elif cmd == "grpc-source":
        print(json.dumps(asyncio.run(grpc_source(args[0], _sizes(args[1]), int(args[2])))))
    elif cmd == "ucx-recv":
        asyncio.run(ucx_recv(args[0], _sizes(args[1]), int(args[2])))
    elif cmd == "ucx-send":
        result = asyncio.run(ucx_send(args[0], args[1], _sizes(args[2]), int(args[3])))
        print(json.dumps(result), flush=True)
    else:
        print(f"unknown command {cmd!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
