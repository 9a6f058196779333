"""The open-loop runner behind ``pdserve bench serve`` and ``compare``.

Each conversation is sent at its planned arrival time whatever the server's state (open loop);
only a multiturn conversation waits for its own previous turn. A failed turn ends its
conversation; the turns never sent are reported as ``skipped``, not as errors.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pdserve_bench.client import APIS, Client, GrpcClient, HttpClient, StreamRecord
from pdserve_bench.stats import RequestResult, Summary, summarize, timings_from_events
from pdserve_bench.workload import (
    Conversation,
    Plan,
    PromptMaker,
    Turn,
    WorkloadSpec,
    chat_messages,
    completion_prompt,
    make_plan,
)


@dataclass(frozen=True)
class Target:
    """Where the load goes: exactly one of ``base_url`` (HTTP) and ``router`` (gRPC)."""

    base_url: str = ""
    router: str = ""
    api: str = "chat"
    model: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    continuous_usage: bool = False
    api_key: str | None = None
    # gRPC metadata for the router (its client credential); () = from this process's env
    router_credentials: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if bool(self.base_url) == bool(self.router):
            raise ValueError("give exactly one of base_url (--base-url) and router (--router)")
        if self.api not in APIS:
            raise ValueError(f"api must be one of {', '.join(APIS)}, got {self.api!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    def client(self, request_timeout_s: float) -> Client:
        if self.router:
            return GrpcClient(self.router, model=self.model, ignore_eos=self.ignore_eos,
                              temperature=self.temperature, timeout_s=request_timeout_s,
                              credentials=self.router_credentials)
        return HttpClient(self.base_url, api=self.api, model=self.model,
                          ignore_eos=self.ignore_eos, temperature=self.temperature,
                          continuous_usage=self.continuous_usage, api_key=self.api_key)


@dataclass(frozen=True)
class LoadSettings:
    """What to send: one run per rate, each with its own seeded plan."""

    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    rates: tuple[float, ...] = (1.0,)
    seed: int = 0
    num_requests: int | None = 100
    duration_s: float | None = None
    request_timeout_s: float = 120.0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    warmup_requests: int = 0
    progress: bool = True
    block_size: int = 16  # the server's, for the multiturn reuse oracle

    def __post_init__(self) -> None:
        if not self.rates or any(not r > 0 for r in self.rates):
            raise ValueError(f"rates must be > 0 requests/s, got {list(self.rates)}")
        if (self.num_requests is None) == (self.duration_s is None):
            raise ValueError("give exactly one of num_requests and duration_s")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.warmup_requests < 0:
            raise ValueError(f"warmup_requests must be >= 0, got {self.warmup_requests}")

    def plan(self, rate_index: int, maker: PromptMaker | None = None) -> Plan:
        # A separate stream per rate: repeated prompts across rates would become cache hits.
        return make_plan(self.workload, self.rates[rate_index], self.seed,
                         num_requests=self.num_requests, duration_s=self.duration_s,
                         stream=f"rate{rate_index}", maker=maker)


@dataclass(frozen=True)
class RunResult:
    rate: float
    results: tuple[RequestResult, ...]
    summary: Summary

    def to_json(self, with_requests: bool = True) -> dict[str, Any]:
        rate: float | str = self.rate if math.isfinite(self.rate) else "inf"
        out: dict[str, Any] = {"rate": rate, "summary": self.summary.to_json(),
                               "metrics": self.summary.flat()}
        if with_requests:
            out["requests"] = [r.to_json() for r in self.results]
        return out


async def _one_request(client: Client, conv: Conversation, index: int, turn: Turn,
                       messages: list[dict[str, str]], t0: float, timeout_s: float
                       ) -> tuple[RequestResult, str]:
    record = StreamRecord(start=time.perf_counter())
    try:
        async with asyncio.timeout(timeout_s):
            await client.stream(messages, completion_prompt(messages), turn.max_tokens, record)
    except TimeoutError:
        record.fail("timeout", f"no complete answer within {timeout_s:g} s")
    except Exception as e:  # noqa: BLE001 -- one request's surprise must not end a long sweep
        record.fail("client_error", repr(e))
    end = time.perf_counter()
    timings = timings_from_events(record.start, record.events)
    tokens_out = record.completion_tokens
    if tokens_out is None:
        tokens_out = timings.num_tokens
    if record.error is None and timings.ttft_s is None:
        record.fail("no_tokens", "the stream finished without any token")
    result = RequestResult(
        conversation=conv.index, turn=index, kind=turn.kind, start_s=record.start - t0,
        e2e_s=end - record.start, ttft_s=timings.ttft_s, tpot_s=timings.tpot_for(tokens_out),
        itls_s=timings.itls_s,
        tokens_in=record.prompt_tokens if record.prompt_tokens is not None else turn.input_tokens,
        tokens_out=tokens_out, cached_tokens=record.cached_tokens, error=record.error,
        detail=record.detail)
    return result, record.text


async def run_plan(client: Client, plan: Plan, timeout_s: float,
                   on_done: Callable[[int], None] = lambda n: None
                   ) -> tuple[list[RequestResult], int]:
    """Send every conversation at its arrival time; returns (results, turns skipped)."""
    results: list[RequestResult] = []
    skipped = 0
    t0 = time.perf_counter()

    async def conversation(conv: Conversation) -> None:
        nonlocal skipped
        await asyncio.sleep(max(0.0, t0 + conv.arrival_s - time.perf_counter()))
        history: list[dict[str, str]] = []
        for i, turn in enumerate(conv.turns):
            messages = chat_messages(history, turn)
            result, answer = await _one_request(client, conv, i, turn, messages, t0, timeout_s)
            results.append(result)
            on_done(1)
            if not result.is_ok:
                skipped += len(conv.turns) - i - 1
                on_done(len(conv.turns) - i - 1)
                return
            history = [*messages, {"role": "assistant", "content": answer}]

    await asyncio.gather(*(conversation(c) for c in plan.conversations))
    results.sort(key=lambda r: (r.start_s, r.conversation, r.turn))
    return results, skipped


async def run_load_async(target: Target, load: LoadSettings, maker: PromptMaker | None = None,
                         *, rate_indices: Sequence[int] | None = None, warmup: bool = True
                         ) -> list[RunResult]:
    """Every rate of ``load`` (or those at ``rate_indices``), after the warm-up requests."""
    client = target.client(load.request_timeout_s)
    runs: list[RunResult] = []
    indices = range(len(load.rates)) if rate_indices is None else rate_indices
    try:
        await client.resolve_model()
        if load.warmup_requests and warmup:
            warm = make_plan(load.workload, math.inf, load.seed,
                             num_requests=load.warmup_requests, stream="warmup", maker=maker)
            await run_plan(client, warm, load.request_timeout_s)
        for i in indices:
            rate, plan = load.rates[i], load.plan(i, maker)
            bar = tqdm(total=plan.num_requests, desc=f"{plan.workload} @ {rate:g} req/s",
                       unit="req", file=sys.stderr, disable=None if load.progress else True)
            try:
                results, skipped = await run_plan(client, plan, load.request_timeout_s,
                                                  bar.update)
            finally:
                bar.close()
            summary = summarize(results, slo_ttft_ms=load.slo_ttft_ms,
                                slo_tpot_ms=load.slo_tpot_ms, num_skipped=skipped,
                                block_size=load.block_size)
            runs.append(RunResult(rate, tuple(results), summary))
    finally:
        await client.close()
    return runs


def run_load(target: Target, load: LoadSettings, maker: PromptMaker | None = None
             ) -> list[RunResult]:
    return asyncio.run(run_load_async(target, load, maker))


def smoke_run(base_url: str, num_requests: int = 4, *, workload: str = "chat",
              max_tokens: int = 8, timeout_s: float = 60.0) -> RunResult:
    """A few short requests at once, for an end-to-end test against a live stack (e.g. the
    URL `pdserve up` prints). The caller asserts on the result (no errors, tokens_out...)."""
    spec = WorkloadSpec.from_mapping(workload, {
        "chat_input": [8, 16], "chat_output": [max_tokens, max_tokens],
        "rag_input": [32, 64], "rag_output": [max_tokens, max_tokens],
        "first_turn_input": [8, 16], "turn_input": [4, 8], "turns": [2, 2],
        "turn_output": [max_tokens, max_tokens]})
    load = LoadSettings(workload=spec, rates=(math.inf,), num_requests=num_requests,
                        request_timeout_s=timeout_s, progress=False)
    return run_load(Target(base_url=base_url), load)[0]


def settings_json(target: Target, load: LoadSettings) -> dict[str, Any]:
    out = {"target": asdict(target), "load": asdict(load)}
    out["target"].pop("api_key", None)  # never write a secret into a results file
    out["load"]["rates"] = [r if math.isfinite(r) else "inf" for r in load.rates]
    return out


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # inf rates are not JSON; "allow_nan=False" makes any other NaN/inf a loud error.
    path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n", encoding="utf-8")
