"""The kvd processes of ``pdserve bench transfer`` (and of the cluster bench): pairs of real kvds
that accept each other as peers, and ``KvdPair``, the two timed moves between them."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import torch

from pdserve.env import LOG_LEVEL_VAR
from pdserve.hashing import block_checksum
from pdserve.kvd.client import CommitEntry, KvdClient
from pdserve.kvd.layout import BlockLayout
from pdserve.procs import BIND_FAILED
from pdserve.proto.v1 import common_pb2

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = BlockLayout(16, 16, 8, 128, "bfloat16")  # 1 MiB per block
MIB = 1 << 20


_STDERR: dict[int, IO[str]] = {}  # pid -> the file a spawned process writes its stderr to


def spawn(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    """Start ``python args``; return it and its first stdout line ('' when it exited first; its
    last stderr lines are then in ``stderr_tail``)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'libs'}", LOG_LEVEL_VAR: "warning"}
    err = tempfile.TemporaryFile("w+")  # noqa: SIM115 -- outlives this call: stderr_tail reads it
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=err)
    _STDERR[proc.pid] = err
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def stderr_tail(proc: subprocess.Popen[str], lines: int = 5) -> str:
    """The last ``lines`` of what a ``spawn``ed process that exited wrote to stderr."""
    proc.wait(timeout=30)
    err = _STDERR.pop(proc.pid, None)
    if err is None:
        return ""
    with err:
        err.seek(0)
        return "\n".join(err.read().splitlines()[-lines:])


class KvdPair:
    def __init__(self, a: KvdClient, b: KvdClient, b_endpoint: common_pb2.KvdEndpoint,
                 layout: BlockLayout = LAYOUT) -> None:
        self.a, self.b, self.dest = a, b, b_endpoint
        self.seq = 0
        # One block's bytes: random KV values (any bytes for a quantized block's values+scales).
        if layout.is_quantized:
            self.block = torch.randint(0, 256, (layout.block_bytes,), dtype=torch.uint8)
        else:
            self.block = torch.randn(layout.shape).to(getattr(torch, layout.dtype))
        self.source = self.block.view(torch.uint8).reshape(-1)

    def write(self, slot: int) -> None:
        self.a.slot_view(slot).view(torch.uint8).reshape(-1).copy_(self.source)

    def hashes(self, n: int) -> list[bytes]:
        self.seq += 1
        return [self.seq.to_bytes(16, "big") + i.to_bytes(16, "big") for i in range(n)]

    async def kvd_once(self, n: int) -> float:
        """(b): blocks already written on A; time Commit-with-push -> present at B."""
        pins = await self.a.allocate(n)
        for p in pins:
            self.write(p.slot)
        sums = [block_checksum(self.a.slot_memory(p.slot)) for p in pins]
        hs = self.hashes(n)
        refs = [common_pb2.BlockRef(hash=h, checksum=s) for h, s in zip(hs, sums, strict=True)]
        t = time.perf_counter()
        await self.a.commit([CommitEntry(p, h, s) for p, h, s in zip(pins, hs, sums,
                                                                     strict=True)], self.dest)
        got = await self.b.await_blocks(refs, timeout=120)
        dt = time.perf_counter() - t
        await self.b.release([p.pin_id for p in got])
        return dt

    async def e2e_once(self, n: int, out: torch.Tensor) -> float:
        """(d): engine write on A (each block checksummed right after its copy, while hot) ->
        Commit+push -> Await on B -> engine read; the Release is sent then and its answer
        awaited off the clock, as a decode engine does (``KvBridge.release_later``)."""
        hs = self.hashes(n)
        t = time.perf_counter()
        pins = await self.a.allocate(n)
        sums = [self.a.write_block(p.slot, self.block) for p in pins]
        await self.a.commit([CommitEntry(p, h, s) for p, h, s in zip(pins, hs, sums,
                                                                     strict=True)], self.dest)
        got = await self.b.await_blocks([common_pb2.BlockRef(hash=h) for h in hs], timeout=120)
        for p in got:
            out.copy_(self.b.slot_view(p.slot))
        release = asyncio.ensure_future(self.b.release([p.pin_id for p in got]))
        dt = time.perf_counter() - t
        await release
        return dt


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all held open while picking, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class PortTaken(Exception):
    """A kvd's port was taken between picking it and binding it."""


