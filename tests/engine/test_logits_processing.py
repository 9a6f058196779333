"""Logits processing (``pdserve.engine.logits_process``): penalties and logit_bias by their
definitions on hand-computed rows, the grammar mask's bits, and the engine honouring each;
prompt logprobs (``pdserve.engine.prompt_logprobs``) under chunking and preemption."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch

from pdserve.engine.guided import apply_bitmask
from pdserve.engine.logits_process import LogitsState, process_logits
from pdserve.engine.request import Request
from pdserve.errors import BadRequest
from pdserve.sampling_params import SamplingParams
from pdserve.structured import StructuredOutput, json_schema
from tests.engine.helpers import make_engine, random_prompts, run_all

LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0]


def _request(params: SamplingParams, prompt: list[int], output: list[int],
             prior: int = 0) -> Request:
    req = Request("r", list(prompt), params, 0, 64, frozenset())
    req.token_ids = [*prompt, *output]
    req.logits_state = LogitsState(params, prompt, prior, None)
    return req


def test_penalties_and_bias_by_their_definitions() -> None:
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                            logit_bias={1: 5.0})
    # Prompt [4]; output [0, 0, 3]. By hand (bias first, then penalties):
    #   0: seen, 2 > 0 -> 2/2 = 1; - 0.5 * 2 - 0.25       = -0.25
    #   1: bias -1 + 5 = 4, never seen                     =  4.0
    #   2: untouched                                       =  0.5
    #   3: seen, 3/2 = 1.5; - 0.5 * 1 - 0.25               =  0.75
    #   4: in the prompt only, -2 < 0 -> -2 * 2 = -4       = -4.0
    plain = SamplingParams()
    reqs = [_request(params, [4], [0, 0, 3]), _request(plain, [4], [0, 0, 3])]
    reqs[1].logits_state = None
    logits = torch.tensor([LOGITS, LOGITS])
    out = process_logits(logits, reqs)
    assert out[0].tolist() == [-0.25, 4.0, 0.5, 0.75, -4.0]
    assert out[1].tolist() == LOGITS  # a row without processing is untouched


def test_output_counts_include_the_prefills_first_token() -> None:
    """On a decode engine the prefill's first token is the last prompt token (prior_output=1):
    it is output, not prompt, for the penalties, as it was on the prefill engine."""
    params = SamplingParams(frequency_penalty=1.0)
    decode_side = _request(params, [4, 3], [0], prior=1)
    prefill_side = _request(params, [4], [3, 0])
    a = process_logits(torch.tensor([LOGITS]), [decode_side])
    b = process_logits(torch.tensor([LOGITS]), [prefill_side])
    assert a.tolist() == b.tolist() == [[1.0, -1.0, 0.5, 2.0, -2.0]]


def test_the_bitmask_allows_exactly_its_bits() -> None:
    logits = torch.zeros(3, 40)
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[0, 0] = 0b101  # tokens 0 and 2
    mask[1, 1] = 1 << 3  # token 35
    mask[1, 0] = -(1 << 31)  # the sign bit: token 31
    apply_bitmask(logits, torch.tensor([0, 2]), mask)
    allowed = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    assert allowed == [[0, 2], list(range(40)), [31, 35]]


def test_logit_bias_steers_greedy_decoding() -> None:
    engine = make_engine(num_blocks=64)
    prompt = random_prompts([9], seed=4)[0]
    base = run_all(engine, [prompt], SamplingParams(max_tokens=3, temperature=0.0))[0][0]
    target = (base[0] + 1) % 500
    biased = SamplingParams(max_tokens=3, temperature=0.0, logit_bias={target: 100.0})
    assert run_all(engine, [prompt], biased)[0][0] == [target] * 3
    banned = SamplingParams(max_tokens=3, temperature=0.0, logit_bias={base[0]: -100.0})
    assert base[0] not in run_all(engine, [prompt], banned)[0][0]


def test_presence_penalty_changes_greedy_output_and_is_batched() -> None:
    engine = make_engine(num_blocks=64)
    prompt = random_prompts([7], seed=2)[0]
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    strict = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                            presence_penalty=2.0, logit_bias={0: -100.0})
    # One batch of both: each row gets its own processing.
    repeated, distinct = run_all(engine, [prompt, prompt], [free, strict])[0]
    assert len(set(repeated)) < len(repeated)  # the tiny model repeats itself ...
    assert repeated == run_all(engine, [prompt], free)[0][0]  # ... and batching changes nothing
    assert distinct != repeated


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999}}}


def test_json_schema_outputs_validate_for_many_seeds() -> None:
    engine = make_engine(num_blocks=128)
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=s,
                             structured=json_schema(SCHEMA)) for s in range(8)]
    outs, reasons, _ = run_all(engine, random_prompts([5] * 8, seed=1), params)
    assert set(reasons.values()) == {"stop"}
    for tokens in outs:
        jsonschema.validate(json.loads(engine.tokenizer.decode(tokens)), SCHEMA)


@pytest.mark.parametrize(("structured", "check"), [
    (StructuredOutput("choice", ("alpha", "beta gamma")), lambda t: t in ("alpha", "beta gamma")),
    (StructuredOutput("regex", r"[0-9]{3}-[a-z]{2}"), lambda t: len(t) == 6 and t[3] == "-"),
    (StructuredOutput("json_object"), lambda t: isinstance(json.loads(t), dict)),
    (StructuredOutput("grammar", 'start: "yes" | "no"'), lambda t: t in ("yes", "no")),
])
def test_each_structured_kind_is_followed(structured: StructuredOutput, check: object) -> None:
    engine = make_engine(num_blocks=64)
    assert engine.tokenizer is not None
    # The random tiny model would write JSON strings for ever: quotes and braces are nudged
    # up so an object closes within max_tokens (the grammar still decides what is valid).
    closers = {t: 4.0 for text in ('"', "}") for t in engine.tokenizer.encode(
        text, add_special_tokens=False)}
    params = SamplingParams(max_tokens=96, temperature=0.8, seed=5, structured=structured,
                            logit_bias=closers if structured.kind == "json_object" else {})
    tokens = run_all(engine, random_prompts([6], seed=9), params)[0][0]
    assert check(engine.tokenizer.decode(tokens))  # type: ignore[operator]


def test_grammar_state_crosses_the_hand_off() -> None:
    """Prefill engine: first token; decode engine: prompt + that token with prior_output=1
    replays it into a fresh matcher. Together they produce what one engine produces."""
    prompt = random_prompts([11], seed=3)[0]
    params = SamplingParams(max_tokens=64, temperature=0.0, structured=json_schema(SCHEMA))
    whole = run_all(make_engine(num_blocks=64), [prompt], params)[0][0]

    a = make_engine(num_blocks=64)
    a.add_request("p", prompt, params, prefill_only=True)
    first = None
    while a.has_unfinished():
        for out in a.step():
            first = out.new_token_ids[0] if out.new_token_ids else first
    assert first == whole[0]
    b = make_engine(num_blocks=64)
    rest_params = SamplingParams(max_tokens=63, temperature=0.0,
                                 structured=json_schema(SCHEMA))
    b.add_request("d", [*prompt, first], rest_params, prior_output=1)
    rest: list[int] = []
    while b.has_unfinished():
        for out in b.step():
            rest += out.new_token_ids
    assert [first, *rest] == whole
    jsonschema.validate(json.loads(b.tokenizer.decode(whole)), SCHEMA)


def test_bad_structured_output_names_its_field() -> None:
    with pytest.raises(BadRequest, match=r"^structured\.regex: .*regex parse error"):
        SamplingParams(structured=StructuredOutput("regex", "[0-9"))
    with pytest.raises(BadRequest, match=r"^structured\.json_schema: not valid JSON"):
        SamplingParams(structured=StructuredOutput("json_schema", "{"))
    with pytest.raises(BadRequest, match=r"^structured\.choice: must be a non-empty list"):
        StructuredOutput("choice", ())


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"presence_penalty": 2.5}, r"^presence_penalty must be in \[-2, 2\], got 2.5"),
    ({"frequency_penalty": math.nan}, r"^frequency_penalty must be in \[-2, 2\]"),
    ({"repetition_penalty": 0.0}, r"^repetition_penalty must be > 0, got 0.0"),
    ({"logit_bias": {3: 101.0}}, r"^logit_bias\[3\] must be in \[-100, 100\], got 101.0"),
    ({"logit_bias": {-1: 1.0}}, r"^logit_bias: token ids must be >= 0, got -1"),
    ({"prompt_logprobs": 21}, r"^prompt_logprobs must be in 0..20, got 21"),
])
def test_bad_processing_params_name_their_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_logit_bias_beyond_the_vocabulary_is_refused() -> None:
    engine = make_engine(num_blocks=16)
    with pytest.raises(BadRequest, match=r"^logit_bias: token ids must be < vocab_size 512"):
        engine.add_request("x", [1, 2], SamplingParams(logit_bias={512: 1.0}))


def _reference_prompt_logprobs(engine_prompt: list[int], n: int) -> list[tuple[float, list]]:
    """Score the prompt with a whole forward pass of the same model (no chunks)."""
    engine = make_engine(num_blocks=64, max_num_batched_tokens=4096)
    engine.add_request("ref", engine_prompt, SamplingParams(max_tokens=1, prompt_logprobs=n))
    got = None
    while engine.has_unfinished():
        for out in engine.step():
            got = out.prompt_logprobs or got
    assert got is not None
    return [(lp.logprob, lp.top) for lp in got]


def test_prompt_logprobs_are_chunk_and_preemption_independent() -> None:
    prompt = random_prompts([50], seed=6)[0]
    whole = _reference_prompt_logprobs(prompt, 3)
    assert len(whole) == len(prompt) - 1
    engine = make_engine(num_blocks=64, max_num_batched_tokens=16)  # 4 chunks
    engine.add_request("a", prompt, SamplingParams(max_tokens=2, prompt_logprobs=3))
    outs = []
    step = 0
    while engine.has_unfinished():
        outs += engine.step()
        step += 1
        if step == 2:  # preempt mid-prompt: the recompute overwrites the entries it redoes
            req = engine.requests["a"]
            engine.scheduler.decode.running.remove(req)
            engine.scheduler.decode.preempt(req)
            engine.scheduler.waiting.push(req)
    [first] = [o for o in outs if o.prompt_logprobs is not None]
    got = [(lp.logprob, lp.top) for lp in first.prompt_logprobs]
    assert len(got) == len(whole)
    for (a, atop), (b, btop) in zip(got, whole, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
        assert [t for t, _ in atop] == [t for t, _ in btop]
    # Token 1's entry is log p(prompt[1] | prompt[0]).
    assert all(v <= 0 for v, _ in got)


def test_prompt_logprobs_take_no_prefix_hits() -> None:
    engine = make_engine(num_blocks=64)
    prompt = random_prompts([40], seed=8)[0]
    run_all(engine, [prompt], SamplingParams(max_tokens=1))
    hits = engine.stats().num_prefix_hit_tokens
    run_all(engine, [prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert engine.stats().num_prefix_hit_tokens == hits
