"""Every failure in OpenAI's error JSON with the right status: bad params naming the field,
keys, model, quota, capacity, deadline, mid-stream router errors, disconnects, limits."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.conftest import KEY, Stack
from tests.gateway.fake_router import MODEL

CHAT: Any = [{"role": "user", "content": "hi"}]


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("path", "body", "param", "needle"), [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature", ">= 0"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n", ">= 1"),
    ("/v1/completions", {"prompt": "x", "top_p": 2}, "top_p", "<= 1"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "<= 20"),
    ("/v1/completions", {"prompt": ["a", 1]}, "prompt", "a list of token ids"),
    ("/v1/completions", {"prompt": []}, "prompt", "empty"),
    ("/v1/completions", {"prompt": [-1]}, "prompt", "0..2^32-1"),
    ("/v1/completions", {"prompt": [1, 2**32]}, "prompt", "0..2^32-1"),
    ("/v1/completions", {"prompt": [[1], [2, 2**32]]}, "prompt", "0..2^32-1"),
    ("/v1/completions", {"prompt": [[1], []]}, "prompt", "token id lists must not be empty"),
    ("/v1/completions", {}, "prompt", "required"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop", "must not be empty"),
    ("/v1/completions", {"prompt": "x", "n": 9}, "n", "exceeds the limit of 8"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty",
     "must be <= 2.0, got 2.5"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": -3}, "presence_penalty",
     "must be >= -2.0, got -3"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty",
     "must be > 0.0, got 0"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias",
     "keys must be token ids (as strings), got 'abc'"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias",
     "biases must be in [-100, 100], got 101.0 for 5"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema"}},
     "response_format.json_schema", "is required with type json_schema"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "yaml"}},
     "response_format.type", "'text', 'json_object' or 'json_schema'"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"},
                         "guided_regex": "a+"}, "guided_regex",
     "cannot be combined with response_format"),
    ("/v1/completions", {"prompt": "x", "guided_choice": []}, "guided_choice",
     "at least 1 item"),
    ("/v1/chat/completions", {}, "messages", "required"),
    ("/v1/chat/completions", {"messages": []}, "messages", "at least 1 item"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content", "unsupported content part type 'image_url'"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]},
     "messages[0].role", "must be one of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]},
     "messages[0].content", "a string or a list of text parts"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs",
     "requires logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -5},
     "max_completion_tokens", ">= 1"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]},
     "tools[0].function", "is required"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice",
     "'required' needs tools"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "other"}}}, "tool_choice",
     "function 'other' is not one of the tools"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "sometimes"}, "tool_choice",
     "of an accepted type"),
    ("/v1/chat/completions", {"messages": CHAT, "model": ""}, "model", "must not be empty"),
])
def test_bad_params_name_the_field(http: httpx.Client, path: str, body: dict[str, Any],
                                   param: str, needle: str) -> None:
    err = _error(http.post(path, json={"model": MODEL, **body}), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"].startswith(param) and needle in err["message"]


def test_bad_params_through_the_openai_client(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        stack.client().chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    assert info.value.param == "temperature" and info.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as info:
        stack.client().completions.create(model=MODEL, prompt="badparam")
    assert info.value.param == "max_tokens"  # the router's INVALID_ARGUMENT, field kept


def test_body_not_json_and_too_large(http: httpx.Client) -> None:
    err = _error(http.post("/v1/completions", content=b"{nope"), 400)
    assert "not valid JSON" in err["message"]
    big = {"model": MODEL, "prompt": "x" * 70_000}
    err = _error(http.post("/v1/completions", json=big), 413)
    assert "larger than 65536 bytes" in err["message"]

    def chunked() -> Any:  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "tiny", "prompt": "'
        yield b"x" * 70_000
        yield b'"}'

    _error(http.post("/v1/completions", content=chunked()), 413)


def test_auth(stack: Stack) -> None:
    with pytest.raises(openai.AuthenticationError):
        stack.client(key="sk-wrong").completions.create(model=MODEL, prompt="x")
    with httpx.Client(base_url=stack.url()) as raw:
        err = _error(raw.post("/v1/completions", json={"model": MODEL, "prompt": "x"}), 401)
        assert "missing API key" in err["message"]
        err = _error(raw.get("/v1/models", headers={"Authorization": f"Basic {KEY}"}), 401)
        assert "Bearer" in err["message"]
        assert raw.get("/health").status_code == 200  # probes need no key


def test_unknown_model_is_404(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        stack.client().chat.completions.create(model="gpt-9", messages=CHAT)
    assert info.value.param == "model" and info.value.code == "model_not_found"


def test_quota_is_429_with_retry_after(http: httpx.Client) -> None:
    for stream in (False, True):
        resp = http.post("/v1/completions",
                         json={"model": MODEL, "prompt": "quota", "stream": stream})
        err = _error(resp, 429)
        assert resp.headers["retry-after"] == "7" and err["code"] == "rate_limit_exceeded"


def test_no_capacity_is_503(stack: Stack) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        stack.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "busy"}])
    assert info.value.status_code == 503 and "no healthy decode" in info.value.message


def test_router_down(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url("dead")) as raw:
        health = raw.get("/health")
        assert health.status_code == 503 and health.json()["router_serving"] is False
        _error(raw.post("/v1/completions", json={"model": MODEL, "prompt": "x"}), 503)
        _error(raw.get("/v1/models"), 503)


def test_deadline_is_504(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url("open"), timeout=10) as raw:
        start = time.monotonic()
        err = _error(raw.post("/v1/completions", json={"model": "alias", "prompt": "hang"}), 504)
        assert time.monotonic() - start < 5 and err["type"] == "timeout_error"


def test_router_error_mid_stream(stack: Stack, http: httpx.Client) -> None:
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "midfail"}]}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line]
    assert events[-1] == "[DONE]" and '"error"' in events[-2]
    assert "decode instance died" in events[-2]
    with pytest.raises(openai.APIError, match="decode instance died"):
        list(stack.client().completions.create(model=MODEL, prompt="midfail", stream=True))
    err = _error(http.post("/v1/completions", json={"model": MODEL, "prompt": "midfail"}), 500)
    assert "decode instance died" in err["message"]
    err = _error(http.post("/v1/completions", json={"model": MODEL, "prompt": "abort"}), 502)
    assert err["code"] == "aborted"


def _wait_cancelled(stack: Stack, count: int) -> None:
    deadline = time.monotonic() + 5
    while len(stack.router.cancelled) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(stack.router.cancelled) >= count, "router call was not cancelled"


def test_disconnect_cancels_router_call(stack: Stack, http: httpx.Client) -> None:
    before = len(stack.router.cancelled)
    body = {"model": MODEL, "prompt": "hang", "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        first = next(line for line in resp.iter_lines() if line)
        assert first.startswith("data: {")
    _wait_cancelled(stack, before + 1)
    with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up waiting
        http.post("/v1/completions", json={"model": MODEL, "prompt": "hang"}, timeout=0.3)
    _wait_cancelled(stack, before + 2)
    for stream in (False, True):  # gone while the router has not answered at all
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", timeout=0.3,
                      json={"model": MODEL, "prompt": "hangfirst", "stream": stream})
    _wait_cancelled(stack, before + 4)
    deadline = time.monotonic() + 5  # nothing leaks: every request ended and was recorded
    while "pdserve_gateway_in_flight 0.0" not in (metrics := http.get("/metrics").text):
        assert time.monotonic() < deadline, "in-flight gauge did not return to 0"
        time.sleep(0.02)
    assert re.search(r"pdserve_gateway_client_disconnects_total [1-9]", metrics)
    assert 'status="499"' in metrics


def test_unknown_route_is_openai_shaped(http: httpx.Client) -> None:
    err = _error(http.get("/v1/nothing"), 404)
    assert "/v1/nothing" in err["message"]
    _error(http.get("/v1/completions"), 405)
