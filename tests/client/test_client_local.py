"""``pdserve.client`` against a real router server in-process whose only engine is down:
gRPC's retry policy with the server's pushback, typed errors with RetryInfo, TLS and call
credentials, and the client's own argument errors."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from pdserve.client import TLS, AsyncClient, Client, Retry, Unavailable
from pdserve.client.channel import channel_options
from tests.client.conftest import LocalRouter

FAST = Retry(max_attempts=3, initial_backoff=0.01, max_backoff=0.01)
NO_CAPACITY = "no capacity: no healthy prefill+decode pair or colocated engine"


async def test_unavailable_is_retried_by_grpc_after_the_servers_pushback(
        local_router: LocalRouter) -> None:
    counters = local_router.router.counters
    async with AsyncClient(local_router.address, retry=FAST) as client:
        start = time.monotonic()
        with pytest.raises(Unavailable) as err:
            await client.generate("Hello", max_tokens=4).collect()
        elapsed = time.monotonic() - start
    assert counters.num_requests == 3  # the router saw every attempt
    # Two waits of the router's RetryInfo delay (1 s, sent as grpc-retry-pushback-ms), not the
    # policy's 10 ms backoff.
    assert 1.9 <= elapsed < 10
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and err.value.retry_after == 1.0
    assert err.value.message.startswith(NO_CAPACITY)
    async with AsyncClient(local_router.address, retry=None) as client:
        with pytest.raises(Unavailable):
            await client.generate("Hello", max_tokens=4).collect()
    assert counters.num_requests == 4


async def test_the_blocking_client_too(local_router: LocalRouter) -> None:
    def run() -> tuple[str, str]:
        with Client(local_router.address, retry=None, timeout=10) as client:
            models = client.models()
            with pytest.raises(Unavailable) as err:
                client.generate([1, 2, 3], max_tokens=4).collect()
            assert err.value.retry_after == 1.0
            state = client.cluster_state()
            assert [i.healthy for i in state.instances] == [False]
            return models[0].id, err.value.message

    model, message = await asyncio.to_thread(run)
    assert model == "tiny" and message.startswith(NO_CAPACITY)


async def test_tls_with_channel_and_per_call_credentials(tls_router: LocalRouter,
                                                         certs: Path) -> None:
    tls = TLS.from_files(ca=certs / "ca.pem")
    token = grpc.access_token_call_credentials("channel-token")
    async with AsyncClient(tls_router.address, tls=tls, call_credentials=token) as client:
        assert [m.id for m in await client.models()] == ["tiny"]
    async with AsyncClient(f"localhost:{tls_router.address.rsplit(':', 1)[1]}",
                           tls=tls) as client:
        await client.models(credentials=grpc.access_token_call_credentials("call-token"),
                            metadata=[("x-team", "a")])
        with pytest.raises(Unavailable):  # the router answers over TLS as in the clear
            await client.generate("Hello", max_tokens=2).collect()
    seen = tls_router.invocation_metadata
    assert [m.get("authorization") for m in seen] == [
        "Bearer channel-token", "Bearer call-token", *[None] * Retry().max_attempts]
    assert seen[1]["x-team"] == "a"


async def test_tls_refuses_a_server_it_cannot_verify(tls_router: LocalRouter) -> None:
    async with AsyncClient(tls_router.address, tls=True, retry=None, timeout=5) as client:
        with pytest.raises(Unavailable) as err:
            await client.models()
    assert "ssl" in err.value.message.lower() or "handshake" in err.value.message.lower()


def test_argument_errors_name_the_argument() -> None:
    client = Client("127.0.0.1:1")
    cases: list[tuple[type[Exception], str, dict[str, object]]] = [
        (TypeError, "unexpected keyword argument 'temprature'", {"temprature": 0.5}),
        (ValueError, "sampling.max_tokens: Value out of range: -1 (got -1)", {"max_tokens": -1}),
        (TypeError, "sampling.temperature: must be real number, not str (got 'hot')",
         {"temperature": "hot"}),
    ]
    for exc, message, params in cases:
        with pytest.raises(exc) as err:
            client.generate("x", **params)  # type: ignore[arg-type]
        assert str(err.value).startswith(message)
    with pytest.raises(TypeError, match=r"^messages\[1\]: must be a mapping with 'role'"):
        client.chat([{"role": "user", "content": "a"}, "b"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"^messages\[0\]\.content: must be text or a list of "):
        client.chat([{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}])
    with pytest.raises(ValueError, match=r"^timeout: must be > 0 seconds or None, got 0"):
        client.generate("x", timeout=0)
    with pytest.raises(ValueError, match=r"^credentials: per-call credentials need a TLS"):
        client.models(credentials=grpc.access_token_call_credentials("t"))
    client.close()


def test_option_errors_name_the_option() -> None:
    with pytest.raises(ValueError, match=r"^Retry\.max_attempts: must be in 2\.\.5 \(use "
                                         r"retry=None for no retries\), got 9"):
        Retry(max_attempts=9)
    with pytest.raises(ValueError, match=r"^Retry\.status_codes: must be gRPC status names, "
                                         r"got \['BUSY'\]"):
        Retry(status_codes=("UNAVAILABLE", "BUSY"))
    with pytest.raises(ValueError, match=r"^call_credentials: need tls"):
        Client("127.0.0.1:1", call_credentials=grpc.access_token_call_credentials("t"))
    with pytest.raises(ValueError, match=r"^TLS: give both private_key and certificate_chain"):
        Client("127.0.0.1:1", tls=TLS(private_key=b"k"))
    with pytest.raises(ValueError, match=r"^timeout: must be > 0 seconds or None, got -1"):
        Client("127.0.0.1:1", timeout=-1)


def test_retry_is_a_service_config_of_the_router_service() -> None:
    options = dict(channel_options(Retry(), None))
    assert options["grpc.enable_retries"] == 1
    assert '"retryableStatusCodes": ["UNAVAILABLE"]' in options["grpc.service_config"]
    assert '"service": "pdserve.v1.Router"' in options["grpc.service_config"]
    assert dict(channel_options(None, None))["grpc.enable_retries"] == 0
