"""Issue 17 end to end: the official ``openai`` client against ``pdserve up`` serving a real
instruct model (SmolLM2-135M-Instruct), disaggregated (prefill + decode, kvds) and colocated.

- json_schema: 20 seeded answers each parse and validate (``jsonschema``);
- tool calls forced by tool_choice (named and required), streamed and not, parse;
- echo + logprobs: the prompt's logprobs equal transformers' log-softmax within 1e-4;
- presence and frequency penalties change the next token's logprobs exactly as defined;
- /tokenize, /detokenize, served model names, ``model`` left out, /v1/models.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch

from tests.e2e.real_model import smollm2
from tests.e2e.stack import UpStack

NAMES = ["smol", "smollm2-135m"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "none"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"type": "string", "maxLength": 20}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return smollm2()


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def stack(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[UpStack]:
    shape = ["--prefill", "1", "--decode", "1"] if request.param == "disaggregated" else [
        "--colocated", "--decode", "1"]
    up = UpStack(["--model", str(model_dir), "--served-model-name", *NAMES, *shape,
                  "--no-restart", "--kvd-capacity-mib", "512"]).start(timeout=400)
    yield up
    up.stop()


@pytest.fixture(scope="module")
def client(stack: UpStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                             dtype=torch.float32).eval()


def test_json_schema_answers_parse_and_validate(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                  "strict": True}}

    def ask(seed: int) -> tuple[str, str | None]:
        resp = client.chat.completions.create(
            model=NAMES[0], messages=[{"role": "user", "content": f"Describe person {seed}."}],
            response_format=fmt, seed=seed, temperature=1.0, max_tokens=80)  # type: ignore
        return resp.choices[0].message.content or "", resp.choices[0].finish_reason

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(20)))
    for text, finish in answers:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({text for text, _ in answers}) > 1  # seeded samples, not one forced string


def _args_of(calls: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_call_always_parses(client: openai.OpenAI, stream: bool) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = {"model": NAMES[1], "messages": ASK, "tools": [WEATHER, TIME],
              "tool_choice": choice, "max_tokens": 60, "temperature": 0.7, "seed": 3}
    if not stream:
        resp = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
        msg = resp.choices[0].message
        assert resp.choices[0].finish_reason == "stop"  # OpenAI's for a named function
        assert msg.content is None and msg.tool_calls is not None
        calls = _args_of(msg.tool_calls)
        assert msg.tool_calls[0].id.startswith("call_")
    else:
        calls = _streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    [(name, args)] = calls
    assert name == "get_weather"
    jsonschema.validate(args, WEATHER["function"]["parameters"])


def _streamed_calls(stream: Any) -> list[tuple[str, dict[str, Any]]]:
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or ():
                if d.id:
                    assert d.function.name and d.index not in calls
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert finish in ("stop", "tool_calls")
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_call_always_parses(client: openai.OpenAI, stream: bool) -> None:
    # One call (parallel calls off: an array the grammar bounds); several are unit-tested.
    kwargs = {"model": NAMES[0], "messages": ASK, "tools": [WEATHER, TIME],
              "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 120,
              "temperature": 0.7, "seed": 5}
    if stream:
        calls = _streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    else:
        resp = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
        assert resp.choices[0].finish_reason == "tool_calls"
        calls = _args_of(resp.choices[0].message.tool_calls or [])
    assert len(calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for name, args in calls:
        jsonschema.validate(args, schemas[name])


def test_echo_logprobs_equal_transformers(client: openai.OpenAI, reference: Any,
                                          stack: UpStack) -> None:
    """lm-eval's loglikelihood request: token ids, echo, logprobs, max_tokens 1."""
    text = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = httpx.post(stack.base_url.removesuffix("/v1") + "/tokenize",
                     json={"prompt": text}).json()["tokens"]
    resp = client.completions.create(model=NAMES[0], prompt=ids, echo=True, logprobs=3,
                                     max_tokens=1, temperature=0)
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert resp.choices[0].text.startswith(text)
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0].float()
    expected = logits.log_softmax(-1)
    want = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    got = lp.token_logprobs[1:len(ids)]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
    for i, top in enumerate(lp.top_logprobs[1:len(ids)]):  # the prompt token plus the top 3
        best = expected[i].topk(3).values.tolist()
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(best, abs=1e-4)
    # The generated token follows with its own logprob (greedy: the best one).
    assert lp.token_logprobs[-1] == pytest.approx(float(expected[-1].max()), abs=1e-4)


