"""Pieces without servers: key files, config validation, router status mapping."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

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
    with pytest.raises(ValueError, match="--keys-file: line 2: expected 'key\\[,tenant\\]'"):
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


def _rpc_error(code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()
               ) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


@pytest.mark.parametrize(("code", "details", "status", "param"), [
    (grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_k: must be >= -1", 400, "top_k"),
    (grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens must be >= 1, got 0", 400,
     "max_tokens"),
    (grpc.StatusCode.INVALID_ARGUMENT, "chat.messages[1].role: 'x' is not one of", 400,
     "messages[1].role"),
    (grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: 4097 tokens, more than 4096", 400,
     "prompt"),
    (grpc.StatusCode.INVALID_ARGUMENT, "-- no field here", 400, None),
    (grpc.StatusCode.NOT_FOUND, "no such model", 404, "model"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "quota", 429, None),
    (grpc.StatusCode.UNAVAILABLE, "no capacity", 503, None),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "", 504, None),
    (grpc.StatusCode.INTERNAL, "boom", 500, None),
])
def test_status_mapping(code: grpc.StatusCode, details: str, status: int, param: str | None
                        ) -> None:
    err = from_rpc_error(_rpc_error(code, details, (("retry-after", "3"),)))
    assert (err.status, err.param) == (status, param)
    assert err.message == (details or code.name) and err.headers == {"Retry-After": "3"}
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
