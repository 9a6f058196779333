"""The asyncio client: ``AsyncClient(target).generate(...)`` streams chunks (``grpc.aio``).

A stream is cancelled on the server when it is closed: ``await stream.aclose()`` (or
``stream.close()``), leaving its ``async with`` block, or dropping it unfinished.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
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


class AsyncGenerateStream:
    """One streamed generation: an async iterator of ``Chunk``; errors raise
    ``PdserveError``s."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call
        self.completion = Completion()  # everything received so far
        self.is_done = False

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self

    async def __anext__(self) -> Chunk:
        while True:
            try:
                msg = await self._call.read()
            except grpc.RpcError as exc:
                self.is_done = True
                raise error_from(exc) from exc
            if msg is grpc.aio.EOF:
                self.is_done = True
                raise StopAsyncIteration
            assert isinstance(msg, router_pb2.GenerateResponse)
            chunk = self.completion.add(msg)
            if chunk is not None:
                return chunk

    async def collect(self) -> Completion:
        """Read the rest of the stream; the whole completion."""
        async for _ in self:
            pass
        return self.completion

    def close(self) -> None:
        """Cancel the call if it is still running (the server frees what it holds)."""
        if not self.is_done:
            self.is_done = True
            self._call.cancel()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> AsyncGenerateStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class AsyncClient:
    """The asyncio twin of ``Client`` (same arguments); create it inside the event loop."""

    def __init__(self, target: str = DEFAULT_TARGET, *, model: str = "",
                 timeout: float | None = DEFAULT_TIMEOUT, retry: Retry | None = Retry(),
                 tls: TLS | bool | None = None,
                 call_credentials: grpc.CallCredentials | None = None,
                 metadata: Metadata = (), options: Sequence[tuple[str, Any]] = ()) -> None:
        self.settings = Settings.of(target, model, timeout, retry, tls, call_credentials,
                                    metadata, options)
        creds = self.settings.credentials
        opts = self.settings.channel_options
        self._channel = (grpc.aio.insecure_channel(target, options=opts) if creds is None
                         else grpc.aio.secure_channel(target, creds, options=opts))
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def generate(self, prompt: str | Sequence[int], *, model: str | None = None,
                 timeout: Timeout = ..., metadata: Metadata | None = None,
                 credentials: grpc.CallCredentials | None = None,
                 **params: Unpack[GenerateParams]) -> AsyncGenerateStream:
        """As ``Client.generate``; iterate the stream with ``async for``."""
        request = build_request(self._model(model), prompt=prompt, params=params)
        return self._generate(request, timeout, metadata, credentials)

    def chat(self, messages: Sequence[Message], *, model: str | None = None,
             timeout: Timeout = ..., metadata: Metadata | None = None,
             credentials: grpc.CallCredentials | None = None,
             documents: Sequence[Mapping[str, str]] | None = None,
             **params: Unpack[GenerateParams]) -> AsyncGenerateStream:
        """As ``Client.chat``."""
        request = build_request(self._model(model), messages=messages, params=params,
                                documents=documents)
        return self._generate(request, timeout, metadata, credentials)

    async def models(self, *, timeout: Timeout = ..., metadata: Metadata | None = None,
                     credentials: grpc.CallCredentials | None = None) -> list[Model]:
        kwargs = self.settings.call_kwargs(timeout, metadata, credentials)
        try:
            return models_from(await self._stub.ListModels(router_pb2.ListModelsRequest(),
                                                           **kwargs))
        except grpc.RpcError as exc:
            raise error_from(exc) from exc

    async def tokenize(self, prompt: str | None = None, *,
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
            reply = await self._stub.Tokenize(request, **kwargs)
        except grpc.RpcError as exc:
            raise error_from(exc) from exc
        return list(reply.token_ids)

    async def detokenize(self, token_ids: Sequence[int], *, model: str | None = None,
                   timeout: Timeout = ..., metadata: Metadata | None = None,
                   credentials: grpc.CallCredentials | None = None) -> str:
        """The text of ``token_ids`` (special tokens included)."""
        request = router_pb2.DetokenizeRequest(model=self._model(model), token_ids=token_ids)
        kwargs = self.settings.call_kwargs(timeout, metadata, credentials)
        try:
            reply = await self._stub.Detokenize(request, **kwargs)
        except grpc.RpcError as exc:
            raise error_from(exc) from exc
        return str(reply.text)

    async def cluster_state(self, *, timeout: Timeout = ..., metadata: Metadata | None = None,
                            credentials: grpc.CallCredentials | None = None
                            ) -> router_pb2.ClusterStateResponse:
        kwargs = self.settings.call_kwargs(timeout, metadata, credentials)
        try:
            reply: router_pb2.ClusterStateResponse = await self._stub.ClusterState(
                router_pb2.ClusterStateRequest(), **kwargs)
        except grpc.RpcError as exc:
            raise error_from(exc) from exc
        return reply

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _model(self, model: str | None) -> str:
        return self.settings.model if model is None else model

    def _generate(self, request: router_pb2.GenerateRequest, timeout: Timeout,
                  metadata: Metadata | None, credentials: grpc.CallCredentials | None
                  ) -> AsyncGenerateStream:
        kwargs = self.settings.call_kwargs(timeout, metadata, credentials)
        return AsyncGenerateStream(self._stub.Generate(request, **kwargs))
