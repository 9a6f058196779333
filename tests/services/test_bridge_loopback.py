"""The prefill -> decode hand-over in-process, through a loopback kvd (an in-memory slot
pool with the KvdClient methods the bridge uses). It checks the engine-side logic — which
blocks are exported, when pages are released, checksums of the slot bytes, prefix loading,
import on decode — without processes; the real kvds over UCX are in test_disaggregated.py."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pdserve.hashing import block_checksum
from pdserve.kvd.bridge import INLINE_COPY_BYTES
from pdserve.kvd.client import CommitEntry, Pin
from pdserve.proto.v1 import common_pb2
from services.engine.config import EngineServiceConfig
from tests.services.harness import engine, serve, tokens_of
from tests.services.test_engine_services import assert_idle, expected


class LoopbackKvd:
    def __init__(self, num_slots: int, shape: Sequence[int], dtype: torch.dtype) -> None:
        self.data = torch.zeros(num_slots, *shape, dtype=dtype)
        self.free = list(range(num_slots))
        self.present: dict[bytes, int] = {}
        self.pins: dict[int, int] = {}  # pin id -> slot
        self._ids = itertools.count(1)
        self.num_commits = 0
        self.destinations: list[str] = []
        # what the bridge reads of the registered pool: a slot's size
        self.info = SimpleNamespace(slot_bytes=self.data[0].numel() * self.data.element_size())

    async def register(self, layout: Any) -> Any:
        return SimpleNamespace(node_id="loop", epoch=1)

    def slot_view(self, slot: int) -> torch.Tensor:
        return self.data[slot]

    def slot_memory(self, slot: int) -> memoryview:
        return memoryview(self.data[slot].view(torch.uint8).numpy()).cast("B")

    def _pin(self, slot: int) -> Pin:
        pin_id = next(self._ids)
        self.pins[pin_id] = slot
        return Pin(slot=slot, pin_id=pin_id)

    async def allocate(self, n: int) -> list[Pin]:
        assert len(self.free) >= n, "loopback pool exhausted"
        return [self._pin(self.free.pop()) for _ in range(n)]

    async def commit(self, entries: Sequence[CommitEntry], destination: Any,
                     release: bool = True) -> None:
        for e in entries:
            assert block_checksum(self.slot_memory(e.pin.slot)) == e.checksum
            if e.hash in self.present:
                self.free.append(e.pin.slot)
            else:
                self.present[e.hash] = e.pin.slot
            if release:
                del self.pins[e.pin.pin_id]
        self.num_commits += len(entries)
        if destination is not None:
            self.destinations.append(destination.address)

    async def lookup(self, hashes: Sequence[bytes]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.present:
            n += 1
        return n

    async def lookup_cluster(self, hashes: Sequence[bytes]) -> tuple[int, int]:
        n = await self.lookup(hashes)
        return n, n  # one node: nothing elsewhere

    async def await_blocks(self, refs: Sequence[common_pb2.BlockRef], source: Any,
                           timeout: float) -> list[Pin]:
        if any(r.hash not in self.present for r in refs):
            await asyncio.sleep(timeout)
            raise TimeoutError("blocks did not arrive")
        for r in refs:
            if r.checksum:
                assert block_checksum(self.slot_memory(self.present[r.hash])) == r.checksum
        return [self._pin(self.present[r.hash]) for r in refs]

    async def release(self, pin_ids: Sequence[int]) -> None:
        for p in pin_ids:
            del self.pins[p]

    async def close(self) -> None:
        pass


def _kvd() -> LoopbackKvd:
    eng = engine()
    return LoopbackKvd(64, eng.cache.block_shape, eng.config.dtype)


async def test_prefill_blocks_carry_decode_to_the_offline_tokens() -> None:
    prompt = [(13 * i) % 250 + 2 for i in range(83)]
    kvd = _kvd()
    dest = common_pb2.KvdEndpoint(node_id="b", address="127.0.0.1:2")
    p_cfg = EngineServiceConfig(role="prefill", num_blocks=64, max_num_batched_tokens=32)
    d_cfg = EngineServiceConfig(role="decode", num_blocks=64)
    async with serve(p_cfg, engine("tiny", 64, "prefill", chunk=32), kvd) as p, \
            serve(d_cfg, engine("tiny", 64, "decode"), kvd) as d:
        first = await p.prefill("bridge-1", prompt, 10, destination=dest)
        assert [b.hash for b in first.blocks] == list(kvd.present)[:5]
        assert all(b.checksum for b in first.blocks)
        assert kvd.destinations and set(kvd.destinations) == {"127.0.0.1:2"}
        # Chunks of 32 tokens: blocks were committed chunk by chunk, not all at the end.
        assert kvd.num_commits == 5 and len(kvd.destinations) >= 2
        await assert_idle(p)
        chunks = await d.decode("bridge-1", prompt, 10, prefilled=first)
        assert [first.first_token_id, *tokens_of(chunks)] == expected(prompt, 10)
        d_stats = await d.stats()
        assert d_stats.prefill_tokens_computed == len(prompt) % 16 + 1  # tail + first token
        await assert_idle(d)
    assert kvd.pins == {}


async def test_fresh_prefill_loads_the_prefix_from_kvd() -> None:
    prefix = [(17 * i) % 250 + 2 for i in range(64)]
    kvd = _kvd()
    cfg = EngineServiceConfig(role="prefill", num_blocks=64)
    async with serve(cfg, engine("tiny", 64, "p-a"), kvd) as p:
        await p.prefill("pa", prefix + [3, 4, 5])
    async with serve(cfg, engine("tiny", 64, "p-b"), kvd) as fresh:
        before = (await fresh.stats()).prefill_tokens_computed
        second = prefix + [9, 8, 7]
        resp = await fresh.prefill("pb", second)
        assert resp.cached_tokens == len(prefix)
        computed = (await fresh.stats()).prefill_tokens_computed - before
        assert computed == len(second) - len(prefix)
        assert resp.first_token_id == expected(second, 1)[0]
        assert all(b.checksum for b in resp.blocks)  # loaded blocks get their checksum too
        await assert_idle(fresh)
    assert kvd.pins == {}


class SlowReleaseKvd(LoopbackKvd):
    """A kvd whose Release is answered only when ``answer`` is set, or fails with ``error``."""

    def __init__(self, *args: Any, error: Exception | None = None) -> None:
        super().__init__(*args)
        self.answer = asyncio.Event()
        self.error = error
        self.num_asked = 0

    async def release(self, pin_ids: Sequence[int]) -> None:
        self.num_asked += 1
        await self.answer.wait()
        if self.error is not None:
            raise self.error
        await super().release(pin_ids)


def _slow(error: Exception | None = None) -> SlowReleaseKvd:
    eng = engine()
    return SlowReleaseKvd(64, eng.cache.block_shape, eng.config.dtype, error=error)


async def _hand_over(kvd: LoopbackKvd, tag: str) -> None:
    """Prefill a 40-token prompt (2 full blocks) into ``kvd``, decode it on another engine,
    and leave the decode instance's bridge with whatever it still waits for."""
    prompt = [(11 * i) % 250 + 2 for i in range(40)]
    dest = common_pb2.KvdEndpoint(node_id="b", address="127.0.0.1:2")
    async with serve(EngineServiceConfig(role="prefill", num_blocks=64),
                     engine("tiny", 64, f"{tag}-p"), kvd) as p:
        first = await p.prefill(f"{tag}-1", prompt, 6, destination=dest)
    d_cfg = EngineServiceConfig(role="decode", num_blocks=64)
    async with serve(d_cfg, engine("tiny", 64, f"{tag}-d"), kvd) as d:
        chunks = await d.decode(f"{tag}-1", prompt, 6, prefilled=first)
        # the answer streamed while the reader's Release was not answered yet
        assert [first.first_token_id, *tokens_of(chunks)] == expected(prompt, 6)
        assert isinstance(kvd, SlowReleaseKvd) and kvd.num_asked == 1
        assert len(kvd.pins) == 2  # the decode's two read pins, on their way back
        assert d.instance is not None and d.instance.bridge is not None
        assert d.instance.bridge._releasing  # noqa: SLF001 - what stop() drains
        kvd.answer.set()  # serve's exit stops the instance, which drains the Release


