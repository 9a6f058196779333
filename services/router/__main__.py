"""``python -m services.router``: flags -> RouterConfig -> server -> serve."""

from __future__ import annotations

import functools
import sys
from collections.abc import Awaitable, Callable

from pdserve import auth
from pdserve.server import Service, event_loop, make_server, run_grpc_main
from services.router.admission import AdmissionQueue
from services.router.config import RouterConfig
from services.router.controlling import calibrated_model, maybe_controller
from services.router.core import Router
from services.router.health import StallLimits
from services.router.instances import InstancePool
from services.router.model import ModelSpec, load_model_spec
from services.router.policy import make_policy
from services.router.prefix import IndexClient, PrefixLookup
from services.router.quotas import QuotaBook, load_quotas
from services.router.requests import RouterLimits
from services.router.servicer import servicers
from services.router.slo_admission import SloGate

Hook = Callable[[], Awaitable[None]]


def _redis_index(config: RouterConfig) -> PrefixLookup | None:
    if not config.redis_url:
        return None
    from pdserve.index import RedisPrefixIndex

    # The socket timeout only bounds a stuck connection; each lookup is bounded by
    # --index-timeout in IndexClient.
    return RedisPrefixIndex(config.redis_url, prefix=config.index_prefix,
                            timeout_s=max(1.0, config.index_timeout))


def build_router(config: RouterConfig, model: ModelSpec | None = None,
                 index: PrefixLookup | None = None) -> Router:
    """The router of ``config``; tests and benchmarks may pass the model and index in."""
    import redis.asyncio as aioredis

    redis = None
    if config.redis_url:
        redis = aioredis.Redis.from_url(config.redis_url, socket_timeout=1.0,
                                        socket_connect_timeout=1.0)
    # A busy engine answers its checks late, not never: a generous timeout, and only
    # several in a row take it out (a refused connection does at once).
    pool = InstancePool(config.prefill, config.decode, redis, config.registry_prefix,
                        credentials=auth.metadata([auth.DATA, auth.ADMIN]),
                        check_timeout=max(2.0, config.poll_interval),
                        max_check_failures=config.health_failures)
    quotas = load_quotas(config.quotas_file) if config.quotas_file else {}
    model = model or load_model_spec(config.model, config.served_model_name)
    admission = AdmissionQueue(config.max_concurrent, config.max_queued)
    controller = maybe_controller(config, pool)
    gate = SloGate(config.slo_admission, config.slo_ttft_ms / 1000, admission, pool,
                   controller.current_model if controller
                   else functools.partial(calibrated_model, config.controller_calibration),
                   config.max_wait) if config.slo_admission != "off" else None
    return Router(controller=controller, slo_gate=gate,
        model=model, pool=pool,
        index=IndexClient(index if index is not None else _redis_index(config),
                          config.index_timeout),
        policy=make_policy(config.policy), quotas=QuotaBook(quotas),
        block_size=config.block_size,
        limits=RouterLimits.for_model(model, config.max_prompt_tokens, config.max_tokens,
                                      config.max_prompt_bytes),
        admission=admission,
        max_wait=config.max_wait, max_retries=config.max_retries,
        stalls=StallLimits(config.first_answer_timeout, config.stall_timeout,
                           config.probe_timeout),
        poll_interval=config.poll_interval, recheck_interval=config.recheck_interval,
        tool_call_parser=config.tool_call_parser)


async def create_server(config: RouterConfig, model: ModelSpec | None = None,
                        index: PrefixLookup | None = None) -> Service:
    router = build_router(config, model, index)
    svc = make_server(config.host, config.port, servicers(router),
                      rules=[("/pdserve.v1.Router/", auth.CLIENT)])
    starts, stops = lifecycle(router)
    svc.on_start.extend(starts)
    svc.on_stop.extend(stops)
    return svc


def lifecycle(router: Router) -> tuple[list[Hook], list[Hook]]:
    """What starts ``router`` (in order) and what stops it (in order): the gRPC server's
    hooks, and the gateway's when it embeds the router (``services.gateway.embedded``)."""
    starts: list[Hook] = [router.start]
    stops: list[Hook] = [router.stop]
    if router.controller is not None:  # after the router's first poll: the roles are known
        starts.append(router.controller.start)
        stops.insert(0, router.controller.stop)
    return starts, stops


def main(argv: list[str] | None = None) -> int:
    return run_grpc_main(RouterConfig, create_server, argv, lambda c: event_loop(c.loop))


if __name__ == "__main__":
    sys.exit(main())
