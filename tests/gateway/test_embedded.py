"""``--router embedded`` against real engines: the router's core in the gateway's own loop, the
tiny model's colocated engine as a real gRPC server on a free port. The answer equals the
offline engine's; a client that goes away frees the engine's request; the router's errors keep
their HTTP answers; start and stop leave no task behind."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from services.gateway.auth import KeyStore
from services.gateway.config import GatewayConfig
from services.gateway.embedded import EmbeddedRouter
from services.gateway.server import GatewayServer
from tests.services.harness import Client, engine, serve
from tests.services.test_engine_services import PROMPTS, assert_idle, colocated, expected, llm


@pytest.fixture
async def colo() -> AsyncIterator[Client]:
    async with serve(colocated(), engine()) as client:
        yield client


async def _gateway(client: Client, *flags: str) -> GatewayServer:
    address = client.instance.address  # type: ignore[union-attr]
    config = GatewayConfig(port=0, router="embedded", request_timeout=30,
                           router_flags=" ".join(["--model", "tiny", "--decode", address,
                                                  "--poll-interval", "30", *flags]))
    server = GatewayServer(config, KeyStore.load("", ()), grace=1)
    await server.start()
    return server


def _http(server: GatewayServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}", timeout=30)


async def test_a_request_through_the_embedded_router_equals_the_engines_answer(
        colo: Client) -> None:
    server = await _gateway(colo)
    try:
        assert isinstance(server.client, EmbeddedRouter)
        prompt = PROMPTS["many_blocks"]
        async with _http(server) as http:
            resp = await http.post("/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0})
            assert (await http.get("/health")).json()["router_serving"] is True
            metrics = (await http.get("/metrics")).text  # the embedded router's too
        assert 'pdserve_router_requests_total{code="OK"}' in metrics
        assert "pdserve_gateway_requests_total" in metrics
        assert resp.status_code == 200, resp.text
        body = resp.json()
        want = expected(prompt, 12)
        assert body["choices"][0]["text"] == llm().tokenizer.decode(want)
        assert body["usage"] == {**body["usage"], "prompt_tokens": len(prompt),
                                 "completion_tokens": len(want)}
        await assert_idle(colo)
    finally:
        await server.stop()


async def test_a_client_going_away_frees_the_engines_request(colo: Client) -> None:
    server = await _gateway(colo)
    try:
        body = {"model": "tiny", "prompt": PROMPTS["short"], "max_tokens": 3000,
                "ignore_eos": True, "stream": True}
        async with _http(server) as http, http.stream("POST", "/v1/completions",
                                                      json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    break  # one token is out: leave (3000 take many seconds)
        gone = time.monotonic()
        while (await colo.stats()).num_running or server.client.core.num_in_flight:  # type: ignore[attr-defined]
            assert time.monotonic() - gone < 3, "the engine kept generating for a gone client"
            await asyncio.sleep(0.02)
        await assert_idle(colo)
    finally:
        await server.stop()


async def test_router_errors_keep_their_http_answers(colo: Client) -> None:
    server = await _gateway(colo, "--max-tokens", "16")
    try:
        async with _http(server) as http:
            resp = await http.post("/v1/completions", json={
                "model": "tiny", "prompt": "hello", "max_tokens": 17})
            missing = await http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "max_tokens" and "16" in err["message"]
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        assert "'gpt-9' is not served" in missing.json()["error"]["message"]
    finally:
        await server.stop()


async def test_start_and_stop_leave_no_task(colo: Client) -> None:
    before = asyncio.all_tasks()
    server = await _gateway(colo)
    async with _http(server) as http:
        resp = await http.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                         "max_tokens": 2})
    assert resp.status_code == 200
    assert asyncio.all_tasks() - before, "the embedded router polls its engines while it runs"
    await server.stop()
    await asyncio.sleep(0)  # let the tasks cancelled by stop() finish
    # The engine's server (still up) keeps one waiter per rpc it has been called with.
    left = {t for t in asyncio.all_tasks() - before
            if not t.done() and "AioServer._request_registered_call" not in repr(t)}
    assert not left, [t.get_coro() for t in left]
    assert (await server.client.check()) is False