async def test_a_decode_does_not_wait_for_the_kvd_to_answer_its_release() -> None:
    kvd = _slow()
    await _hand_over(kvd, "slow-release")
    assert kvd.pins == {}


async def test_a_release_that_fails_in_the_background_is_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    kvd = _slow(error=RuntimeError("kvd went away"))
    with caplog.at_level(logging.WARNING, logger="pdserve.kvd.bridge"):
        await _hand_over(kvd, "failed-release")
    failed = [r for r in caplog.records if r.getMessage().startswith("kvd release failed")]
    assert len(failed) == 1
    assert failed[0].fields == {"error": "kvd went away", "num_pins": 2}  # type: ignore[attr-defined]
    assert len(kvd.pins) == 2  # never released here: the kvd's lease frees them


async def _import_threads(label: str, slot_bytes: int | None) -> list[int]:
    """Hand a two-block prompt over through a loopback kvd whose slots are ``slot_bytes``
    long (the tiny model's own if None); the threads the decode engine's imports ran on."""
    kvd = _kvd()
    if slot_bytes is not None:
        kvd.info.slot_bytes = slot_bytes
    prompt = [(7 * i) % 250 + 2 for i in range(40)]  # two full blocks
    dest = common_pb2.KvdEndpoint(node_id="b", address="127.0.0.1:2")
    async with serve(EngineServiceConfig(role="prefill", num_blocks=64),
                     engine("tiny", 64, f"inline-{label}-p"), kvd) as p:
        first = await p.prefill(f"{label}-1", prompt, 4, destination=dest)
    eng = engine("tiny", 64, f"inline-{label}-d")
    plain, threads = eng.import_blocks, []

    def import_blocks(*args: Any, **kwargs: Any) -> int:
        threads.append(threading.get_ident())
        return plain(*args, **kwargs)

    eng.import_blocks = import_blocks  # type: ignore[method-assign]
    try:
        async with serve(EngineServiceConfig(role="decode", num_blocks=64), eng, kvd) as d:
            await asyncio.sleep(0.05)  # the engine thread parks
            chunks = await d.decode(f"{label}-1", prompt, 4, prefilled=first)
            assert [first.first_token_id, *tokens_of(chunks)] == expected(prompt, 4)
    finally:
        eng.import_blocks = plain  # type: ignore[method-assign]
    return threads


async def test_a_small_copy_runs_on_the_callers_thread_and_a_large_one_on_the_engine_thread(
        ) -> None:
    """The bridge's copies ask to run inline up to INLINE_COPY_BYTES: a decode's copy of two
    small blocks runs on the event loop (its engine thread is parked); blocks that add up to
    more go to the engine thread, so a big copy never holds up the loop."""
    loop_thread = threading.get_ident()
    assert await _import_threads("small", None) == [loop_thread]
    large = await _import_threads("large", INLINE_COPY_BYTES // 2 + 1)  # two are over it
    assert len(large) == 1 and large != [loop_thread]
