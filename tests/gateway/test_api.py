"""The OpenAI API through the official client: shapes, streaming, usage, n, stop, logprobs, and
what the gateway forwards to the router (sampling, tenant, inputs)."""

from __future__ import annotations

import httpx
import openai
import pytest

from services.gateway.auth import default_tenant
from tests.gateway.conftest import KEY, TEAM_KEY, Stack
from tests.gateway.fake_router import MODEL, REPLY

FULL = "".join(REPLY)


def test_completion(stack: Stack) -> None:
    out = stack.client().completions.create(model=MODEL, prompt="say hi", max_tokens=32)
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    assert out.model == MODEL and out.created > 0
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == [(0, FULL, "stop")]
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == \
        (2, 5, 7)
    req = stack.last()[0]
    assert req.prompt == "say hi" and req.model == MODEL and req.sampling.max_tokens == 32
    assert not req.sampling.HasField("temperature")  # unset stays the router's default
    assert req.meta.tenant == default_tenant(KEY) and req.meta.request_id == f"{out.id}-0"


def test_completion_default_max_tokens_and_length(stack: Stack) -> None:
    out = stack.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert (out.choices[0].text, out.choices[0].finish_reason) == ("Hello,", "length")
    assert out.usage is not None and out.usage.completion_tokens == 2
    stack.client().completions.create(model=MODEL, prompt="x")
    assert stack.last()[0].sampling.max_tokens == 16  # OpenAI's completions default


def test_stop_and_sampling_are_forwarded(stack: Stack) -> None:
    out = stack.client().completions.create(
        model=MODEL, prompt="x", stop=["world"], temperature=0.5, top_p=0.9, seed=-1,
        extra_body={"top_k": 5, "min_p": 0.1, "ignore_eos": True, "stop_token_ids": [7],
                    "priority": 2, "no_such_field": 1})
    assert (out.choices[0].text, out.choices[0].finish_reason) == ("s18446744073709551615, ",
                                                                   "stop")
    s = stack.last()[0].sampling
    assert list(s.stop) == ["world"] and list(s.stop_token_ids) == [7] and s.ignore_eos
    assert (round(s.temperature, 3), round(s.top_p, 3), s.top_k, round(s.min_p, 3)) == \
        (0.5, 0.9, 5, 0.1)
    assert s.seed == 2**64 - 1  # a signed seed wraps to the contract's unsigned one
    assert stack.last()[0].meta.priority == 2
    stack.client().completions.create(model=MODEL, prompt="x", stop="END")
    assert list(stack.last()[0].sampling.stop) == ["END"]


def test_prompts_as_token_ids_and_batches(stack: Stack) -> None:
    client = stack.client()
    client.completions.create(model=MODEL, prompt=[1, 2, 3])
    assert list(stack.last()[0].prompt_token_ids.ids) == [1, 2, 3]
    out = client.completions.create(model=MODEL, prompt=["a b", "c d e"], n=2, seed=1)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    reqs = stack.last(4)  # sent at once: they may reach the router in any order
    assert sorted((r.prompt, r.sampling.seed) for r in reqs) == \
        [("a b", 1), ("a b", 2), ("c d e", 1), ("c d e", 2)]
    assert out.usage is not None and out.usage.prompt_tokens == 2 + 3  # each prompt once
    assert out.usage.completion_tokens == 4 * 5
    client.completions.create(model=MODEL, prompt=[[5, 6], [7]])
    assert sorted(list(r.prompt_token_ids.ids) for r in stack.last(2)) == [[5, 6], [7]]


def test_chat(stack: Stack) -> None:
    out = stack.client(key=TEAM_KEY).chat.completions.create(
        model=MODEL, max_completion_tokens=3, user="ignored-when-keys-are-on",
        messages=[{"role": "developer", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "hi "},
                                               {"type": "text", "text": "there"}]}])
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    choice = out.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == \
        ("assistant", "Hello, world", "length")
    assert out.usage is not None and out.usage.completion_tokens == 3
    assert out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == 1
    req = stack.last()[0]
    assert [(m.role, m.content) for m in req.chat.messages] == \
        [("system", "be brief"), ("user", "hi there")]
    assert req.sampling.max_tokens == 3 and req.meta.tenant == "team-a"


