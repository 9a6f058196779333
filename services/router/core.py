"""Router core: the life cycle of one request.

    Generate(request)
      1. prepare   validate, tokenize (chat through the template, with tools), resolve
                   max_tokens; tool_choice required/named -> sampling.structured
      1b. limit    its size in bytes is checked before tokenizing; long prompts are
                   tokenized in a bounded worker pool (``preparing``)
      2. admit     tenant quota (tokens + concurrency), then the admission queue in front of
                   --max-concurrent (``admission``: priority, tenants in turn; 429 only when
                   the queue is full or the deadline cannot be met)
      3. look up   hash the prompt's full blocks; ONE index round trip -> node: blocks held
      4. place     policy.choose(query, healthy prefills, healthy decodes)
      5. prefill   Prefill.Prefill(destination = the decode node's kvd) -> first token;
                   failed / RESOURCE_EXHAUSTED -> placed again without that instance; every
                   instance busy (RESOURCE_EXHAUSTED) -> wait and place again, up to
                   --max-wait (``Flow.wait_busy``), then 429 with Retry-After
      6. stream    first token + placement; done here when prefill says it is final
      7. decode    Decode.Decode(blocks, first token) -> chunks relayed as they come;
                   fails before its first chunk -> another decode pulls from prefill's kvd;
                   could not get the KV (its source lost or partitioned) -> prefilled again
                   on another prefill instance, the first token kept, decoded once more;
                   fails after -> the client has the tokens so far, then UNAVAILABLE
      8. finish    final message carries finish_reason and usage; quota refunded
    With tools, the relayed text is read for tool calls (``tools.with_tool_calls``); with echo
    the first message carries the prompt's text (prompt logprobs ride on it from the engine).
    Colocated engines skip 5-6: their Decode prefills too. Every outbound call gets the
    deadline left on the client's; on client cancel, deadline or error the calls in flight are
    cancelled and Engine.Abort is sent best effort (the engine frees the request's blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from pdserve.errors import StatusError
from pdserve.proto.v1 import common_pb2, engine_pb2, router_pb2
from pdserve.roles import Role
from pdserve.telemetry import outbound_metadata
from services.router import metrics
from services.router.admission import AdmissionQueue
from services.router.controlling import RouterController
from services.router.failover import fail_over
from services.router.flow import (
    Busy,
    Down,
    Flow,
    Interrupted,
    KvLost,
    prefill_again,
    relay_decode,
    run_prefill,
)
from services.router.instances import Instance, InstancePool
from services.router.model import ModelSpec
from services.router.policy import Choice, RouteQuery, RoutingPolicy
from services.router.prefix import IndexClient
from services.router.preparing import Preparer
from services.router.quotas import QuotaBook, QuotaExceeded
from services.router.requests import Prepared, RouterLimits, detokenize, tokenize
from services.router.slo_admission import SloGate
from services.router.tools import with_tool_calls

log = logging.getLogger(__name__)

@dataclass
class Group:
    """Instances whose blocks hash alike (one ``kv_fingerprint``), by role."""

    fingerprint: str
    prefills: list[Instance] = field(default_factory=list)
    decodes: list[Instance] = field(default_factory=list)
    colocated: list[Instance] = field(default_factory=list)

    def add(self, role: common_pb2.Role, inst: Instance) -> None:
        members = {common_pb2.ROLE_PREFILL: self.prefills, common_pb2.ROLE_DECODE: self.decodes,
                   common_pb2.ROLE_COLOCATED: self.colocated}
        members[role].append(inst)

    def size(self) -> int:
        return len(self.prefills) + len(self.decodes) + len(self.colocated)


@dataclass
class RouterCounters:
    num_requests: int = 0
    num_prefix_hit_blocks: int = 0
    num_prompt_blocks: int = 0


@dataclass
class Router:
    model: ModelSpec
    pool: InstancePool
    index: IndexClient
    policy: RoutingPolicy
    quotas: QuotaBook
    block_size: int
    limits: RouterLimits
    admission: AdmissionQueue = field(default_factory=lambda: AdmissionQueue(1024, 4096))
    preparer: Preparer = field(default_factory=Preparer)
    max_wait: float = 30.0  # seconds a request may wait for busy engines
    max_retries: int = 2
    poll_interval: float = 1.0
    tool_call_parser: str = "auto"
    controller: RouterController | None = None  # --controller: told of each request
    slo_gate: SloGate | None = None  # --slo-admission
    counters: RouterCounters = field(default_factory=RouterCounters)
    fingerprint_order: dict[str, int] = field(default_factory=dict)  # first seen: 0, 1, ...
    num_in_flight: int = 0
    _poll_task: asyncio.Task[None] | None = None
    _background: set[asyncio.Task[object]] = field(default_factory=set)

    async def start(self) -> None:
        await self.poll()
        self._poll_task = asyncio.create_task(self._poll_loop())

    async def stop(self) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
            await asyncio.gather(self._poll_task, return_exceptions=True)
        await self.pool.close()
        self.preparer.close()

    async def poll(self) -> None:
        await asyncio.gather(self.pool.poll_once(), self.index.probe())
        for role in (Role.PREFILL, Role.DECODE, Role.COLOCATED):
            metrics.HEALTHY_INSTANCES.labels(role).set(len(self.pool.healthy(role.proto)))

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                await self.poll()
            except Exception:  # the loop must outlive any one bad poll
                log.exception("instance poll failed")

    async def generate(self, request: router_pb2.GenerateRequest,
                       time_remaining: Callable[[], float | None],
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Stream the answer to ``request``; raises ``StatusError`` for a status to return."""
        arrived = time.perf_counter()
        prepared = await self.preparer.run(request, self.model, self.limits,
                                           self.tool_call_parser)
        tenant = prepared.meta.tenant
        cost = len(prepared.prompt_ids) + prepared.sampling.max_tokens
        try:
            self.quotas.acquire(tenant, cost)
        except QuotaExceeded as exc:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc),
                              exc.retry_after) from exc
        try:
            if self.slo_gate is not None:
                await self.slo_gate.check(len(prepared.prompt_ids), time_remaining())
            metrics.QUEUED.set(self.admission.num_queued + 1)
            admitted = await self.admission.acquire(prepared.meta.priority, tenant,
                                                    time_remaining())
        except BaseException:
            self.quotas.release(tenant, cost)
            raise
        finally:
            metrics.QUEUED.set(self.admission.num_queued)
        metrics.QUEUE_WAIT.observe(time.perf_counter() - arrived)
        if self.controller is not None:
            self.controller.arrived(len(prepared.prompt_ids), prepared.sampling.max_tokens)
        try:
            async for message in self._generate(prepared, time_remaining, arrived, cost):
                yield message
        finally:
            self.admission.release(self.admission.clock() - admitted)

    async def _generate(self, prepared: Prepared, time_remaining: Callable[[], float | None],
                        arrived: float, cost: int,
                        ) -> AsyncIterator[router_pb2.GenerateResponse]:
        tenant = prepared.meta.tenant
        span = trace.get_current_span()  # Router.Generate's (pdserve.rpc)
        span.set_attribute("pdserve.request_id", prepared.meta.request_id)
        flow = Flow(prepared, time_remaining, outbound_metadata(), arrived,
                    self.max_retries, max_wait=self.max_wait)
        self.num_in_flight += 1
        metrics.IN_FLIGHT.inc()
        self.counters.num_requests += 1
        try:
            group = await self._wait_group(flow)
            hashes = await self.preparer.hash(prepared, self.block_size, group.fingerprint)
            flow.query = RouteQuery(len(prepared.prompt_ids), self.block_size, len(hashes),
                                    await self.index.lookup(hashes))
            messages = self._run(flow, group)
            if prepared.tools is not None:
                messages = with_tool_calls(messages, prepared.tools)
            async for message in self._relay(flow, prepared, messages):
                yield message
            flow.is_finished = True
        finally:
            self.num_in_flight -= 1
            metrics.IN_FLIGHT.dec()
            # A request that failed before its first token gets its whole charge back.
            unused = (cost if not flow.is_finished and flow.num_tokens_sent == 0
                      else prepared.sampling.max_tokens - flow.num_tokens_sent)
            self.quotas.release(tenant, unused)
            if not flow.is_finished:
                self._abort(flow)
            span.set_attribute("pdserve.completion_tokens", flow.num_tokens_sent)

    async def _relay(self, flow: Flow, prepared: Prepared,
                     messages: AsyncIterator[router_pb2.GenerateResponse],
                     ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """The messages as the client gets them: echo and the first prompt logprob on the
        first, latency observed."""
        echo = prepared.prompt_text  # goes out once, with the first message
        first_entry = self._first_prompt_entry(prepared)
        last, ttft, num_tokens, itls = 0.0, 0.0, 0, []
        async for message in messages:
            if message.token_ids:
                now = time.perf_counter()
                (metrics.ITL if last else metrics.TTFT).observe(now - (last or flow.arrived))
                if last:
                    itls.append(now - last)
                else:
                    ttft = now - flow.arrived
                last, num_tokens = now, num_tokens + len(message.token_ids)
            message.prompt_text, echo = echo, ""
            if first_entry is not None:
                entries = [first_entry, *message.prompt_logprobs]
                message.ClearField("prompt_logprobs")
                message.prompt_logprobs.extend(entries)
                first_entry = None
            yield message
        if self.controller is not None and num_tokens:
            tpot = (last - flow.arrived - ttft) / (num_tokens - 1) if num_tokens > 1 else 0.0
            self.controller.finished(ttft, tpot, itls)

    def _first_prompt_entry(self, prepared: Prepared) -> common_pb2.PositionLogprobs | None:
        """With prompt logprobs, the first prompt token's entry: the engines score tokens
        from the second on (nothing predicts the first)."""
        if not prepared.sampling.HasField("prompt_logprobs"):
            return None
        token = prepared.prompt_ids[0]
        entry = common_pb2.PositionLogprobs()
        entry.sampled.token_id = token
        if self.model.tokenizer is not None:
            raw = self.model.tokenizer.token_bytes(token)
            entry.sampled.token_bytes = raw
            entry.sampled.token = raw.decode("utf-8", errors="replace")
        return entry

    async def _wait_group(self, flow: Flow) -> Group:
        """``_group()``, waiting while none is healthy but some instance is known (down,
        likely restarting: the supervisor brings it back) up to the request's wait limits."""
        waited = 0.0
        while True:
            try:
                return self._group()
            except StatusError as down:
                if all(i.is_healthy for i in self.pool.instances.values()):
                    raise  # nothing is down: nothing to wait for (a role not configured)
                waited = await flow.wait_down(down, waited)

    def _group(self) -> Group:
        """The healthy instances that can serve together: prefill and decode engines (else
        colocated ones) sharing one block fingerprint (so one weights version), the largest
        such group, the newest of equal ones. An engine
        that has not reported its fingerprint is taken to use the model's."""
        groups: dict[str, Group] = {}
        for role in (common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE, common_pb2.ROLE_COLOCATED):
            for inst in self.pool.healthy(role):
                fp = inst.stats.kv_fingerprint or self.model.fingerprint
                groups.setdefault(fp, Group(fp)).add(role, inst)
        for fp in groups:  # a rolling reload's new version is seen after the old one
            self.fingerprint_order.setdefault(fp, len(self.fingerprint_order))
        disaggregated = [g for g in groups.values() if g.prefills and g.decodes]
        colocated = [g for g in groups.values() if g.colocated]
        # Equal sizes: the newest version wins, so the old one drains as a reload proceeds.
        best = max(disaggregated or colocated, default=None,
                   key=lambda g: (g.size(), self.fingerprint_order[g.fingerprint]))
        if best is None:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, self._no_capacity())
        return best

    async def _run(self, flow: Flow, group: Group) -> AsyncIterator[router_pb2.GenerateResponse]:
        prefills, decodes = group.prefills, group.decodes
        first = None
        if prefills and decodes:
            first = await self._prefill(flow, prefills, decodes)
            self._count_placement(flow)
            if first.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                yield first
                return
        else:
            decodes = group.colocated
            flow.choice = self._place_colocated(flow, decodes)
            self._count_placement(flow)
        is_kv_lost = False
        while True:
            try:
                async for message in self._decode(flow, decodes, first):
                    yield message
                return
            except KvLost as lost:  # the client has the first token; its KV is gone: once more
                if is_kv_lost:
                    raise
                is_kv_lost = True
                prefills, decodes = self._alive(group)
                await prefill_again(flow, self.policy, self.pool, lost, prefills, decodes)
            except Interrupted as broken:  # part of the answer was sent: go on elsewhere
                prefills, decodes = self._alive(group)
                await fail_over(flow, self.policy, self.pool, broken, prefills, decodes)
            first = None

    @staticmethod
    def _alive(group: Group) -> tuple[list[Instance], list[Instance]]:
        """The group's instances still healthy (alike blocks only)."""
        return ([p for p in group.prefills if p.is_healthy],
                [d for d in group.decodes or group.colocated if d.is_healthy])

    async def _prefill(self, flow: Flow, prefills: list[Instance], decodes: list[Instance],
                       ) -> router_pb2.GenerateResponse:
        """Prefill, waiting while every prefill instance answers busy (``Busy``) or is down
        (``Down``: restarting, so the group is looked up again once one is back)."""
        waited = down_waited = 0.0
        while True:
            try:
                return await run_prefill(flow, self.policy, self.pool, prefills, decodes)
            except Busy as busy:
                waited = await flow.wait_busy(busy, waited)
            except Down as down:
                down_waited = await flow.wait_down(down, down_waited)
                group = await self._wait_group(flow)
                prefills, decodes = group.prefills, group.decodes

    async def _decode(self, flow: Flow, decodes: list[Instance],
                      first: router_pb2.GenerateResponse | None,
                      ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Relay the decode, waiting while every decode instance answers busy before its
        first chunk (``Busy``); ``first`` goes out once."""
        waited = down_waited = 0.0
        while True:
            try:
                async for message in relay_decode(flow, self.policy, self.pool, decodes, first):
                    if message is first:
                        first = None
                    yield message
                return
            except Busy as busy:
                waited = await flow.wait_busy(busy, waited)
            except Down as down:  # every decode down (restarting): wait for one to be back
                down_waited = await flow.wait_down(down, down_waited)
                group = await self._wait_group(flow)
                decodes = group.decodes or group.colocated

    def _place_colocated(self, flow: Flow, decodes: list[Instance]) -> Choice:
        assert flow.query is not None
        choice = self.policy.choose(flow.query, [], decodes)
        if choice is None:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, self._no_capacity())
        return choice

    def _count_placement(self, flow: Flow) -> None:
        assert flow.choice is not None and flow.query is not None
        p, d = flow.choice.prefill, flow.choice.decode
        metrics.DECISIONS.labels(self.policy.name, p.instance_id if p else "", d.instance_id).inc()
        self.counters.num_prompt_blocks += flow.query.num_blocks
        self.counters.num_prefix_hit_blocks += flow.choice.cached_blocks
        metrics.PROMPT_BLOCKS.inc(flow.query.num_blocks)
        metrics.PREFIX_HIT_BLOCKS.inc(flow.choice.cached_blocks)

    def _no_capacity(self) -> str:
        states = ", ".join(f"{i.instance_id}({'up' if i.is_healthy else 'down'})"
                           for i in self.pool.instances.values()) or "none known"
        return f"no capacity: no healthy prefill+decode pair or colocated engine ({states})"

    def _abort(self, flow: Flow) -> None:
        """Best effort: tell every engine the request touched to drop it (fire and forget)."""
        for inst in flow.touched:
            task = asyncio.create_task(self._abort_one(inst, flow.prepared.meta.request_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    @staticmethod
    async def _abort_one(inst: Instance, request_id: str) -> None:
        # Best effort: the engine also frees the request when its stream is cancelled.
        with contextlib.suppress(grpc.RpcError):
            await inst.engine.Abort(engine_pb2.AbortRequest(request_id=request_id), timeout=1.0)

    def list_models(self) -> router_pb2.ListModelsResponse:
        """One entry per served name (the first is the default model)."""
        return router_pb2.ListModelsResponse(models=[
            router_pb2.ModelInfo(id=name, max_context=self.model.max_context,
                                 block_size=self.block_size, root=self.model.name)
            for name in self.model.names])

    def tokenize(self, request: router_pb2.TokenizeRequest) -> router_pb2.TokenizeResponse:
        return router_pb2.TokenizeResponse(token_ids=tokenize(request, self.model),
                                           max_context=self.model.max_context)

    def detokenize(self, request: router_pb2.DetokenizeRequest,
                   ) -> router_pb2.DetokenizeResponse:
        return router_pb2.DetokenizeResponse(text=detokenize(request, self.model))

    def cluster_state(self) -> router_pb2.ClusterStateResponse:
        out = router_pb2.ClusterStateResponse(
            policy=self.policy.name, index_available=self.index.is_available,
            num_requests=self.counters.num_requests,
            num_prefix_hit_blocks=self.counters.num_prefix_hit_blocks,
            num_prompt_blocks=self.counters.num_prompt_blocks)
        for i in sorted(self.pool.instances.values(), key=lambda i: i.instance_id):
            s = i.stats
            out.instances.add(
                instance_id=i.instance_id, role=i.role, address=i.address,
                kvd_node=i.kvd_node_id, model=i.model, healthy=i.is_healthy,
                queue_depth=s.queue_depth, num_running=s.num_running,
                kv_blocks_free=s.kv_blocks_free, prefill_tokens_per_s=s.prefill_tokens_per_s,
                decode_tokens_per_s=s.decode_tokens_per_s, num_routed=i.num_routed,
                num_errors=i.num_errors, model_version=s.model_version)
        return out
