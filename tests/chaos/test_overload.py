"""Overload on a real ``pdserve up`` stack (tiny model, one prefill, one decode with a small
KV cache): bursts queue instead of failing, huge prompts are refused before they cost
anything, slow bodies and per-request deadlines end in seconds with clear errors, and a
stalled stream keeps talking (SSE keep-alives). Each case is bounded in time and asserts on
what the client sees."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from pdserve import auth
from pdserve.proto.v1 import router_pb2, router_pb2_grpc
from pdserve_bench.burst import burst_prompt
from tests.e2e.stack import UpStack

DECODE_BLOCKS = 32  # 512 tokens: two of the burst's requests at a time
BURST = 64


@pytest.fixture(scope="module")
def stack() -> Iterator[UpStack]:
    up = UpStack(["--prefill", "1", "--decode", "1", f"--engine-arg=--num-blocks={DECODE_BLOCKS}"],
                 env={"PDSERVE_GATEWAY_SSE_HEARTBEAT": "0.3",
                      "PDSERVE_GATEWAY_BODY_TIMEOUT": "1.5"}).start()
    try:
        yield up
    finally:
        up.stop()


def _post(stack: UpStack, body: dict[str, object], timeout: float = 60,
          **headers: str) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/completions", json=body, headers=headers,
                      timeout=timeout)


def test_a_burst_against_a_small_kv_cache_queues_and_completes(stack: UpStack) -> None:
    """Every request's ~160-token prompt needs 11 of the decode's 32 blocks to start (12 by
    its end): two run at once, the rest wait for KV (before: 50 of 64 streams ended
    no_capacity)."""

    async def one(client: httpx.AsyncClient, i: int) -> list[str]:
        body = {"prompt": burst_prompt(i, 8), "max_tokens": 24, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", f"{stack.base_url}/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            return [line async for line in r.aiter_lines() if line.startswith("data: ")]

    async def burst() -> list[list[str]]:
        limits = httpx.Limits(max_connections=BURST + 4)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(BURST)))

    streams = asyncio.run(burst())
    errors = [line for lines in streams for line in lines if line.startswith('data: {"error"')]
    assert errors == []  # no 503 or 429 mid-way: the load waited for KV
    for lines in streams:
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 24
        assert json.loads(lines[-3][6:])["choices"][0]["finish_reason"] == "length"


def test_huge_prompts_are_refused_at_once_and_stall_nobody(stack: UpStack) -> None:
    huge = "lorem ipsum dolor sit amet " * 150_000  # ~4 MB, under the gateway's body limit
    results: dict[str, tuple[float, httpx.Response]] = {}

    def send(name: str, prompt: str) -> None:
        start = time.monotonic()
        response = _post(stack, {"prompt": prompt, "max_tokens": 2})
        results[name] = (time.monotonic() - start, response)

    send("warm", "Hi")  # the same small request alone first: its own cost, paid once
    threads = [threading.Thread(target=send, args=(f"huge{i}", huge)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.05)  # the huge ones are on their way
    send("small", "Hi")
    for t in threads:
        t.join(30)
    took, small = results["small"]
    assert small.status_code == 200 and took < 1.0, (took, results["warm"][0])
    for i in range(3):
        took, response = results[f"huge{i}"]
        assert response.status_code == 400 and took < 5.0
        error = response.json()["error"]
        assert error["message"] == (f"prompt: {len(huge)} bytes, above the limit of 131040 "
                                    "bytes (--max-prompt-bytes; the prompt may have at most "
                                    "4095 tokens)")
        assert error["param"] == "prompt"


def test_the_prompt_limit_is_the_models_context(stack: UpStack) -> None:
    response = _post(stack, {"prompt": [1] * 4096, "max_tokens": 1})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "prompt: 4096 tokens, above the limit of 4095"


def test_out_of_vocabulary_token_ids_name_the_prompt(stack: UpStack) -> None:
    response = _post(stack, {"prompt": [1, 2, 10_000_000], "max_tokens": 2})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt"
    assert error["message"].startswith("prompt_token_ids: token ids must be < the vocabulary "
                                       "size ")
    assert error["message"].endswith(", got [10000000]")


def test_a_slow_body_is_cut_off_in_seconds(stack: UpStack) -> None:
    port = int(stack.base_url.rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\"")
        response = b""
        while chunk := sock.recv(65536):
            response += chunk
        took = time.monotonic() - start
    assert response.startswith(b"HTTP/1.1 408") and took < 4.0
    error = json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["message"] == ("request body: 9 of the 1000 declared bytes received, then "
                                "nothing for 1.5s (--body-timeout)")


def test_a_per_request_deadline_ends_the_request(stack: UpStack) -> None:
    start = time.monotonic()
    response = _post(stack, {"prompt": "Count to a thousand:", "max_tokens": 480,
                             "ignore_eos": True}, **{"X-Request-Timeout": "0.5"})
    assert time.monotonic() - start < 3.0
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == "deadline_exceeded"
    assert error["message"].startswith("request timed out after 0.5s (X-Request-Timeout")


def test_the_grpc_deadline_is_honoured_end_to_end(stack: UpStack) -> None:
    channel = stack.channel(stack.router, auth.CLIENT)
    stub = router_pb2_grpc.RouterStub(channel)
    request = router_pb2.GenerateRequest(prompt="Count to a thousand:")
    request.sampling.max_tokens = 480
    request.sampling.ignore_eos = True
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        for _ in stub.Generate(request, timeout=0.5):
            pass
    assert time.monotonic() - start < 3.0
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    channel.close()


def test_a_stalled_stream_sends_keep_alives(stack: UpStack) -> None:
    pid = stack.children()["decode-0"]
    lines: list[str] = []
    stopped, frozen_at = False, 0
    try:
        with httpx.stream("POST", f"{stack.base_url}/completions", timeout=30, json={
                "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                "stream": True}) as response:
            for line in response.iter_lines():
                lines.append(line)
                if not frozen_at and sum(x.startswith("data: ") for x in lines) >= 3:
                    os.kill(pid, signal.SIGSTOP)  # the decode engine freezes mid-answer
                    stopped = True
                    frozen_at = len(lines)
                if stopped and lines[frozen_at:].count(": keep-alive") >= 3:
                    os.kill(pid, signal.SIGCONT)
                    stopped = False
                if lines[-1] == "data: [DONE]":
                    break
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
    assert lines.count(": keep-alive") >= 3, lines[-8:]
    assert lines[-2:] == ["", "data: [DONE]"] or lines[-1] == "data: [DONE]", lines[-8:]
    assert lines[-1] == "data: [DONE]"  # resumed and finished once the engine was back
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "error" not in chunks[-1], chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