def _kvd(capacity_mib: int, port: int, peer: str, *extra: str
         ) -> tuple[subprocess.Popen[str], str]:
    """A kvd on ``port`` that accepts ``peer`` as a kvd node (push destinations and Transfer
    callers must be registered: no Redis registry here)."""
    proc, line = spawn(["-m", "services.kvd", "--port", str(port), "--capacity-mib",
                        str(capacity_mib), "--peers", peer, *extra])
    if "listening on" not in line:
        tail = stderr_tail(proc)
        if BIND_FAILED.search(tail):
            raise PortTaken(tail)
        raise RuntimeError(f"kvd did not start (exit code {proc.returncode}): {tail}")
    _STDERR.pop(proc.pid).close()  # started: its later words are not read
    return proc, line.split("listening on ")[1].split()[0]


def kvd_pair(capacity_mib: int, *extra: str, tries: int = 5
             ) -> tuple[tuple[subprocess.Popen[str], str], ...]:
    """Two kvds that accept each other as peers (a push destination must be a registered
    node; there is no Redis registry here). Each must know the other's port before it starts,
    so both are picked free first; another process (the first kvd's own UCX listener among
    them) can take the second in between, and then the pair starts again on fresh ports."""
    last = ""
    for _ in range(tries):
        ports = _free_ports(2)
        started: list[tuple[subprocess.Popen[str], str]] = []
        try:
            for mine, other in ((ports[0], ports[1]), (ports[1], ports[0])):
                started.append(_kvd(capacity_mib, mine, f"127.0.0.1:{other}", *extra))
            return tuple(started)
        except PortTaken as exc:
            for proc, _ in started:
                proc.terminate()
                proc.wait(timeout=30)
            last = str(exc)
    raise RuntimeError(f"kvd pair: a picked port was taken before it bound, {tries} times; "
                       f"the last kvd said: {last}")


async def kvd_pairs(capacity_mib: int, layout: BlockLayout = LAYOUT
                 ) -> tuple[list[subprocess.Popen[str]], list[KvdClient], dict[str, KvdPair]]:
    """Two pairs of kvds: one copying between the pools of this host (the default), one held
    to UCX (``--same-host false``), so both paths are measured in the same run. The first
    pair is measured twice: ``same_host`` with the engines' calls on the kvds' control
    sockets (what an engine of the kvd's host uses), ``stream`` on the gRPC Control stream."""
    procs: list[subprocess.Popen[str]] = []
    clients: list[KvdClient] = []
    pairs = {}
    for path, extra in (("same_host", ()), ("ucx", ("--same-host", "false"))):
        (pa, addr_a), (pb, addr_b) = kvd_pair(capacity_mib, *extra)
        procs += [pa, pb]
        # a pool is faulted in at Register: a GiB of pages takes seconds on a busy host
        a, b = (KvdClient(addr, name, rpc_timeout=120) for addr, name in
                ((addr_a, "bench-a"), (addr_b, "bench-b")))
        clients += [a, b]
        await a.register(layout)
        await b.register(layout)
        pairs[path] = KvdPair(a, b, common_pb2.KvdEndpoint(node_id=addr_b, address=addr_b),
                              layout)
        await pairs[path].kvd_once(1)  # warm-up: endpoints, channels
        if path == "same_host":  # the same kvds, the engines' calls on the gRPC stream
            sa, sb = (KvdClient(addr, name, rpc_timeout=120, local_control=False)
                      for addr, name in ((addr_a, "bench-a"), (addr_b, "bench-b")))
            clients += [sa, sb]
            await sa.register(layout)
            await sb.register(layout)
            pairs["stream"] = KvdPair(sa, sb, pairs[path].dest, layout)
            await pairs["stream"].kvd_once(1)
    return procs, clients, pairs


async def close_all(procs: list[subprocess.Popen[str]], clients: list[KvdClient]) -> None:
    for c in clients:
        await c.close()
    for p in procs:
        p.terminate()
        p.wait(timeout=30)
