"""Pieces without servers: key files, config validation, router status mapping."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from pdserve.errors import BadRequest, StatusError
from services.gateway.auth import KeyStore, default_tenant
from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError, from_rpc_error


def test_keys_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# comment\n\nsk-a, team-a\nsk-b\n")
    keys = KeyStore.load(str(path), ["sk-c"])
    assert len(keys) == 3 and keys.enabled
    assert keys.tenant("Bearer sk-a") == "team-a"
    assert keys.tenant("bearer  sk-b ") == default_tenant("sk-b") != "sk-b"
    assert keys.tenant("Bearer sk-c") == default_tenant("sk-c")
    for header, needle in [(None, "missing"), ("Bearer", "malformed"), ("Token sk-a", "malformed"),
                           ("Bearer sk-z", "invalid API key")]:
        with pytest.raises(ApiError, match=needle) as info:
            keys.tenant(header)
        assert info.value.status == 401
    assert KeyStore().tenant(None) == "" and not KeyStore().enabled


def test_keys_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-a\nbad key,t\n")
    with pytest.raises(ValueError, match="--keys-file: line 2: expected "
                       "'key\\[,tenant\\[,cache_group\\]\\]'"):
        KeyStore.load(str(path), [])
    with pytest.raises(ValueError, match="--keys-file: cannot read"):
        KeyStore.load(str(tmp_path / "missing"), [])


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"host": ""}, "--host"),
    ({"router": "localhost"}, "--router"),
    ({"router": ":50051"}, "--router"),
    ({"port": 70000}, "--port"),
    ({"grpc_port": -1}, "--grpc-port"),
    ({"max_body_bytes": 10}, "--max-body-bytes"),
    ({"request_timeout": 0.0}, "--request-timeout"),
    ({"max_choices": 0}, "--max-choices"),
    ({"api_keys": ("a b",)}, "--api-keys"),
])
def test_config_validation(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        GatewayConfig(**kwargs)  # type: ignore[arg-type]


def test_config_from_env() -> None:
    config = GatewayConfig.from_argv(["--port", "0"], {"PDSERVE_GATEWAY_API_KEYS": "a,b",
                                                       "PDSERVE_GATEWAY_MAX_CHOICES": "4"})
    assert (config.port, config.api_keys, config.max_choices) == (0, ("a", "b"), 4)


def _rpc_error(exc: StatusError) -> grpc.aio.AioRpcError:
    """The error a client sees when a pdserve service answers ``exc`` (same trailers)."""
    status = exc.to_status()
    return grpc.aio.AioRpcError(status.code, grpc.aio.Metadata(),
                                grpc.aio.Metadata(*status.trailing_metadata), status.details)


_BAD, _CODE = BadRequest, grpc.StatusCode


@pytest.mark.parametrize(("exc", "status", "param", "retry_after"), [
    (_BAD("sampling.top_k: must be >= -1"), 400, "top_k", None),
    (_BAD("sampling.max_tokens must be >= 1, got 0"), 400, "max_tokens", None),
    (_BAD("chat.messages[1].role: 'x' is not one of"), 400, "messages[1].role", None),
    (_BAD("prompt_token_ids: 4097 tokens, more than 4096"), 400, "prompt", None),
    (_BAD("this message names no field", field="meta.priority"), 400, "priority", None),
    (StatusError(_CODE.INVALID_ARGUMENT, "-- no field here"), 400, None, None),
    (StatusError(_CODE.NOT_FOUND, "no such model"), 404, "model", None),
    (StatusError(_CODE.RESOURCE_EXHAUSTED, "quota", retry_after=2.5), 429, None, "3"),
    (StatusError(_CODE.UNAVAILABLE, "no capacity"), 503, None, "1"),
    (StatusError(_CODE.DEADLINE_EXCEEDED, ""), 504, None, None),
    (StatusError(_CODE.INTERNAL, "boom"), 500, None, None),
])
def test_status_mapping_reads_the_rich_details(exc: StatusError, status: int, param: str | None,
                                               retry_after: str | None) -> None:
    err = from_rpc_error(_rpc_error(exc))
    assert (err.status, err.param) == (status, param)
    assert err.message == (exc.message or exc.code.name)
    assert err.headers == ({"Retry-After": retry_after} if retry_after else {})
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_status_without_details_maps_code_and_message_only() -> None:
    """A status from gRPC itself or a proxy has no details: no param guessed from the text."""
    err = from_rpc_error(grpc.aio.AioRpcError(
        grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(),
        grpc.aio.Metadata(("retry-after", "3")), "sampling.top_k: must be >= -1"))
    assert (err.status, err.param, err.headers) == (400, None, {})
