"""``pdserve reload --model DIR``: a rolling reload of a running stack's weights.

    for each engine the router knows (prefill and decode interleaved, so a same-version
    pair exists early):
      1. Engine.Drain(wait)        no new work; its in-flight requests finish on the old weights
      2. router sees it draining   so it never pairs it by a stale version afterwards
      3. Engine.LoadWeights(resume) new weights prepared, swapped; back in rotation (also when
                                   the load failed: the old weights then still serve)
      4. router sees it healthy    with the new version, before the next one is taken out

The router pairs only instances of one version (the block fingerprint) and prefers the newest
of equally large groups, so the old version drains as the reload proceeds and no answer mixes
versions. Credentials: the admin one for the engines, the client one for the router, from the
environment or ``--secrets DIR`` (the directory ``pdserve up`` prints).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from pdserve import auth
from pdserve.channel import insecure_channel
from pdserve.proto.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

POLICIES = {"finish": engine_pb2.RELOAD_POLICY_FINISH,
            "reprefill": engine_pb2.RELOAD_POLICY_REPREFILL}


class ReloadError(Exception):
    """A step of the rolling reload failed; the message names the instance and the step."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve reload", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the new checkpoint (same architecture)")
    p.add_argument("--router", default="127.0.0.1:50051", help="the stack's router host:port")
    p.add_argument("--secrets", default="", help="credentials directory (pdserve up prints it)")
    p.add_argument("--policy", default="finish", choices=list(POLICIES),
                   help="in-flight requests at the swap (the engines drain first either way)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds each step of one instance may take")
    p.add_argument("--allow-downtime", action="store_true",
                   help="reload even a role's only engine (its requests fail meanwhile)")
    p.add_argument("--json", action="store_true", help="print one JSON line per instance")
    return p.parse_args(argv)


def held_secrets(directory: str) -> dict[str, str]:
    """The credentials given in the environment, or read from ``directory``."""
    if not directory:
        return auth.secrets()
    path = Path(directory)
    if not path.is_dir():
        raise ReloadError(f"--secrets: {directory!r} is not a directory")
    files = {f"{c.var}_FILE": str(path / c.var) for c in auth.CREDENTIALS
             if (path / c.var).is_file()}
    return auth.secrets(files)


def check_capacity(instances: Sequence[router_pb2.InstanceState]) -> None:
    """Raise unless every role present has two engines: taking out the only one of a role
    leaves no same-version pair serving, and requests fail meanwhile."""
    for role in (common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE, common_pb2.ROLE_COLOCATED):
        of_role = [i.instance_id for i in instances if i.role == role]
        if len(of_role) == 1:
            raise ReloadError(f"{of_role[0]} is the only {_ROLE_NAMES[role]} engine: while it "
                              "reloads nothing could serve; a rolling reload needs two of each "
                              "role (or --allow-downtime)")


_ROLE_NAMES = {common_pb2.ROLE_PREFILL: "prefill", common_pb2.ROLE_DECODE: "decode",
               common_pb2.ROLE_COLOCATED: "colocated"}


def order(instances: Sequence[router_pb2.InstanceState]) -> list[router_pb2.InstanceState]:
    """Prefill and decode interleaved (p0 d0 p1 d1 ...), then colocated ones."""
    by_role = {role: sorted((i for i in instances if i.role == role),
                            key=lambda i: i.instance_id)
               for role in (common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE)}
    prefills, decodes = by_role[common_pb2.ROLE_PREFILL], by_role[common_pb2.ROLE_DECODE]
    out: list[router_pb2.InstanceState] = []
    for i in range(max(len(prefills), len(decodes))):
        out += prefills[i:i + 1] + decodes[i:i + 1]
    return out + sorted((i for i in instances if i.role == common_pb2.ROLE_COLOCATED),
                        key=lambda i: i.instance_id)


class Reloader:
    def __init__(self, ns: argparse.Namespace, held: dict[str, str]) -> None:
        self.ns = ns
        self.held = held
        self.router: router_pb2_grpc.RouterStub | None = None

    async def state(self) -> dict[str, router_pb2.InstanceState]:
        assert self.router is not None, "run() opens the router channel"
        resp = await self.router.ClusterState(router_pb2.ClusterStateRequest(), timeout=10)
        return {i.instance_id: i for i in resp.instances}

    async def wait_router(self, instance_id: str, healthy: bool, what: str) -> None:
        deadline = time.monotonic() + self.ns.timeout
        while time.monotonic() < deadline:
            inst = (await self.state()).get(instance_id)
            if inst is not None and inst.healthy == healthy:
                return
            await asyncio.sleep(0.1)
        raise ReloadError(f"{instance_id}: the router did not see it {what} within "
                          f"{self.ns.timeout}s")

    async def reload_one(self, inst: router_pb2.InstanceState) -> dict[str, object]:
        creds = auth.metadata([auth.ADMIN], self.held)
        async with insecure_channel(inst.address, credentials=creds) as channel:
            engine = engine_pb2_grpc.EngineStub(channel)
            start = time.perf_counter()
            await engine.Drain(engine_pb2.DrainRequest(wait=True), timeout=self.ns.timeout)
            await self.wait_router(inst.instance_id, False, "draining")
            drained = time.perf_counter()
            resp = await engine.LoadWeights(engine_pb2.LoadWeightsRequest(
                model=self.ns.model, policy=POLICIES[self.ns.policy], resume=True),
                timeout=self.ns.timeout)
            await self.wait_router(inst.instance_id, True, "healthy again")
        return {"instance": inst.instance_id, "role": common_pb2.Role.Name(inst.role),
                "version": resp.model_version, "previous": resp.previous_model_version,
                "drain_ms": round((drained - start) * 1e3, 1),
                "load_ms": round(resp.load_ms, 1), "swap_ms": round(resp.swap_ms, 3),
                "out_of_rotation_ms": round((time.perf_counter() - start) * 1e3, 1)}

    async def run(self) -> list[dict[str, object]]:
        creds = auth.metadata([auth.CLIENT], self.held)
        async with insecure_channel(self.ns.router, credentials=creds) as channel:
            self.router = router_pb2_grpc.RouterStub(channel)
            return await self._run()

    async def _run(self) -> list[dict[str, object]]:
        instances = list((await self.state()).values())
        down = [i.instance_id for i in instances if not i.healthy]
        if not instances or down:
            raise ReloadError(f"the router at {self.ns.router} knows "
                              f"{'no instances' if not instances else 'unhealthy ones: '}"
                              f"{', '.join(down)}; a rolling reload needs every engine up")
        if not self.ns.allow_downtime:
            check_capacity(instances)
        rows = []
        for inst in order(instances):
            try:
                row = await self.reload_one(inst)
            except grpc.aio.AioRpcError as exc:
                raise ReloadError(f"{inst.instance_id}: {exc.code().name}: "
                                  f"{exc.details()}") from exc
            rows.append(row)
            print(json.dumps(row) if self.ns.json else _line(row), flush=True)
        return rows


def _line(row: dict[str, object]) -> str:
    return (f"{row['instance']:>24} {row['role']:>14}  {row['previous']} -> {row['version']}  "
            f"drain {row['drain_ms']} ms  load {row['load_ms']} ms  swap {row['swap_ms']} ms")


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(argv)
    try:
        rows = asyncio.run(Reloader(ns, held_secrets(ns.secrets)).run())
    except (ReloadError, grpc.aio.AioRpcError) as exc:
        text = (f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError)
                else str(exc))
        print(f"pdserve reload: error: {text}", file=sys.stderr)
        return 1
    print(f"pdserve reload: {len(rows)} instances now serve {ns.model}")
    return 0
