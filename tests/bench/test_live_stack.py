"""One short real run: `pdserve up` (tiny model, one colocated engine) driven by the bench
client through the gateway (HTTP) and the router (gRPC)."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

from pdserve_bench.client import HttpClient, StreamRecord
from pdserve_bench.compare import router_counters
from pdserve_bench.configs import RunConfig
from pdserve_bench.runner import LoadSettings, Target, run_load
from pdserve_bench.stack import StackProcess
from pdserve_bench.workload import WorkloadSpec
from tests.bench.helpers import check_smoke_run


def test_short_run_against_pdserve_up(tmp_path: Path) -> None:
    argv = [*RunConfig().launcher_argv(), "--model", "tiny", "--colocated", "--decode", "1",
            "--port", "0"]
    with StackProcess("live", argv, env={}, log_path=tmp_path / "up.log",
                      ready_timeout_s=240) as info:
        check_smoke_run(info.base_url, num_requests=4, max_tokens=8)
        # Every token is counted (and timed) through the gateway, also those whose text the
        # detokenizer held back (the random model's byte tokens split UTF-8 characters): the
        # gateway's continuous usage says how many tokens each chunk carries.
        records = asyncio.run(_stream_through_gateway(info.base_url, 4, 48))
        assert [sum(n for _, n in r.events) for r in records] == [48] * 4
        assert any(n > 1 for r in records for _, n in r.events)  # some text was held back
        assert info.router is not None
        spec = WorkloadSpec.from_mapping("multiturn", {
            "turns": [2, 2], "first_turn_input": [40, 40], "turn_input": [8, 8],
            "turn_output": [4, 4]})
        load = LoadSettings(workload=spec, rates=(math.inf,), num_requests=4, progress=False,
                            request_timeout_s=60)
        assert info.router_credentials  # pdserve up protects its router; the bench presents
        (run,) = run_load(Target(router=info.router, router_credentials=info.router_credentials),
                          load)
        assert run.summary.num_errors == 0 and run.summary.num_ok == 4
        counters = asyncio.run(router_counters(info.router, info.router_credentials))
        assert counters["prompt_blocks"] > 0


async def _stream_through_gateway(base_url: str, num: int, max_tokens: int
                                  ) -> list[StreamRecord]:
    client = HttpClient(base_url, continuous_usage=True)
    try:
        await client.resolve_model()
        records = [StreamRecord(start=time.perf_counter()) for _ in range(num)]
        await asyncio.gather(*(
            client.stream([{"role": "user", "content": f"tell me story {i}"}], "", max_tokens, r)
            for i, r in enumerate(records)))
    finally:
        await client.close()
    assert all(r.error is None and r.completion_tokens == max_tokens for r in records)
    return records
