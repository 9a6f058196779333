"""Streaming clients the load generator drives: any OpenAI-compatible HTTP server, or the
pdserve router over gRPC. Each fills a ``StreamRecord`` and never raises for a request's own
failure (HTTP status, broken stream, gRPC status): those become ``record.error``.

Tokens per chunk (OpenAI streams do not say it directly), first rule that applies:
1. the choice carries ``token_ids`` (a list; vLLM/pdserve extension) -> its length;
2. the chunk carries cumulative ``usage.completion_tokens`` (``continuous_usage_stats``) ->
   the increase since the previous chunk;
3. the choice has non-empty text (``delta.content`` / ``text``) -> 1.
The final ``usage`` chunk (``stream_options.include_usage``), when sent, gives the request's
true token counts, which win over the chunk count for ``tokens_out``; if it reports tokens but
no chunk carried text, they are counted as arriving with the finish chunk. Over gRPC each message's
``token_ids`` is exact.
"""

from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx

APIS = ("chat", "completions")


@dataclass
class StreamRecord:
    """Mutable while one request streams; turned into a ``RequestResult`` at the end."""

    start: float
    events: list[tuple[float, int]] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    detail: str = ""

    def fail(self, error: str, detail: str = "") -> None:
        if self.error is None:  # keep the first cause
            self.error, self.detail = error, detail[:300]

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def parse_chunk(chunk: dict[str, Any], api: str, prev_completion: int | None
                ) -> tuple[int, str, bool]:
    """(new tokens, new text, finished) of one decoded SSE ``data:`` object."""
    num_tokens, texts, finished, counted_by_ids = 0, [], False, False
    for choice in chunk.get("choices") or []:
        text = choice.get("text") if api == "completions" else (choice.get("delta") or {}).get(
            "content")
        if text:
            texts.append(text)
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            num_tokens += len(ids)
            counted_by_ids = True
        elif text:
            num_tokens += 1
        finished = finished or bool(choice.get("finish_reason"))
    usage = chunk.get("usage") or {}
    completion = usage.get("completion_tokens")
    if (not counted_by_ids and chunk.get("choices") and isinstance(completion, int)
            and prev_completion is not None and completion >= prev_completion):
        num_tokens = completion - prev_completion
    return num_tokens, "".join(texts), finished


class Client(ABC):
    """One streaming generation per call; request failures land in ``record.error``."""

    @abstractmethod
    async def resolve_model(self) -> str:
        """The model to ask for (the given one, else the server's first)."""

    @abstractmethod
    async def stream(self, messages: list[dict[str, str]], prompt: str, max_tokens: int,
                     record: StreamRecord) -> None:
        """Generate; ``messages`` for chat APIs, ``prompt`` (the same text) for completions."""

    @abstractmethod
    async def close(self) -> None: ...


class HttpClient(Client):
    """OpenAI-compatible ``/chat/completions`` or ``/completions`` with SSE streaming."""

    def __init__(self, base_url: str, *, api: str = "chat", model: str | None = None,
                 ignore_eos: bool = True, temperature: float = 0.0,
                 continuous_usage: bool = False, api_key: str | None = None) -> None:
        if api not in APIS:
            raise ValueError(f"api must be one of {', '.join(APIS)}, got {api!r}")
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        self.api, self.model = api, model
        self.ignore_eos, self.temperature = ignore_eos, temperature
        self.continuous_usage = continuous_usage
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Open loop: never queue requests behind a client-side connection limit.
        self.http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=headers, timeout=httpx.Timeout(None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))

    async def resolve_model(self) -> str:
        if self.model:
            return self.model
        try:
            resp = await self.http.get("/models", timeout=30.0)
            resp.raise_for_status()
            self.model = str(resp.json()["data"][0]["id"])
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            url = f"{str(self.http.base_url).rstrip('/')}/models"
            raise RuntimeError(f"could not list models at {url} ({e!r}); "
                               "pass --model") from e
        return self.model

    def _body(self, messages: list[dict[str, str]], prompt: str, max_tokens: int
              ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": max_tokens, "stream": True,
            "temperature": self.temperature,
            "stream_options": {"include_usage": True},
        }
        if self.continuous_usage:
            body["stream_options"]["continuous_usage_stats"] = True
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM/pdserve extension: output length as drawn
        body["messages" if self.api == "chat" else "prompt"] = (
            messages if self.api == "chat" else prompt)
        return body

    async def stream(self, messages: list[dict[str, str]], prompt: str, max_tokens: int,
                     record: StreamRecord) -> None:
        path = "/chat/completions" if self.api == "chat" else "/completions"
        try:
            async with self.http.stream("POST", path,
                                        json=self._body(messages, prompt, max_tokens)) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode("utf-8", "replace")
                    record.fail(f"http_{resp.status_code}", body)
                    return
                await self._read_sse(resp, record)
        except httpx.TimeoutException as e:
            record.fail("timeout", repr(e))
        except httpx.ConnectError as e:
            record.fail("connect_error", repr(e))
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            record.fail("broken_stream", repr(e))
        except httpx.HTTPError as e:
            record.fail("http_error", repr(e))

    async def _read_sse(self, resp: httpx.Response, record: StreamRecord) -> None:
        done = finished = False
        finish_time: float | None = None
        async for line in resp.aiter_lines():
            now = time.perf_counter()
            if not line.startswith("data:"):
                continue  # blank separators, ": comments", "event:" lines
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                record.fail("bad_chunk", data)
                return
            if not isinstance(chunk, dict):
                record.fail("bad_chunk", data)
                return
            if "error" in chunk:
                record.fail("stream_error", json.dumps(chunk["error"]))
                return
            prev = record.completion_tokens
            if prev is None and not any(n for _, n in record.events):
                prev = 0  # the first chunk with continuous usage carries all tokens so far
            n, text, fin = parse_chunk(chunk, self.api, prev)
            if fin and not finished:
                finished, finish_time = True, now
            record.events.append((now, n))
            if text:
                record.text_parts.append(text)
            _take_usage(chunk.get("usage"), record)
        if not (done or finished):
            record.fail("broken_stream", "stream ended without finish_reason or [DONE]")
        elif finish_time is not None and record.completion_tokens and not any(
                n for _, n in record.events):
            # Tokens whose text is empty (e.g. a partial UTF-8 sequence at the end) send no
            # content chunk; the client first learns of them with the finish chunk.
            record.events.append((finish_time, record.completion_tokens))

    async def close(self) -> None:
        await self.http.aclose()


