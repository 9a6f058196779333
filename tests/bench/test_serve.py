"""The load generator against real local servers: an OpenAI-style HTTP server with scripted
failures, and a gRPC Router servicer."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from pdserve.proto.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdserve_bench.runner import LoadSettings, Target, run_load_async
from pdserve_bench.serve import main
from pdserve_bench.workload import WorkloadSpec
from tests.bench.fake_openai import FakeServer, start
from tests.bench.helpers import check_smoke_run

SMALL = {"chat_input": [4, 8], "chat_output": [5, 9], "rag_input": [20, 30], "rag_output": [2, 4],
         "first_turn_input": [4, 8], "turn_input": [2, 4], "turn_output": [3, 5],
         "turns": [3, 3]}


async def _serve(server: FakeServer) -> AsyncIterator[str]:
    runner, url = await start(server)
    try:
        yield url
    finally:
        await runner.cleanup()


def _load(workload: str = "chat", **kw: object) -> LoadSettings:
    args: dict = {"workload": WorkloadSpec.from_mapping(workload, SMALL), "rates": (math.inf,),
                  "num_requests": 14, "request_timeout_s": 1.0, "progress": False}
    args.update(kw)
    return LoadSettings(**args)


async def test_errors_are_counted_and_the_run_completes() -> None:
    server = FakeServer(("ok", "500", "ok", "429", "broken", "ok", "hang"))
    async for url in _serve(server):
        runs = await run_load_async(Target(base_url=url), _load(slo_ttft_ms=5000))
    (run,) = runs
    s = run.summary
    assert s.num_requests == 14 and s.num_ok == 6
    assert s.errors == {"broken_stream": 2, "http_429": 2, "http_500": 2, "timeout": 2}
    assert s.goodput_rps is not None and s.goodput_rps > 0
    for r in run.results:
        if r.is_ok:
            assert r.ttft_s is not None and r.ttft_s >= 0.02  # the server waits 20 ms
            assert r.tokens_out == len(r.itls_s) + 1  # one token per chunk
        elif r.error == "timeout":
            assert r.e2e_s >= 1.0
    body = server.bodies[0]
    assert body["stream"] is True and body["ignore_eos"] is True and body["model"] == "fake"
    assert body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("counting", ["token_ids", "continuous_usage", "text"])
async def test_tokens_batched_in_chunks_and_completions_api(counting: str) -> None:
    server = FakeServer(tokens_per_chunk=3, send_token_ids=counting == "token_ids")
    target = Target(base_url="http://unused", api="completions",
                    continuous_usage=counting == "continuous_usage")
    async for url in _serve(server):
        (run,) = await run_load_async(replace(target, base_url=url), _load(num_requests=4))
    assert run.summary.num_errors == 0
    for r, body in zip(sorted(run.results, key=lambda r: r.conversation),
                       server.bodies, strict=True):
        assert "prompt" in body and r.tokens_out == body["max_tokens"]  # from usage
        num_chunks = math.ceil(r.tokens_out / 3)
        if counting == "text":  # without per-chunk counts each text chunk counts as one token
            assert len(r.itls_s) == num_chunks - 1
            assert r.tokens_in == len(body["prompt"].split())  # the final usage wins
        else:  # exact: one ITL per token after the first chunk's 3
            assert len(r.itls_s) == r.tokens_out - 3
        # TPOT always divides by the server's token count
        assert r.tpot_s == pytest.approx(sum(r.itls_s) / (r.tokens_out - 1))


async def test_tokens_without_text_and_streams_without_tokens() -> None:
    server = FakeServer(("silent", "empty"))
    async for url in _serve(server):
        (run,) = await run_load_async(Target(base_url=url), _load(num_requests=2))
    silent, empty = sorted(run.results, key=lambda r: r.error or "")
    assert silent.is_ok and silent.tokens_out in {b["max_tokens"] for b in server.bodies}
    assert silent.ttft_s is not None and silent.ttft_s >= 0.02 and silent.itls_s == ()
    assert empty.error == "no_tokens" and empty.tokens_out == 0


async def test_multiturn_turns_wait_and_extend_the_conversation() -> None:
    server = FakeServer()
    async for url in _serve(server):
        (run,) = await run_load_async(Target(base_url=url), _load("multiturn", num_requests=6))
    assert run.summary.num_ok == 6
    by_conv: dict[int, list[list[dict]]] = {}
    for body in server.bodies:  # the server saw each conversation's turns in order
        key = len(body["messages"][0]["content"])
        by_conv.setdefault(key, []).append(body["messages"])
    assert sorted(len(v) for v in by_conv.values()) == [3, 3]
    for turns in by_conv.values():
        for prev, nxt in zip(turns, turns[1:], strict=False):
            assert nxt[: len(prev)] == prev
            assert nxt[len(prev)]["role"] == "assistant" and nxt[len(prev)]["content"].startswith(
                " tok")
    for r in run.results:
        if r.turn > 0:  # sent only after the previous turn of its conversation finished
            before = next(x for x in run.results
                          if (x.conversation, x.turn) == (r.conversation, r.turn - 1))
            assert r.start_s >= before.start_s + before.e2e_s


async def test_failed_turn_ends_its_conversation() -> None:
    server = FakeServer(("ok", "500"))
    async for url in _serve(server):
        (run,) = await run_load_async(Target(base_url=url),
                                      _load("multiturn", num_requests=3, rates=(1.0,)))
    assert [r.error for r in run.results] == [None, "http_500"]
    assert run.summary.num_skipped == 1


async def test_cli_writes_json_and_prints_the_table(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    server = FakeServer(("ok", "ok", "500"))
    out = tmp_path / "serve.json"
    async for url in _serve(server):
        code = await asyncio.to_thread(main, [
            "--base-url", url, "--workload", "chat", "--rates", "200,inf", "--num-requests", "6",
            "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100", "--out", str(out), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "== chat @ 200 req/s" in printed and "== chat @ inf req/s" in printed
    data = json.loads(out.read_text())
    assert [run["rate"] for run in data["runs"]] == [200.0, "inf"]
    for run in data["runs"]:
        assert run["summary"]["errors"] == {"http_500": 2}
        assert len(run["requests"]) == 6 and run["metrics"]["ttft_p50_ms"] > 0


async def test_smoke_helper_against_a_live_server() -> None:
    async for url in _serve(FakeServer()):
        run = await asyncio.to_thread(check_smoke_run, url)
    assert run.summary.num_ok == 4


@pytest.mark.parametrize(("argv", "message"), [
    (["--rate", "0"], "argument --rate: must be > 0"),
    (["--rates", "1,x"], "argument --rates: expected numbers"),
    (["--num-requests", "-3"], "argument --num-requests: must be > 0"),
    (["--slo-ttft-ms", "0"], "argument --slo-ttft-ms: must be > 0"),
    (["--router", "127.0.0.1:1"], "argument --router: not allowed with argument --base-url"),
    (["--workload", "sharegpt"], "argument --workload: invalid choice"),
    (["--warmup", "-1"], "argument --warmup: must be >= 0"),
    (["--tokenizer-model", "gpt9"], "--tokenizer-model must be a directory or one of"),
])
def test_cli_errors_name_the_flag(argv: list[str], message: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--base-url", "http://127.0.0.1:9/v1", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_unreachable_server_is_a_clear_setup_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--base-url", "http://127.0.0.1:9/v1", "--num-requests", "1",
                 "--no-progress"]) == 1
    assert "could not list models at http://127.0.0.1:9/v1/models" in capsys.readouterr().err


class FakeRouter(router_pb2_grpc.RouterServicer):
    """Every third request is refused (RESOURCE_EXHAUSTED); the others stream 1 token/msg."""

    def __init__(self) -> None:
        self.num_requests = 0

    async def ListModels(self, request, context):  # type: ignore[no-untyped-def]
        return router_pb2.ListModelsResponse(models=[router_pb2.ModelInfo(id="tiny")])

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        self.num_requests += 1
        if self.num_requests % 3 == 0:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "quota")
        assert request.model == "tiny" and request.sampling.ignore_eos
        n = request.sampling.max_tokens
        yield router_pb2.GenerateResponse(placement=router_pb2.Placement(prefill_instance="p0"))
        for i in range(n):
            await asyncio.sleep(0.001)
            last = i == n - 1
            yield router_pb2.GenerateResponse(
                token_ids=[i], text=" t",
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
                usage=common_pb2.Usage(prompt_tokens=7, completion_tokens=n,
                                       cached_tokens=5) if last else None)


async def test_router_grpc_target() -> None:
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(FakeRouter(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        (run,) = await run_load_async(Target(router=f"127.0.0.1:{port}"), _load(num_requests=6))
    finally:
        await server.stop(None)
    assert run.summary.errors == {"grpc_resource_exhausted": 2} and run.summary.num_ok == 4
    for r in run.results:
        if r.is_ok:
            assert r.tokens_in == 7 and r.cached_tokens == 5
            assert len(r.itls_s) == r.tokens_out - 1
