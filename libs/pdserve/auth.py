"""Who may call what on pdserve's internal gRPC planes (DESIGN.md §8; docs/security.md).

    credential  metadata key      variable               held by          checked by
    data        x-pdserve-secret  PDSERVE_SECRET         router, engines, engines (Prefill, Decode,
                                                         kvds             Stats), kvds
    admin       x-pdserve-admin   PDSERVE_ADMIN_SECRET   router,          engines (Drain, SetRole,
                                                         pdserve reload   Abort, LoadWeights)
    client      x-pdserve-client  PDSERVE_CLIENT_SECRET  gateway, gRPC    router
                                                         clients

Each value comes from its variable or from the file named by ``<variable>_FILE`` (a Kubernetes
Secret mounted as a file), never from a flag: flags show in ``ps``. ``pdserve up`` makes a
fresh random one of each per stack and gives each process only those it needs. A plane whose
credential is not set is open, which a service allows only on a loopback address.

Server side, ``Guard`` (a ``grpc.aio`` server interceptor) checks every call against the
service's rules before any handler runs: no or a wrong credential is UNAUTHENTICATED, a valid
credential of the wrong kind (data on an admin call) PERMISSION_DENIED; comparisons are
constant-time. Health and reflection stay open (probes). Client side, ``presenters`` add the
caller's credentials to every call of a channel. Per-call metadata over a shared secret was
chosen over mTLS because ``pdserve up`` runs on loopback where TLS adds certificates to manage
but no secrecy against the threat (other local users cannot read another's loopback traffic
without root); across hosts, TLS belongs under it.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve import env
from pdserve.env import ConfigError


@dataclass(frozen=True)
class Credential:
    name: str
    key: str  # gRPC metadata key
    var: str  # environment variable (or <var>_FILE)


DATA = Credential("data", "x-pdserve-secret", env.SECRET_VAR)
ADMIN = Credential("admin", "x-pdserve-admin", env.ADMIN_SECRET_VAR)
CLIENT = Credential("client", "x-pdserve-client", env.CLIENT_SECRET_VAR)
CREDENTIALS = (DATA, ADMIN, CLIENT)

Rules = Sequence[tuple[str, Credential]]  # (method path prefix, the credential it needs)


def secrets(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The credentials this process was given: name -> value (unset ones left out)."""
    out = {}
    for cred in CREDENTIALS:
        value = env.secret(cred.var, environ)
        if value:
            out[cred.name] = value
    return out


def metadata(names: Sequence[Credential],
             held: Mapping[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    """Metadata presenting the credentials ``names`` that this process holds."""
    held = secrets() if held is None else held
    return tuple((c.key, held[c.name]) for c in names if c.name in held)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, rules: Rules, held: Mapping[str, str], what: str) -> None:
    """Refuse to serve ``rules``' planes on a non-loopback address without their
    credentials: any process that can reach the address could call them."""
    missing = sorted({c.var for _, c in rules if c.name not in held})
    if missing and not is_loopback(host):
        raise ConfigError(f"--host {host}: {what} on a non-loopback address needs "
                          f"{' and '.join(missing)} (or <name>_FILE); refusing to start "
                          "open to the network")


class Guard(grpc.aio.ServerInterceptor):
    """Check each call's credential against ``rules`` (first matching prefix wins)."""

    def __init__(self, rules: Rules, held: Mapping[str, str]) -> None:
        self.rules = [(prefix, cred) for prefix, cred in rules if cred.name in held]
        self.held = dict(held)

    def _refusal(self, method: str, given: Mapping[str, str]) -> tuple[grpc.StatusCode, str] | None:
        need = next((cred for prefix, cred in self.rules if method.startswith(prefix)), None)
        if need is None or _matches(given.get(need.key), self.held[need.name]):
            return None
        call = method.strip("/").replace("pdserve.v1.", "")
        if any(_matches(given.get(c.key), self.held.get(c.name)) for c in CREDENTIALS):
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{call} needs the {need.name} credential (metadata {need.key}); the "
                    "caller's credential does not allow it")
        return (grpc.StatusCode.UNAUTHENTICATED,
                f"{call}: metadata {need.key}: missing or wrong {need.name} credential")

    async def intercept_service(self, continuation: Any,
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        given = {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
        refusal = self._refusal(details.method, given)
        if refusal is None:
            return handler
        code, message = refusal

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(code, message)

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                refuse, handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            refuse, handler.request_deserializer, handler.response_serializer)


def _matches(given: str | None, expected: str | None) -> bool:
    return bool(given and expected) and hmac.compare_digest(str(given).encode(),
                                                            str(expected).encode())


def presenters(pairs: Sequence[tuple[str, str]]) -> list[grpc.aio.ClientInterceptor]:
    """Channel interceptors adding ``pairs`` (the caller's credentials) to every call. One
    per kind of call: ``grpc.aio`` files an interceptor under its first kind only."""
    return [_PresentUnary(pairs), _PresentStream(pairs)]


class _Present:
    def __init__(self, pairs: Sequence[tuple[str, str]]) -> None:
        self.pairs = tuple(pairs)

    def _with(self, details: Any) -> Any:
        merged = (*(details.metadata or ()), *self.pairs)
        return details._replace(metadata=grpc.aio.Metadata(*merged))


class _PresentUnary(_Present, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with(details), request)


class _PresentStream(_Present, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any,
                                     request: Any) -> Any:
        return await continuation(self._with(details), request)
