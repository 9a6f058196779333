"""Routing policies: which (prefill, decode) pair serves a request. The plug point is
``RoutingPolicy``; ``make_policy`` builds one by name.

cache_aware (the default) estimates each pair's time to first token::

    ttft(p, d) = queue wait on p                       (tokens queued ahead / p's prefill rate)
               + uncached prompt tokens / p's rate     (p's node already holds a prefix)
               + blocks d's node lacks * block time    (0 when p and d share a node)

and takes the decode side first: the least-loaded decodes that have room for the prompt's
blocks form a tie set, and the pair with the smallest ttft across it wins, so equal decodes are
split by locality. Remaining ties rotate, so an idle, cold cluster still spreads requests.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from services.router.instances import Instance

# The floor of the prefill rate estimate: engines report recent throughput (idle ones ~0), so
# an instance is credited with the fastest rate it has shown, and at least this.
DEFAULT_PREFILL_TOKENS_PER_S = 2000.0
# Moving one block between two kvds; pushes overlap prefill, so this is a tie-breaker scale.
TRANSFER_S_PER_BLOCK = 1e-4
T = TypeVar("T")


@dataclass(frozen=True)
class RouteQuery:
    """What a policy knows about one request."""

    num_prompt_tokens: int
    block_size: int
    num_blocks: int  # full prompt blocks
    held: Mapping[str, int] | None  # kvd node -> leading blocks it holds; None = index down


class Choice(NamedTuple):
    prefill: Instance | None  # None: colocated, ``decode`` prefills itself
    decode: Instance
    cached_blocks: int  # leading prompt blocks the prefilling node already holds


def cached_blocks(query: RouteQuery, inst: Instance) -> int:
    if not query.held or not inst.kvd_node_id:
        return 0
    return min(query.num_blocks, query.held.get(inst.kvd_node_id, 0))


class RoutingPolicy(ABC):
    """Contract: ``choose`` picks from the given healthy candidates only (retries pass fewer)
    and returns None when it cannot place the request. ``prefills`` empty means colocated:
    ``decodes`` then are engines doing both phases and ``Choice.prefill`` is None. Called on the
    event loop, once per attempt: it must not block or await."""

    name: str

    @abstractmethod
    def choose(self, query: RouteQuery, prefills: Sequence[Instance],
               decodes: Sequence[Instance]) -> Choice | None: ...


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next_prefill = itertools.count()
        self._next_decode = itertools.count()

    def choose(self, query: RouteQuery, prefills: Sequence[Instance],
               decodes: Sequence[Instance]) -> Choice | None:
        if not decodes:
            return None
        decode = _sorted(decodes)[next(self._next_decode) % len(decodes)]
        if not prefills:
            return Choice(None, decode, cached_blocks(query, decode))
        prefill = _sorted(prefills)[next(self._next_prefill) % len(prefills)]
        return Choice(prefill, decode, cached_blocks(query, prefill))


class LeastLoad(RoutingPolicy):
    """Fewest queued prefills, fewest running decodes; blind to the cache."""

    name = "least_load"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, query: RouteQuery, prefills: Sequence[Instance],
               decodes: Sequence[Instance]) -> Choice | None:
        if not decodes:
            return None
        turn = next(self._turn)
        decode = _least(_sorted(decodes), lambda i: i.decode_load, turn)
        if not prefills:
            return Choice(None, decode, cached_blocks(query, decode))
        prefill = _least(_sorted(prefills), lambda i: i.prefill_load, turn)
        return Choice(prefill, decode, cached_blocks(query, prefill))


class CacheAware(RoutingPolicy):
    name = "cache_aware"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, query: RouteQuery, prefills: Sequence[Instance],
               decodes: Sequence[Instance]) -> Choice | None:
        if not decodes:
            return None
        turn = next(self._turn)
        if not prefills:  # colocated: the engine's own cache and queue decide
            best = _least(_sorted(decodes),
                          lambda d: (self.ttft(query, d, None), d.decode_load), turn)
            return Choice(None, best, cached_blocks(query, best))
        fits = [d for d in decodes if d.stats.kv_blocks_free > query.num_blocks] or list(decodes)
        min_load = min(d.decode_load for d in fits)
        tier = [d for d in fits if d.decode_load == min_load]
        pairs = [(p, d) for d in _sorted(tier) for p in _sorted(prefills)]
        p, d = _least(pairs, lambda pd: self.ttft(query, pd[0], pd[1]), turn)
        return Choice(p, d, cached_blocks(query, p))

    @staticmethod
    def ttft(query: RouteQuery, prefill: Instance, decode: Instance | None) -> float:
        rate = max(prefill.peak_prefill_tokens_per_s, DEFAULT_PREFILL_TOKENS_PER_S)
        hit = cached_blocks(query, prefill)
        uncached = query.num_prompt_tokens - hit * query.block_size
        queued = max(prefill.num_inflight_prefill_tokens,
                     prefill.stats.queue_depth * query.num_prompt_tokens)
        missing = 0
        if decode is not None and decode.kvd_node_id != prefill.kvd_node_id:
            missing = query.num_blocks - cached_blocks(query, decode)
        return (queued + uncached) / rate + missing * TRANSFER_S_PER_BLOCK


def _sorted(instances: Sequence[Instance]) -> list[Instance]:
    return sorted(instances, key=lambda i: i.instance_id)


def _least(items: Sequence[T], key: Callable[[T], Any], turn: int) -> T:
    """Smallest by ``key``; among equals (in id order), the one ``turn`` rotates to."""
    keyed = [(key(x), x) for x in items]
    best = min(k for k, _ in keyed)
    ties = [x for k, x in keyed if k == best]
    return ties[turn % len(ties)]


POLICIES: Mapping[str, type[RoutingPolicy]] = {
    p.name: p for p in (CacheAware, LeastLoad, RoundRobin)
}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"--policy: {name!r} is not one of {', '.join(POLICIES)}")
    return POLICIES[name]()
