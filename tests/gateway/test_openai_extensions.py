"""The gateway's shapes for issue 17's fields, over the scripted router: tool calls (whole and
as streamed deltas, finish_reason tool_calls), echo with prompt logprobs, structured output and
penalties forwarded, ``model`` left out."""

from __future__ import annotations

import json

import httpx

from tests.gateway.conftest import KEY, Stack
from tests.gateway.fake_router import MODEL

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "toolcall"}]


def test_tool_calls_in_a_whole_answer(stack: Stack) -> None:
    out = stack.client().chat.completions.create(model=MODEL, messages=ASK, tools=[TOOL])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls or []
    assert (call.id, call.type, call.function.name) == ("call_abc", "function", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    [sent] = stack.last()
    assert [(t.name, json.loads(t.parameters)) for t in sent.tools] == [
        ("get_weather", TOOL["function"]["parameters"])]
    assert not sent.HasField("tool_choice")


def test_tool_calls_stream_as_openai_deltas(stack: Stack) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(stack.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=[TOOL], tool_choice=named, stream=True))
    deltas = [d for c in chunks for ch in c.choices for d in ch.delta.tool_calls or ()]
    assert deltas[0].id == "call_abc" and deltas[0].type == "function"
    assert deltas[0].function.name == "get_weather" and deltas[1].id is None
    assert "".join(d.function.arguments or "" for d in deltas) == '{"city": "Oslo"}'
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finishes == ["stop"]  # a named function finishes with stop, as OpenAI
    assert stack.last()[0].tool_choice.function == "get_weather"


def test_echo_puts_the_prompt_first(stack: Stack) -> None:
    out = stack.client().completions.create(model=MODEL, prompt="Hi there", echo=True,
                                            logprobs=1, max_tokens=2)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == "Hi thereHello,"
    assert lp is not None and lp.tokens is not None
    assert lp.tokens[:2] == ["H", "i there"] and lp.token_logprobs[:2] == [None, -1.5]
    assert lp.top_logprobs is not None and lp.top_logprobs[:2] == [
        None, {"i there": -1.5, "alt": -0.5}]
    assert lp.text_offset == [0, 1, 8, 13]  # generated tokens after the prompt's text
    sent = stack.last()[0]
    assert sent.echo and sent.sampling.prompt_logprobs == 1
    streamed = list(stack.client().completions.create(model=MODEL, prompt="Hi there",
                                                      echo=True, max_tokens=2, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "Hi thereHello,"


def test_structure_and_penalties_are_forwarded(stack: Stack) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], presence_penalty=0.5,
        frequency_penalty=-1.0, logit_bias={"42": 3.0},
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        extra_body={"repetition_penalty": 1.3})
    s = stack.last()[0].sampling
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -1.0)
    assert s.repetition_penalty == 1.2999999523162842 and dict(s.logit_bias) == {42: 3.0}
    assert json.loads(s.structured.json_schema) == schema
    stack.client().completions.create(model=MODEL, prompt="x",
                                      extra_body={"guided_choice": ["a", "b"]})
    assert list(stack.last()[0].sampling.structured.choice.choices) == ["a", "b"]


def test_model_may_be_left_out(stack: Stack) -> None:
    resp = httpx.post(stack.url() + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                      headers={"Authorization": f"Bearer {KEY}"})
    assert resp.status_code == 200 and resp.json()["model"] == MODEL
    assert stack.last()[0].model == ""