def _take_usage(usage: Any, record: StreamRecord) -> None:
    if not isinstance(usage, dict):
        return
    if isinstance(usage.get("prompt_tokens"), int):
        record.prompt_tokens = usage["prompt_tokens"]
    if isinstance(usage.get("completion_tokens"), int):
        record.completion_tokens = usage["completion_tokens"]
    details = usage.get("prompt_tokens_details") or {}
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        record.cached_tokens = details["cached_tokens"]


class GrpcClient(Client):
    """``pdserve.v1.Router/Generate`` over gRPC (chat input, rendered by the router)."""

    def __init__(self, address: str, *, model: str | None = None, ignore_eos: bool = True,
                 temperature: float = 0.0, timeout_s: float = 600.0,
                 credentials: tuple[tuple[str, str], ...] = ()) -> None:
        from pdserve import auth
        from pdserve.channel import insecure_channel
        from pdserve.proto.v1 import router_pb2_grpc

        self.model, self.ignore_eos, self.temperature = model, ignore_eos, temperature
        self.timeout_s = timeout_s
        # The router's client credential: given, or this process's (PDSERVE_CLIENT_SECRET).
        self.channel = insecure_channel(address, credentials=credentials
                                        or auth.metadata([auth.CLIENT]))
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    async def resolve_model(self) -> str:
        from pdserve.proto.v1 import router_pb2

        if self.model:
            return self.model
        try:
            resp = await self.stub.ListModels(router_pb2.ListModelsRequest(), timeout=30.0)
        except grpc.aio.AioRpcError as e:
            raise RuntimeError(f"Router.ListModels failed ({e.code().name}: {e.details()}); "
                               "pass --model") from e
        if not resp.models:
            raise RuntimeError("Router.ListModels returned no model; pass --model")
        self.model = resp.models[0].id
        return self.model

    async def stream(self, messages: list[dict[str, str]], prompt: str, max_tokens: int,
                     record: StreamRecord) -> None:
        from pdserve.proto.v1 import common_pb2, router_pb2

        request = router_pb2.GenerateRequest(
            model=self.model or "",
            chat=router_pb2.ChatMessages(messages=[
                router_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                               temperature=self.temperature),
            meta=common_pb2.RequestMeta(request_id=f"bench-{uuid.uuid4().hex}"))
        finished = False
        try:
            async for msg in self.stub.Generate(request, timeout=self.timeout_s):
                record.events.append((time.perf_counter(), len(msg.token_ids)))
                if msg.text:
                    record.text_parts.append(msg.text)
                if msg.HasField("usage"):
                    record.prompt_tokens = msg.usage.prompt_tokens
                    record.completion_tokens = msg.usage.completion_tokens
                    record.cached_tokens = msg.usage.cached_tokens
                finished = finished or msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        except grpc.aio.AioRpcError as e:
            record.fail(f"grpc_{e.code().name.lower()}", e.details() or "")
            return
        if not finished:
            record.fail("broken_stream", "stream ended without finish_reason")

    async def close(self) -> None:
        await self.channel.close()
