"""Sampler unit tests on crafted logits, and sampling/stop behaviour through the offline API."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams
from tests.engine.helpers import make_engine, random_prompts

PROBS = [0.5, 0.3, 0.15, 0.05]


def _reqs(n: int, **kw: object) -> list[Request]:
    p = SamplingParams(**kw)  # type: ignore[arg-type]
    return [Request(f"r{i}", [1], p, arrival=i, max_len=10, eos_token_ids=frozenset())
            for i in range(n)]


def _draw(n: int, **kw: object) -> torch.Tensor:
    logits = torch.tensor(PROBS).log().repeat(n, 1)
    return torch.tensor(Sampler(seed=0)(logits, _reqs(n, **kw)).token_ids)


@pytest.mark.parametrize(("kw", "allowed"), [
    ({}, {0, 1, 2, 3}),
    ({"top_k": 2}, {0, 1}),
    ({"top_p": 0.7}, {0, 1}),          # 0.5 < 0.7 -> keep 0.3 too; then 0.8 >= 0.7 stops
    ({"top_p": 0.5}, {0}),
    ({"min_p": 0.5}, {0, 1}),          # keep p >= 0.25
    ({"min_p": 0.2, "top_k": 3}, {0, 1, 2}),
])
def test_filters_keep_exactly_the_allowed_tokens(kw: dict, allowed: set[int]) -> None:
    tokens = _draw(2000, temperature=1.0, **kw)
    assert set(tokens.tolist()) == allowed


def test_sampling_follows_the_distribution() -> None:
    tokens = _draw(4000, temperature=1.0)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    torch.testing.assert_close(freq, torch.tensor(PROBS), atol=0.03, rtol=0)


def test_low_temperature_is_nearly_greedy_and_zero_is_greedy() -> None:
    assert set(_draw(500, temperature=0.0).tolist()) == {0}
    assert (_draw(500, temperature=0.05) == 0).float().mean() > 0.99


def test_logprobs_consistent() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, _reqs(3, temperature=0.0, logprobs=5))
    ref = logits.log_softmax(-1)
    for row, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert lp is not None and len(lp.top) == 5
        assert tok == lp.top[0][0]
        assert lp.logprob == pytest.approx(max(v for _, v in lp.top))
        assert lp.logprob == pytest.approx(ref[row].max().item(), abs=1e-6)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM.from_engine(make_engine(num_blocks=256))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts([5, 30, 12], seed=21)


def test_seed_reproduces_regardless_of_batch(llm: LLM, prompts) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=123, ignore_eos=True)
    free = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded)[0].token_ids
    batched = llm.generate(prompts, [seeded, free, free])
    later = llm.generate([prompts[2], prompts[0]], [free, seeded])
    assert batched[0].token_ids == alone
    assert later[1].token_ids == alone
    other = llm.generate([prompts[0]], SamplingParams(max_tokens=16, seed=124,
                                                      ignore_eos=True))[0].token_ids
    assert other != alone


def test_top_k_1_equals_greedy(llm: LLM, prompts) -> None:
    greedy = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0,
                                                  ignore_eos=True))
    top1 = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=1.5, top_k=1,
                                                ignore_eos=True))
    assert [c.token_ids for c in top1] == [c.token_ids for c in greedy]


def test_logprobs_through_engine(llm: LLM, prompts) -> None:
    out = llm.generate(prompts[1], SamplingParams(max_tokens=6, temperature=0.0,
                                                  logprobs=3, ignore_eos=True))[0]
    assert out.logprobs is not None and len(out.logprobs) == 6
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.top[0][0] == tok and lp.logprob == max(v for _, v in lp.top)
        assert math.exp(lp.logprob) <= 1.0


def test_stop_string_truncates_exactly(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    base = llm.generate("Once upon a time", greedy)[0]
    text = base.text
    assert len(text) > 12
    stop = text[6:9]
    cut = text.find(stop)
    out = llm.generate("Once upon a time", SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop, "\x00never"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]
    assert out.token_ids == base.token_ids[:len(out.token_ids)]
    assert stop in llm.tokenizer.decode(out.token_ids)
    assert stop not in llm.tokenizer.decode(out.token_ids[:-1])
    inc = llm.generate("Once upon a time", SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, stop=stop,
        include_stop_str_in_output=True))[0]
    assert inc.text == text[:cut + len(stop)]


def test_stop_token_ids_eos_and_length(llm: LLM, prompts) -> None:
    base = llm.generate(prompts[1], SamplingParams(max_tokens=20, temperature=0.0,
                                                   ignore_eos=True))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 20
    target = base.token_ids[5]
    first = base.token_ids.index(target)
    out = llm.generate(prompts[1], SamplingParams(max_tokens=20, temperature=0.0,
                                                  stop_token_ids=[target]))[0]
    assert (out.finish_reason, out.token_ids) == ("stop", base.token_ids[:first + 1])
    engine = llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({target})
    try:
        eos = llm.generate(prompts[1], SamplingParams(max_tokens=20, temperature=0.0))[0]
        ignored = llm.generate(prompts[1], SamplingParams(max_tokens=20, temperature=0.0,
                                                          ignore_eos=True))[0]
    finally:
        engine.eos_token_ids = saved
    assert (eos.finish_reason, eos.token_ids) == ("stop", base.token_ids[:first + 1])
    assert ignored.token_ids == base.token_ids


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the aten ops a block of code runs."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("kw", "sorts"), [({"temperature": 0.8}, False),
                                           ({"temperature": 0.8, "min_p": 0.1}, False),
                                           ({"temperature": 0.8, "top_k": 5}, True),
                                           ({"temperature": 0.8, "top_p": 0.9}, True)])
def test_vocabulary_is_sorted_only_for_top_k_or_top_p(kw: dict, sorts: bool) -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    with _Ops() as ops:
        Sampler(seed=0)(logits, _reqs(4, **kw))
    assert ("sort" in ops.names) is sorts, sorted(ops.names)
