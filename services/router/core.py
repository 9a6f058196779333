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
                   fails after -> goes on on another decode from the tokens sent
                   (``failover``); an engine silent on a call that does not answer a
                   health check either (paused, hung: ``health``) counts as failed
      8. finish    final message carries finish_reason and usage; quota refunded
    With tools, the relayed text is read for tool calls (``tools.with_tool_calls``); with echo
    the first message carries the prompt's text (prompt logprobs ride on it from the engine).
    Colocated engines skip 5-6: their Decode prefills too. Every outbound call gets the
    deadline left on the client's; on client cancel, deadline or error the calls in flight are
    cancelled and Engine.Abort is sent best effort (the engine frees the request's blocks).
Which instances serve together is ``grouping``'s; steps 4-7 run in ``running`` (each engine
call in ``phases``); this module admits, relays and answers the other rpcs.
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
from services.router.flow import Flow
from services.router.grouping import Groups
from services.router.health import StallLimits
from services.router.instances import Instance, InstancePool
from services.router.model import ModelSpec
from services.router.policy import RouteQuery, RoutingPolicy
from services.router.prefix import IndexClient
from services.router.preparing import Preparer
from services.router.quotas import QuotaBook, QuotaExceeded
from services.router.requests import Prepared, RouterLimits, detokenize, tokenize
from services.router.running import Runner
from services.router.slo_admission import SloGate
from services.router.tools import with_tool_calls

log = logging.getLogger(__name__)


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
    stalls: StallLimits = field(default_factory=StallLimits)  # when a silent engine is left
    poll_interval: float = 1.0
    recheck_interval: float = 0.2  # seconds between checks of the instances out of rotation
    tool_call_parser: str = "auto"
    controller: RouterController | None = None  # --controller: told of each request
    slo_gate: SloGate | None = None  # --slo-admission
    counters: RouterCounters = field(default_factory=RouterCounters)
    fingerprint_order: dict[str, int] = field(default_factory=dict)  # first seen: 0, 1, ...
    num_in_flight: int = 0
    _poll_task: asyncio.Task[None] | None = None
    _recheck_task: asyncio.Task[None] | None = None
    _background: set[asyncio.Task[object]] = field(default_factory=set)
    groups: Groups = field(init=False)  # which instances serve together (``grouping``)
    runner: Runner = field(init=False)  # steps 4-7 across them (``running``)

    def __post_init__(self) -> None:
        self.groups = Groups(self.pool, self.model, self.fingerprint_order)
        self.runner = Runner(self.policy, self.pool, self.groups, self._count_placement)

    async def start(self) -> None:
        await self.poll()
        self._poll_task = asyncio.create_task(self._poll_loop())
        self._recheck_task = asyncio.create_task(
            self.pool.recheck_loop(self.recheck_interval))

    async def stop(self) -> None:
        for task in (self._poll_task, self._recheck_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
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
                    self.max_retries, max_wait=self.max_wait, stalls=self.stalls,
                    came_back=lambda: self.pool.came_back)
        self.num_in_flight += 1
        metrics.IN_FLIGHT.inc()
        self.counters.num_requests += 1
        try:
            group = await self.groups.wait(flow)
            hashes = await self.preparer.hash(prepared, self.block_size, group.fingerprint)
            flow.query = RouteQuery(len(prepared.prompt_ids), self.block_size, len(hashes),
                                    await self.index.lookup(hashes))
            messages = self.runner.run(flow, group)
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

    def _count_placement(self, flow: Flow) -> None:
        assert flow.choice is not None and flow.query is not None
        p, d = flow.choice.prefill, flow.choice.decode
        metrics.DECISIONS.labels(self.policy.name, p.instance_id if p else "", d.instance_id).inc()
        self.counters.num_prompt_blocks += flow.query.num_blocks
        self.counters.num_prefix_hit_blocks += flow.choice.cached_blocks
        metrics.PROMPT_BLOCKS.inc(flow.query.num_blocks)
        metrics.PREFIX_HIT_BLOCKS.inc(flow.choice.cached_blocks)


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