def test_penalties_change_the_next_token_as_defined(client: openai.OpenAI) -> None:
    """Step 2's logprobs with presence p and frequency f: the first token t0 (count 1) loses
    p + f; every logprob shifts by the new normalizer:
    lp'(t) = lp(t) - (p + f)[t = t0] - log(1 - e^lp(t0) + e^(lp(t0) - p - f))."""
    ask = {"model": NAMES[0], "prompt": "Repeat after me: banana banana banana banana",
           "max_tokens": 2, "temperature": 0, "logprobs": 20}
    plain = client.completions.create(**ask)  # type: ignore[call-overload]
    p, f = 0.7, 1.1
    penalized = client.completions.create(presence_penalty=p, frequency_penalty=f, **ask)
    lp0, lp1 = plain.choices[0].logprobs, penalized.choices[0].logprobs
    assert lp0 is not None and lp1 is not None and lp0.tokens and lp1.tokens
    assert lp0.tokens[0] == lp1.tokens[0]  # step 1 has no output to penalize
    t0 = lp0.tokens[0]
    step2 = lp0.top_logprobs[1]  # type: ignore[index]
    full = dict(step2)
    assert t0 in full  # the prompt makes repeating t0 likely: its logprob is known
    norm = torch.log(1 - torch.tensor(full[t0]).exp() + torch.tensor(full[t0] - p - f).exp())
    expected = {t: v - (p + f) * (t == t0) - float(norm) for t, v in full.items()}
    got = lp1.top_logprobs[1]  # type: ignore[index]
    for token, value in got.items():
        if token in expected:
            assert value == pytest.approx(expected[token], abs=1e-4), token
    best = max(expected, key=expected.__getitem__)
    assert lp1.tokens[1] == best


def test_tokenize_detokenize_and_served_names(client: openai.OpenAI, stack: UpStack) -> None:
    base = stack.base_url.removesuffix("/v1")
    models = client.models.list().data
    assert [m.id for m in models] == NAMES
    raw = httpx.get(stack.base_url + "/models").json()["data"]
    assert all(m["max_model_len"] == 8192 and m["root"].endswith("smollm2") for m in raw)
    tok = httpx.post(base + "/tokenize", json={"model": NAMES[1], "prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) == 2 and tok["max_model_len"] == 8192
    assert httpx.post(base + "/detokenize", json={"tokens": tok["tokens"]}).json() == {
        "prompt": "Hello world"}
    chat = httpx.post(base + "/tokenize", json={"messages": ASK}).json()
    resp = client.chat.completions.create(model=NAMES[0], messages=ASK, max_tokens=1)
    assert resp.usage is not None and resp.usage.prompt_tokens == chat["count"]
    # model left out: the first served name answers
    plain = httpx.post(stack.base_url + "/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert plain.status_code == 200 and plain.json()["model"] == NAMES[0]
    missing = httpx.post(stack.base_url + "/completions",
                         json={"model": "gpt-4", "prompt": "Hi", "max_tokens": 2})
    assert missing.status_code == 404 and "served: 'smol', 'smollm2-135m'" in missing.text


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"guided_regex": "[0-9"}, "guided_regex", "regex parse error"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
     "response_format", "Invalid type: x"),
    ({"logit_bias": {"99999": 1}}, "logit_bias", "must be < vocab_size 49152"),
])
def test_bad_structures_are_400_naming_the_field(stack: UpStack, body: dict[str, Any],
                                                 param: str, needle: str) -> None:
    resp = httpx.post(stack.base_url + "/completions",
                      json={"prompt": "Hi", "max_tokens": 2, **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_the_grpc_client_gets_the_same(stack: UpStack) -> None:
    """pdserve.client at the router's door: tokenize, a forced tool call, echo."""
    from pdserve import auth
    from pdserve.client import Client

    with Client(stack.router, metadata=stack.metadata(auth.CLIENT), timeout=300) as client:
        assert [(m.id, m.max_context) for m in client.models()] == [(n, 8192) for n in NAMES]
        ids = client.tokenize("Hello world")
        assert client.detokenize(ids) == "Hello world"
        assert client.tokenize(messages=ASK) == httpx.post(
            stack.base_url.removesuffix("/v1") + "/tokenize", json={"messages": ASK}).json()[
                "tokens"]
        tool = {"name": "get_weather", **{k: v for k, v in WEATHER["function"].items()
                                           if k != "name"}}
        done = client.chat(ASK, tools=[tool], tool_choice={"function": "get_weather"},
                           max_tokens=60, temperature=0).collect()
        [call] = done.tool_calls
        assert call.name == "get_weather" and call.id.startswith("call_") and done.text == ""
        jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
        echoed = client.generate(ids, echo=True, prompt_logprobs=1, max_tokens=1).collect()
        assert echoed.prompt_text == "Hello world" and len(echoed.prompt_logprobs) == len(ids)
        assert [p.sampled.token_id for p in echoed.prompt_logprobs] == ids