def test_chat_n_and_seeds(stack: Stack) -> None:
    out = stack.client().chat.completions.create(
        model=MODEL, n=2, seed=10, messages=[{"role": "user", "content": "hi"}])
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.message.content for c in out.choices] == [f"s{s}, world! END" for s in (10, 11)]
    assert out.usage is not None and out.usage.completion_tokens == 10
    assert out.usage.prompt_tokens == 3  # the prompt once, not per choice


def test_chat_stream_with_usage(stack: Stack) -> None:
    chunks = list(stack.client().chat.completions.create(
        model=MODEL, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hi"}]))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == FULL
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_with_continuous_usage(stack: Stack) -> None:
    # vLLM's continuous_usage_stats: every content chunk carries the usage so far, so a token
    # whose text is held back (half a UTF-8 character) is counted in the next chunk.
    chunks = list(stack.client().chat.completions.create(
        model=MODEL, stream=True, messages=[{"role": "user", "content": "held"}],
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert [c.choices[0].delta.content for c in content] == ["Caf", "é!"]
    assert [c.usage.completion_tokens for c in content if c.usage] == [1, 3]
    assert all(c.usage.prompt_tokens == 3 for c in content if c.usage)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 3
    # Without it (or without include_usage, as vLLM) the content chunks carry none.
    for options in ({"include_usage": True}, {"continuous_usage_stats": True}):
        chunks = list(stack.client().chat.completions.create(
            model=MODEL, stream=True, messages=[{"role": "user", "content": "held"}],
            stream_options=options))
        assert all(c.usage is None for c in chunks if c.choices)


def test_completion_stream_n2(stack: Stack) -> None:
    chunks = list(stack.client().completions.create(
        model=MODEL, prompt="x", n=2, seed=3, stream=True))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        assert chunk.usage is None
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {0: "s3, world! END", 1: "s4, world! END"}


def test_stream_ends_with_done(stack: Stack, http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "x", "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1


def test_chat_logprobs(stack: Stack) -> None:
    out = stack.client().chat.completions.create(
        model=MODEL, logprobs=True, top_logprobs=2, messages=[{"role": "user", "content": "x"}])
    assert stack.last()[0].sampling.logprobs == 2
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert [e.token for e in content] == REPLY
    for i, entry in enumerate(content):
        assert entry.logprob == -0.25 and entry.bytes == list(REPLY[i].encode())
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == \
            [(REPLY[i], -0.25), ("alt0", -2.0)]
    out = stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert out.choices[0].logprobs is None
    assert not stack.last()[0].sampling.HasField("logprobs")


def test_completion_logprobs_stream_and_not(stack: Stack) -> None:
    out = stack.client().completions.create(model=MODEL, prompt="x", logprobs=1)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens == REPLY and lp.token_logprobs == [-0.25] * 5
    assert lp.top_logprobs == [{t: -0.25} for t in REPLY]
    assert lp.text_offset == [0, 5, 6, 12, 13]
    chunks = list(stack.client().completions.create(model=MODEL, prompt="x", logprobs=0,
                                                    stream=True))
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset or []]
    assert offsets == [0, 5, 6, 12, 13]


def test_open_gateway_tenant_from_user_and_model_alias(stack: Stack) -> None:
    client = stack.client("open", key="anything")
    out = client.chat.completions.create(model="alias", user="alice",
                                         messages=[{"role": "user", "content": "x"}])
    assert out.model == "alias"
    req = stack.last()[0]
    assert (req.model, req.meta.tenant) == (MODEL, "alice")
    assert [m.id for m in client.models.list()] == ["alias"]


def test_models(stack: Stack) -> None:
    models = stack.client().models.list()
    assert [(m.id, m.object, m.owned_by) for m in models] == [(MODEL, "model", "pdserve")]
    assert stack.client().models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        stack.client().models.retrieve("gpt-9")



def test_trace_context_reaches_the_router(http: httpx.Client, stack: Stack) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "x"},
                     headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    assert resp.status_code == 200
    assert resp.headers["x-request-id"] == resp.json()["id"]
    assert stack.router.trace_ids[-1] == trace_id  # the router's span continues the trace
