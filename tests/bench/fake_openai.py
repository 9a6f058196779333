"""A real OpenAI-style streaming HTTP server (aiohttp) with scripted failures, for the bench tests.

Requests are answered in turn by a cyclic ``schedule`` of behaviours:
``ok`` (a good SSE stream), ``500``, ``429``, ``broken`` (the connection is cut mid-stream),
``hang`` (first token never comes), ``silent`` (tokens whose text is empty), ``empty`` (no
token at all). Run as a script it is a stand-in for ``pdserve up``: it
prints ``pdserve ready: <url>`` and stops on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class FakeServer:
    schedule: tuple[str, ...] = ("ok",)
    ttft_s: float = 0.02
    itl_s: float = 0.002
    tokens_per_chunk: int = 1
    send_token_ids: bool = False  # the vLLM/pdserve per-choice token_ids extension
    num_requests: int = 0
    bodies: list[dict] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_post("/v1/completions", self.complete)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        behaviour = self.schedule[self.num_requests % len(self.schedule)]
        self.num_requests += 1
        if behaviour in ("500", "429"):
            return web.json_response({"error": {"message": f"scripted {behaviour}"}},
                                     status=int(behaviour))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chat = request.path.endswith("/chat/completions")
        if behaviour == "hang":
            await asyncio.sleep(3600)
        await asyncio.sleep(self.ttft_s)
        max_tokens = 0 if behaviour == "empty" else int(body["max_tokens"])
        if behaviour == "empty":  # a finish chunk and no token at all
            await _send(resp, {"object": "chunk",
                               "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]})
        sent = 0
        while sent < max_tokens:
            n = min(self.tokens_per_chunk, max_tokens - sent)
            text = "" if behaviour == "silent" else " tok" * n
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0,
                                                                             "text": text}
            choice["finish_reason"] = "length" if sent + n == max_tokens else None
            if self.send_token_ids:
                choice["token_ids"] = list(range(sent, sent + n))
            chunk: dict = {"object": "chunk", "choices": [choice]}
            if (body.get("stream_options") or {}).get("continuous_usage_stats"):
                chunk["usage"] = {"prompt_tokens": 1, "completion_tokens": sent + n}
            await _send(resp, chunk)
            sent += n
            if behaviour == "broken" and sent >= 2:
                assert request.transport is not None
                request.transport.close()  # cut the connection: no terminating chunk
                return resp
            await asyncio.sleep(self.itl_s)
        prompt = body.get("prompt") or " ".join(m["content"] for m in body["messages"])
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": sent}
        await _send(resp, {"object": "chunk", "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _send(resp: web.StreamResponse, chunk: dict) -> None:
    await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())


async def start(server: FakeServer, host: str = "127.0.0.1", port: int = 0
                ) -> tuple[web.AppRunner, str]:
    """Serve on a free port; returns (runner to clean up, base URL ending in /v1)."""
    # handler_cancellation: a client that gives up (timeout) ends its handler, e.g. a hang
    runner = web.AppRunner(server.app(), handler_cancellation=True,
                           shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sockets = site._server.sockets  # type: ignore[union-attr]
    return runner, f"http://{host}:{sockets[0].getsockname()[1]}/v1"


async def _main(ns: argparse.Namespace) -> None:
    server = FakeServer(tuple(ns.schedule.split(",")), ns.ttft_ms / 1000, ns.itl_ms / 1000)
    runner, url = await start(server)
    print(f"pdserve ready: {url}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("up", nargs="?")  # accepts the `up` of `pdserve up`
    parser.add_argument("--schedule", default="ok")
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--itl-ms", type=float, default=2.0)
    parser.add_argument("--fail", action="store_true", help="exit at once with an error")
    ns = parser.parse_args()
    if ns.fail:
        print("fake launcher: scripted failure", file=sys.stderr)
        sys.exit(3)
    asyncio.run(_main(ns))
