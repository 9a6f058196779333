"""Prefill on engine A -> export wire blocks -> import on engine B -> decode continues, with
exactly the tokens a single engine produces."""

from __future__ import annotations

import torch

from pdserve.engine.engine import Engine
from pdserve.engine.request import RequestOutput
from pdserve.hashing import hash_blocks
from pdserve.sampling_params import SamplingParams
from tests.engine.helpers import GREEDY, make_engine, random_prompts, run_all


def _prefill(engine: Engine, prompts: list[list[int]]
             ) -> list[tuple[RequestOutput, list[tuple[bytes, int]]]]:
    """Run prefill_only requests; returns per request (first token, streamed blocks, final)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, GREEDY, prefill_only=True)
    streamed: dict[str, list[tuple[bytes, int]]] = {f"p{i}": [] for i in range(len(prompts))}
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            streamed[out.request_id] += out.new_full_blocks
            if out.finished:
                finals[out.request_id] = out
        engine.check_integrity()
    return [(finals[f"p{i}"], streamed[f"p{i}"]) for i in range(len(prompts))]


def test_prefill_export_import_decode_equals_single_engine() -> None:
    prompts = random_prompts([45, 16, 70, 5], seed=11)
    expected = run_all(make_engine(num_blocks=64), prompts)[0]

    a = make_engine(num_blocks=64, max_num_batched_tokens=32)  # chunked: blocks stream out
    results = _prefill(a, prompts)
    assert a.stats().num_held == len(prompts)
    wires = []
    for p, (final, streamed) in zip(prompts, results, strict=True):
        assert final.finished and final.finish_reason is None and len(final.new_token_ids) == 1
        assert final.block_hashes is not None and final.page_ids is not None
        assert final.block_hashes == hash_blocks(p, 16, a.fingerprint)
        assert list(zip(final.block_hashes, final.page_ids, strict=True)) == streamed
        # The wire buffer may be any memory, e.g. a view of a shared-memory segment.
        n = len(final.page_ids)
        shape = (n, *a.cache.block_shape)
        buf = bytearray(4 * max(1, torch.Size(shape).numel()))
        out = torch.frombuffer(buf, dtype=torch.float32)[: torch.Size(shape).numel()].view(shape)
        a.export_blocks(final.page_ids, out)
        wires.append((final.block_hashes, out, final.new_token_ids[0]))
        assert all(a.kv.pool.blocks[pg].ref_cnt >= 1 for pg in final.page_ids)
    for i in range(len(prompts)):
        a.release(f"p{i}")
    assert a.kv.pool.num_used == 0
    a.check_integrity()

    b = make_engine(num_blocks=64)
    got = []
    for p, (hashes, data, first) in zip(prompts, wires, strict=True):
        assert b.import_blocks(hashes, data) == len(hashes)
        assert b.import_blocks(hashes, data) == 0  # already cached
        before = b.stats()
        params = SamplingParams(max_tokens=GREEDY.max_tokens - 1, temperature=0.0,
                                ignore_eos=True)
        tokens = run_all(b, [p + [first]], params)[0][0]
        after = b.stats()
        # Only the trailing partial block and the first token were computed.
        assert after.num_prefix_hit_tokens - before.num_prefix_hit_tokens == 16 * len(hashes)
        assert after.num_prefill_tokens - before.num_prefill_tokens == len(p) + 1 - 16 * len(
            hashes)
        got.append([first] + tokens)
    assert got == expected
    b.check_integrity()


def test_export_rejects_bad_shapes_and_pages() -> None:
    import pytest

    a = make_engine(num_blocks=8)
    with pytest.raises(ValueError, match="out must have shape"):
        a.export_blocks([0], torch.empty(2, *a.cache.block_shape))
    with pytest.raises(ValueError, match="page_ids"):
        a.export_blocks([8], torch.empty(1, *a.cache.block_shape))
    with pytest.raises(ValueError, match="hashes"):
        a.import_blocks([b"x" * 32], torch.empty(2, *a.cache.block_shape))
    with pytest.raises(ValueError, match="not a finished held request"):
        a.release("nope")


def test_abort_of_held_request_releases_pages() -> None:
    a = make_engine(num_blocks=16)
    _prefill(a, random_prompts([40], seed=12))
    assert a.kv.pool.num_used == 3
    assert a.abort("p0")
    assert a.kv.pool.num_used == 0
    a.check_integrity()


def test_pages_held_by_prefill_only_requests_are_reported_not_hung() -> None:
    import pytest

    a = make_engine(num_blocks=4)
    _prefill(a, random_prompts([40], seed=13))   # holds 3 of 4 pages
    a.add_request("next", random_prompts([40], seed=14)[0], GREEDY)
    with pytest.raises(RuntimeError, match="held by 1 prefill_only"):
        a.step()
    a.release("p0")
    finished = []
    while a.has_unfinished():
        finished += [o.request_id for o in a.step() if o.finished]
    assert finished == ["next"]
    a.check_integrity()
