"""Engine behaviour on the built-in tiny model: batching, prefix cache, chunking, preemption,
priority, abort. Outputs must not depend on any of them."""

from __future__ import annotations

import pytest

from pdserve.sampling_params import SamplingParams
from tests.engine.helpers import GREEDY, make_engine, random_prompts, run_all

LENS = [1, 3, 15, 16, 17, 31, 40, 64, 70, 100, 128, 150, 200, 230, 260, 300]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(LENS, seed=1)


@pytest.fixture(scope="module")
def alone(prompts: list[list[int]]) -> list[list[int]]:
    """Reference: each prompt alone on a fresh engine without prefix caching."""
    out = []
    for p in prompts:
        engine = make_engine(num_blocks=64, enable_prefix_caching=False)
        out += run_all(engine, [p])[0]
    return out


def test_batch_of_16_equals_alone(prompts, alone) -> None:
    engine = make_engine(num_blocks=512)
    tokens, reasons, _ = run_all(engine, prompts)
    assert tokens == alone
    assert all(len(t) == GREEDY.max_tokens for t in tokens)
    assert set(reasons.values()) == {"length"}
    assert engine.kv.pool.num_used == 0


def test_chunked_prefill_equals_alone(prompts, alone) -> None:
    engine = make_engine(num_blocks=512, max_num_batched_tokens=24)
    tokens, _, _ = run_all(engine, prompts)
    assert tokens == alone
    assert engine.stats().num_prefill_tokens == sum(LENS)


def test_preemption_equals_alone(prompts, alone) -> None:
    engine = make_engine(num_blocks=24, max_num_batched_tokens=512)
    tokens, _, _ = run_all(engine, prompts)
    assert engine.stats().num_preemptions > 0
    assert tokens == alone


def test_prefix_hits_equal_misses() -> None:
    shared = random_prompts([80], seed=7)[0]
    prompts = random_prompts([5, 20, 33], seed=8, prefix=shared)
    cold = make_engine(num_blocks=128, enable_prefix_caching=False)
    expected = run_all(cold, prompts)[0]
    warm = make_engine(num_blocks=128)
    first = run_all(warm, prompts[:1])[0]
    hits_before = warm.stats().num_prefix_hit_tokens
    rest = run_all(warm, prompts[1:])[0]
    # 80 shared tokens = 5 full blocks of 16, reused by each of the two later prompts.
    assert warm.stats().num_prefix_hit_tokens - hits_before == 2 * 80
    assert first + rest == expected
    # Re-running a prompt hits all of its full blocks except it recomputes the last token.
    again = run_all(warm, [prompts[0]])[0]
    assert again == expected[:1]


def test_full_prompt_hit_still_computes_last_token() -> None:
    prompt = random_prompts([32], seed=3)[0]  # exactly two full blocks
    engine = make_engine(num_blocks=32)
    first = run_all(engine, [prompt])[0]
    before = engine.stats()
    second = run_all(engine, [prompt])[0]
    after = engine.stats()
    assert second == first
    assert after.num_prefix_hit_tokens - before.num_prefix_hit_tokens == 16
    assert after.num_prefill_tokens - before.num_prefill_tokens == 16


def test_priority_then_fifo() -> None:
    engine = make_engine(num_blocks=64, max_num_seqs=1)
    prompts = random_prompts([4, 4, 4, 4], seed=2)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    _, _, order = run_all(engine, prompts, params, priorities=[5, 1, 5, 0])
    assert order == ["3", "1", "0", "2"]


def test_abort_releases_all_blocks() -> None:
    engine = make_engine(num_blocks=64, max_num_batched_tokens=32)
    for i, p in enumerate(random_prompts([100, 50, 10], seed=4)):
        engine.add_request(f"a{i}", p, GREEDY)
    engine.step()  # a0 is mid-prefill (chunk of 32), the others wait
    assert engine.abort("a0") and engine.abort("a2")
    assert not engine.abort("nope")
    engine.step()
    engine.check_integrity()
    assert engine.abort("a1")  # running now
    outs = engine.step()
    assert {o.request_id for o in outs if o.finish_reason == "abort"} == {"a1"}
    assert not engine.has_unfinished()
    assert engine.kv.pool.num_used == 0
    engine.check_integrity()


def test_stats_count_decode_tokens() -> None:
    engine = make_engine(num_blocks=64)
    run_all(engine, random_prompts([10, 20], seed=5))
    stats = engine.stats()
    assert stats.num_prefill_tokens == 30
    assert stats.num_decode_tokens == 2 * (GREEDY.max_tokens - 1)
    assert (stats.num_waiting, stats.num_running, stats.num_blocks_used) == (0, 0, 0)


def test_preemption_picks_the_least_urgent_request() -> None:
    engine = make_engine(num_blocks=6, max_num_batched_tokens=512)
    urgent, relaxed = random_prompts([40, 40], seed=9)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    engine.add_request("relaxed", relaxed, params, priority=3)
    engine.add_request("urgent", urgent, params, priority=1)
    reqs = {rid: engine.requests[rid] for rid in ("relaxed", "urgent")}
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
        engine.check_integrity()
    assert reqs["urgent"].num_preemptions == 0
    assert reqs["relaxed"].num_preemptions >= 1
    assert order == ["urgent", "relaxed"]


@pytest.mark.parametrize("cap", [16, 23])  # 23: chunks that end inside KV blocks
def test_a_prefill_cap_chunks_prompts_without_holding_back_decodes(prompts, alone,
                                                                   cap: int) -> None:
    """``max_prefill_tokens`` (a colocated engine's chunk under an ITL bound) caps the prompt
    tokens of each step that decodes; every running answer still gets its token in every
    step; a step with no answer to stall takes the whole budget."""
    engine = make_engine(num_blocks=512, max_num_batched_tokens=512)
    engine.scheduler.max_prefill_tokens = cap
    steps: list[tuple[int, int, int]] = []  # prompt tokens, answers scheduled, answers running
    schedule = engine.scheduler.schedule

    def recording() -> object:
        decoding = sum(r.num_computed_tokens >= r.num_prompt_tokens
                       for r in engine.scheduler.running)
        batch = schedule()
        prompt = sum(n for r, n in zip(batch.reqs, batch.num_new_tokens, strict=True)
                     if r.num_computed_tokens < r.num_prompt_tokens)
        steps.append((prompt, len(batch.reqs) - sum(
            r.num_computed_tokens < r.num_prompt_tokens for r in batch.reqs), decoding))
        return batch

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    tokens, _, _ = run_all(engine, prompts)
    assert tokens == alone
    assert max(p for p, scheduled, _ in steps if scheduled) == cap
    assert all(scheduled == running for _, scheduled, running in steps)
    assert steps[0] == (512, 0, 0)  # the first step: no answer to stall, the whole budget
