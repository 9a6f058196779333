"""gRPC edge of the kvd service: auth, proto <-> core conversion, errors as status codes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.errors import BadRequest
from pdserve.kvd.layout import BlockLayout
from pdserve.proto.v1 import kvd_pb2, kvd_pb2_grpc
from pdserve.rpc import rpc_handler
from services.kvd import control
from services.kvd.daemon import Kvd


class KvdServicer(kvd_pb2_grpc.KvdServicer):
    """Every rpc delegates to ``Kvd``; the shared secret is checked before (``SecretCheck``)."""

    def __init__(self, kvd: Kvd) -> None:
        self.kvd = kvd

    @rpc_handler("Register")
    async def Register(self, request: kvd_pb2.RegisterRequest,
                       context: grpc.aio.ServicerContext) -> kvd_pb2.RegisterResponse:
        lay = request.layout
        try:
            layout = BlockLayout(lay.num_layers, lay.block_size, lay.num_kv_heads, lay.head_dim,
                                 lay.dtype, lay.model_fingerprint)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        return self.kvd.register(layout)

    @rpc_handler("Allocate")
    async def Allocate(self, request: kvd_pb2.AllocateRequest,
                       context: grpc.aio.ServicerContext) -> kvd_pb2.AllocateResponse:
        return control.allocate(self.kvd, request)

    @rpc_handler("Commit")
    async def Commit(self, request: kvd_pb2.CommitRequest,
                     context: grpc.aio.ServicerContext) -> kvd_pb2.CommitResponse:
        return await control.commit(self.kvd, request)

    @rpc_handler("Lookup")
    async def Lookup(self, request: kvd_pb2.LookupRequest,
                     context: grpc.aio.ServicerContext) -> kvd_pb2.LookupResponse:
        here, available = await self.kvd.lookup(request.hashes, request.include_index)
        return kvd_pb2.LookupResponse(num_present=here, num_available=available)

    @rpc_handler("Await")
    async def Await(self, request: kvd_pb2.AwaitRequest,
                    context: grpc.aio.ServicerContext) -> kvd_pb2.AwaitResponse:
        remaining = context.time_remaining()
        timeout = self.kvd.config.transfer_timeout if remaining is None else max(0.0, remaining)
        return await control.wait(self.kvd, request, control.margin(timeout))

    @rpc_handler("Release")
    async def Release(self, request: kvd_pb2.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> kvd_pb2.ReleaseResponse:
        return control.release(self.kvd, request)

    @rpc_handler("Stats")
    async def Stats(self, request: kvd_pb2.KvdStatsRequest,
                    context: grpc.aio.ServicerContext) -> kvd_pb2.KvdStats:
        return self.kvd.stats()

    @rpc_handler("Session")
    async def Session(self, request: kvd_pb2.SessionRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[kvd_pb2.SessionResponse]:
        if not request.client_id:
            raise BadRequest("client_id: required (whose pins go when the session ends)")
        self.kvd.open_session(request.client_id)
        try:
            yield kvd_pb2.SessionResponse(epoch=self.kvd.epoch, node_id=self.kvd.me.node_id)
            await asyncio.Event().wait()  # until the client goes (or this server stops)
        finally:
            self.kvd.close_session(request.client_id)

    @rpc_handler("Control")
    async def Control(self, request_iterator: AsyncIterator[kvd_pb2.ControlRequest],
                      context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[kvd_pb2.ControlResponse]:
        async for answer in control.serve(self.kvd, request_iterator):
            yield answer

    @rpc_handler("Transfer")
    async def Transfer(self, request: kvd_pb2.TransferRequest,
                       context: grpc.aio.ServicerContext) -> kvd_pb2.TransferResponse:
        return await self.kvd.transfer(request)


_COUNTERS = ("bytes_in", "bytes_out", "num_transfers", "num_errors", "num_evictions",
             "num_checksum_failures", "num_refetches", "num_lease_expiries")
_GAUGES = ("num_slots", "slots_free", "slots_present", "slots_pinned", "slots_in_flight",
           "slots_writing")


class KvdCollector:
    """Prometheus view of ``Kvd.stats()``, read at scrape time (no second set of counters)."""

    def __init__(self, kvd: Kvd) -> None:
        self.kvd = kvd

    def collect(self) -> Iterator[Metric]:
        stats = self.kvd.stats()
        node = stats.node_id
        for name in _COUNTERS:
            c = CounterMetricFamily(f"pdserve_kvd_{name}", f"kvd {name}", labels=["node"])
            c.add_metric([node], getattr(stats, name))
            yield c
        for name in _GAUGES:
            g = GaugeMetricFamily(f"pdserve_kvd_{name}", f"kvd {name}", labels=["node"])
            g.add_metric([node], getattr(stats, name))
            yield g
        g = GaugeMetricFamily("pdserve_kvd_index_available", "Redis index reachable",
                              labels=["node"])
        g.add_metric([node], float(stats.index_available))
        yield g
        # UCX's own report (ucp_ep_query) of the lanes to each peer, by transport/device
        g = GaugeMetricFamily("pdserve_kvd_ucx_lanes", "UCX endpoint lanes to a peer kvd",
                              labels=["node", "peer", "transport"])
        for peer, lanes in sorted(self.kvd.transport.lanes.items()):
            for lane in sorted(set(lanes)):
                g.add_metric([node, peer, lane], float(lanes.count(lane)))
        yield g


def servicers(servicer: KvdServicer) -> list[tuple[Any, Any, str]]:
    """(add_fn, servicer, full service name) for every service this process serves."""
    name = kvd_pb2.DESCRIPTOR.services_by_name["Kvd"].full_name
    return [(kvd_pb2_grpc.add_KvdServicer_to_server, servicer, name)]
