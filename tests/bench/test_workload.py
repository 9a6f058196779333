"""Seeded workloads: reproducibility, Poisson arrivals, length ranges, field validation."""

from __future__ import annotations

import math
import statistics

import pytest

from pdserve_bench.workload import (
    LengthRange,
    PromptMaker,
    WorkloadSpec,
    chat_messages,
    completion_prompt,
    make_plan,
    seeded_rng,
)


def test_same_seed_same_plan_other_seed_other_plan() -> None:
    spec = WorkloadSpec("mixed")
    a = make_plan(spec, 2.0, seed=7, num_requests=50)
    assert a == make_plan(spec, 2.0, seed=7, num_requests=50)
    b = make_plan(spec, 2.0, seed=8, num_requests=50)
    assert [c.turns[0].text for c in a.conversations] != [c.turns[0].text for c in b.conversations]
    # another stream (another rate of a sweep) never repeats the prompts
    c = make_plan(spec, 2.0, seed=7, num_requests=50, stream="rate1")
    assert not {t.text for x in a.conversations for t in x.turns} & {
        t.text for x in c.conversations for t in x.turns}


def test_poisson_inter_arrival_mean_and_spread() -> None:
    plan = make_plan(WorkloadSpec("chat"), 10.0, seed=1, num_requests=4000)
    arrivals = [c.arrival_s for c in plan.conversations]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert arrivals[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.05)
    # exponential: standard deviation equals the mean
    assert statistics.pstdev(gaps) == pytest.approx(0.1, rel=0.1)


def test_burst_rate_sends_everything_at_zero() -> None:
    plan = make_plan(WorkloadSpec("chat"), math.inf, seed=0, num_requests=5)
    assert [c.arrival_s for c in plan.conversations] == [0.0] * 5


def test_mixed_draws_both_kinds_within_their_ranges() -> None:
    spec = WorkloadSpec("mixed", rag_fraction=0.3)
    plan = make_plan(spec, 1.0, seed=3, num_requests=1000)
    turns = [c.turns[0] for c in plan.conversations]
    rag = [t for t in turns if t.kind == "rag"]
    assert len(rag) / len(turns) == pytest.approx(0.3, abs=0.05)
    for t in turns:
        inp, out = ((spec.rag_input, spec.rag_output) if t.kind == "rag"
                    else (spec.chat_input, spec.chat_output))
        assert inp.lo <= t.input_tokens <= inp.hi and out.lo <= t.max_tokens <= out.hi
        assert len(t.text.split()) == t.input_tokens  # 1 token per word by default


def test_multiturn_counts_turns_and_keeps_the_request_rate() -> None:
    spec = WorkloadSpec("multiturn")
    plan = make_plan(spec, 4.0, seed=0, num_requests=2001)
    assert plan.num_requests == 2001
    assert all(spec.turns.lo <= len(c.turns) <= spec.turns.hi for c in plan.conversations[:-1])
    span = plan.conversations[-1].arrival_s
    # conversations arrive at rate / mean turns, so turns are offered at ~rate
    assert plan.num_requests / span == pytest.approx(4.0, rel=0.1)
    first, later = plan.conversations[0].turns[0], plan.conversations[0].turns[1]
    assert spec.first_turn_input.lo <= first.input_tokens <= spec.first_turn_input.hi
    assert spec.turn_input.lo <= later.input_tokens <= spec.turn_input.hi


def test_turn_prompts_extend_the_previous_prompt_and_answer() -> None:
    plan = make_plan(WorkloadSpec("multiturn"), 1.0, seed=0, num_requests=6)
    turns = plan.conversations[0].turns
    history: list[dict[str, str]] = []
    prompts = []
    for i, turn in enumerate(turns):
        messages = chat_messages(history, turn)
        assert messages[:-1] == history and messages[-1]["content"] == turn.text
        prompts.append(completion_prompt(messages))
        history = [*messages, {"role": "assistant", "content": f"answer {i}"}]
    for shorter, longer in zip(prompts, prompts[1:], strict=False):
        assert longer.startswith(shorter) and len(longer) > len(shorter)


def test_duration_bounds_arrivals() -> None:
    plan = make_plan(WorkloadSpec("chat"), 5.0, seed=0, duration_s=10.0)
    assert all(c.arrival_s <= 10.0 for c in plan.conversations)
    assert 30 < plan.num_requests < 80


def test_prompt_maker_hits_exact_counts_with_a_tokenizer() -> None:
    def count(text: str) -> int:  # a tokenizer where every letter "e" is an extra token
        return len(text.split()) + text.count("e")

    maker = PromptMaker(count)
    rng = seeded_rng(0, "t")
    hits = [count(maker.make(rng, n)) == n for n in range(5, 60)]
    assert all(count(maker.make(rng, n)) <= n + 2 for n in range(5, 60))
    assert all(hits)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: LengthRange(0, 5), "1 <= lo <= hi"),
        (lambda: LengthRange(9, 5), "1 <= lo <= hi"),
        (lambda: WorkloadSpec("sharegpt"), "workload must be one of"),
        (lambda: WorkloadSpec("mixed", rag_fraction=1.5), "rag_fraction"),
        (lambda: WorkloadSpec.from_mapping("chat", {"chat_inptu": [1, 2]}),
         "unknown workload field 'chat_inptu'"),
        (lambda: WorkloadSpec.from_mapping("chat", {"chat_input": 5}), "'chat_input' must be"),
        (lambda: make_plan(WorkloadSpec(), 0.0, 0, num_requests=1), "rate must be > 0"),
        (lambda: make_plan(WorkloadSpec(), 1.0, 0), "exactly one of num_requests"),
        (lambda: make_plan(WorkloadSpec(), 1.0, 0, num_requests=0), "num_requests must be"),
        (lambda: make_plan(WorkloadSpec(), 1.0, 0, duration_s=-1), "duration must be"),
        (lambda: PromptMaker(tokens_per_word=0), "tokens_per_word"),
    ],
)
def test_bad_fields_are_named(build, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        build()


def test_shifting_sends_prompt_heavy_then_answer_heavy_halves() -> None:
    spec = WorkloadSpec("shifting")
    plan = make_plan(spec, 4.0, seed=3, num_requests=40)
    kinds = [c.turns[0].kind for c in plan.conversations]
    assert kinds == ["rag"] * 20 + ["chat"] * 20
    for c in plan.conversations:
        t = c.turns[0]
        inp, out = ((spec.rag_input, spec.rag_output) if t.kind == "rag"
                    else (spec.chat_input, spec.chat_output))
        assert inp.lo <= t.input_tokens <= inp.hi and out.lo <= t.max_tokens <= out.hi
    timed = make_plan(spec, 4.0, seed=3, duration_s=20.0)  # by time with a duration
    assert all((c.turns[0].kind == "chat") == (c.arrival_s >= 10.0) for c in timed.conversations)
