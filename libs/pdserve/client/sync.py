"""The blocking client: ``Client(target).generate(...)`` streams chunks from ``Router.Generate``.

A stream is cancelled on the server (the router aborts the engines' work and frees its KV
blocks) when it is closed: ``stream.close()``, leaving its ``with`` block, or dropping it
unfinished (``for chunk in client.generate(...): break``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Unpack

import grpc

from pdserve.client.base import DEFAULT_TARGET, DEFAULT_TIMEOUT, Metadata, Settings, Timeout
from pdserve.client.channel import TLS, Retry
from pdserve.client.errors import error_from
from pdserve.client.request import (
    GenerateParams,
    Message,
    ToolArg,
    build_request,
    build_tokenize_request,
)
from pdserve.client.types import Chunk, Completion, Model, models_from
from pdserve.proto.v1 import router_pb2, router_pb2_grpc


class GenerateStream:
    """One streamed generation: an iterator of ``Chunk``; errors raise ``PdserveError``s."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self.completion = Completion()  # everything received so far
        self.is_done = False

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        while True:
            try:
                msg = next(self._call)
            except StopIteration:
                self.is_done = True
                raise
            except grpc.RpcError as exc:
                self.is_done = True
                raise error_from(exc) from exc
            chunk = self.completion.add(msg)
            if chunk is not None:
                return chunk

    def collect(self) -> Completion:
        """Read the rest of the stream; the whole completion."""
        for _ in self:
            pass
        return self.completion

    def close(self) -> None:
        """Cancel the call if it is still running (the server frees what it holds)."""
        if not self.is_done:
            self.is_done = True
            self._call.cancel()

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class Client:
    """A blocking client of the router. ``timeout`` (seconds, None = none) is every call's
    default deadline; ``retry`` gRPC's retry policy (None: no retries); ``tls`` True (system
    roots) or a ``TLS``; ``call_credentials`` (needs TLS) and ``metadata`` go with every call;
    ``model`` is the default model ("" = the router's)."""

    def __init__(self, target: str = DEFAULT_TARGET, *, model: str = "",
                 timeout: float | None = DEFAULT_TIMEOUT, retry: Retry | None = Retry(),
                 tls: TLS | bool | None = None,
                 call_credentials: grpc.CallCredentials | None = None,
                 metadata: Metadata = (), options: Sequence[tuple[str, Any]] = ()) -> None:
        self.settings = Settings.of(target, model, timeout, retry, tls, call_credentials,
                                    metadata, options)
        creds = self.settings.credentials
        opts = self.settings.channel_options
        self._channel = (grpc.insecure_channel(target, options=opts) if creds is None
                         else grpc.secure_channel(target, creds, options=opts))
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def generate(self, prompt: str | Sequence[int], *, model: str | None = None,
                 timeout: Timeout = ..., metadata: Metadata | None = None,
                 credentials: grpc.CallCredentials | None = None,
                 **params: Unpack[GenerateParams]) -> GenerateStream:
        """Complete ``prompt`` (text, or token ids); ``params`` are the contract's sampling and
        meta fields (``max_tokens=16, temperature=0, stop=["\\n"], seed=1, tenant=...``)."""
        request = build_request(self._model(model), prompt=prompt, params=params)
        return self._generate(request, timeout, metadata, credentials)

    def chat(self, messages: Sequence[Message], *, model: str | None = None,
             timeout: Timeout = ..., metadata: Metadata | None = None,
             credentials: grpc.CallCredentials | None = None,
             documents: Sequence[Mapping[str, str]] | None = None,
             **params: Unpack[GenerateParams]) -> GenerateStream:
        """Answer chat ``messages`` (``{"role": ..., "content": ...}``), rendered with the
        model's chat template by the router (with ``tools`` and ``documents``)."""
        request = build_request(self._model(model), messages=messages, params=params,
                                documents=documents)
        return self._generate(request, timeout, metadata, credentials)

    def models(self, *, timeout: Timeout = ..., metadata: Metadata | None = None,
               credentials: grpc.CallCredentials | None = None) -> list[Model]:
        """The models the cluster serves."""
        kwargs = self.settings.call_kwargs(timeout, metadata, credentials)
        try:
            return models_from(self._stub.ListModels(router_pb2.ListModelsRequest(), **kwargs))
        except grpc.RpcError as exc:
            raise error_from(exc) from exc

    def tokenize(self, prompt: str | None = None, *,
                 messages: Sequence[Message] | None = None, model: str | None = None,
                 add_special_tokens: bool = True, add_generation_prompt: bool = True,
                 tools: Sequence[ToolArg] = (), timeout: Timeout = ...,
                 metadata: Metadata | None = None,
                 credentials: grpc.CallCredentials | None = None) -> list[int]:
        """The token ids ``generate`` (a prompt) or ``chat`` (messages) would send."""
        request = build_tokenize_request(self._model(model), prompt, messages,
                                         add_special_tokens, add_generation_prompt, tools)
        kwargs = self.settings.call_kwargs(timeout, metadata, credentials)
        try:
            reply = self._stub.Tokenize(request, **kwargs)
        except grpc.RpcError as exc:
            raise error_from(exc) from exc
        return list(reply.token_ids)

    def detokenize(self, token_ids: Sequence[int], *, model: str | None = None,
                   timeout: Timeout = ..., metadata: Metadata | None = None,
                   credentials: grpc.CallCredentials | None = None) -> str:
        """The text of ``token_ids`` (special tokens included)."""
        request = router_pb2.DetokenizeRequest(model=self._model(model), token_ids=token_ids)
        kwargs = self.settings.call_kwargs(timeout, metadata, credentials)
        try:
            reply = self._stub.Detokenize(request, **kwargs)
        except grpc.RpcError as exc:
            raise error_from(exc) from exc
        return str(reply.text)

    def cluster_state(self, *, timeout: Timeout = ..., metadata: Metadata | None = None,
                      credentials: grpc.CallCredentials | None = None
                      ) -> router_pb2.ClusterStateResponse:
        """Instances, their health and load, and the index's state (the proto)."""
        kwargs = self.settings.call_kwargs(timeout, metadata, credentials)
        try:
            reply: router_pb2.ClusterStateResponse = self._stub.ClusterState(
                router_pb2.ClusterStateRequest(), **kwargs)
        except grpc.RpcError as exc:
            raise error_from(exc) from exc
        return reply

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _model(self, model: str | None) -> str:
        return self.settings.model if model is None else model

    def _generate(self, request: router_pb2.GenerateRequest, timeout: Timeout,
                  metadata: Metadata | None, credentials: grpc.CallCredentials | None
                  ) -> GenerateStream:
        kwargs = self.settings.call_kwargs(timeout, metadata, credentials)
        return GenerateStream(self._stub.Generate(request, **kwargs))
