"""Issue 18 end to end, on a real ``pdserve up`` stack: one request is one trace across the
five services (an in-memory OTLP receiver collects them), every documented metric shows up on
its service after one request, and a cancelled stream logs no context error."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.conftest import free_port
from tests.e2e.stack import ROOT, UpStack, wait_until

DOC = ROOT / "docs" / "observability.md"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector keeping every span it is sent (with its service)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,  # noqa: N802
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            for rs in request.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes
                               if a.key == "service.name")
                self.spans += [(service, span) for ss in rs.scope_spans for span in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, str]]:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    sink = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield sink, f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture(scope="module")
def stack(receiver: tuple[Receiver, str], tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[UpStack]:
    logs = tmp_path_factory.mktemp("logs")
    up = UpStack(["--model", "tiny", "--prefill", "1", "--decode", "1", "--no-restart",
                  "--otel-endpoint", receiver[1], "--log-dir", str(logs),
                  "--prometheus-config", str(logs / "prometheus.yml")],
                 env={"OTEL_BSP_SCHEDULE_DELAY": "200", "PDSERVE_UP_VERBOSE": "1"}).start()
    yield up
    up.stop()


def _client(stack: UpStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=60)


def test_one_request_is_one_trace_across_the_five_services(
        stack: UpStack, receiver: tuple[Receiver, str]) -> None:
    sink, _ = receiver
    prompt = "A prompt long enough to fill some KV blocks on the way, " * 3
    resp = _client(stack).chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=6)
    rid = resp.headers["x-request-id"]

    def trace_of_request() -> dict[str, list[tuple[str, object]]] | None:
        with sink.lock:
            spans = list(sink.spans)
        root = next((s for _, s in spans if any(a.key == "pdserve.request_id"
                                                and a.value.string_value == rid
                                                for a in s.attributes)), None)
        if root is None:
            return None
        mine = [(svc, s) for svc, s in spans if s.trace_id == root.trace_id]
        names = {s.name for _, s in mine}
        needed = {"Router.Generate", "Prefill.Prefill", "Decode.Decode", "Kvd.Commit",
                  "Kvd.Await", "Kvd.Transfer", "kvd.send", "kvd.receive", "Kvd.Allocate",
                  "Kvd.Release"}
        return {"spans": mine} if needed <= names else None

    found = wait_until(trace_of_request, timeout=45, interval=0.5)
    spans = found["spans"]
    by_id = {s.span_id: (svc, s) for svc, s in spans}
    services = {svc for svc, _ in spans}
    assert {"pdserve-gateway", "pdserve-router", "pdserve-prefill", "pdserve-decode",
            "pdserve-kvd"} <= services

    def parents(name: str) -> set[str]:
        return {by_id[s.parent_span_id][1].name for _, s in spans  # type: ignore[attr-defined]
                if s.name == name}

    assert parents("Router.Generate") == {"POST /v1/chat/completions"}
    assert parents("Prefill.Prefill") == {"Router.Generate"}
    assert parents("Decode.Decode") == {"Router.Generate"}
    # The prefill commits the prompt's blocks (and pushes them); the decode commits the
    # answer's blocks to its own kvd as they fill (kept for the next turn).
    assert "Prefill.Prefill" in parents("Kvd.Commit")
    assert parents("Kvd.Commit") <= {"Prefill.Prefill", "Decode.Decode"}
    assert parents("kvd.send") == {"Kvd.Commit"}
    assert parents("Kvd.Transfer") == {"Kvd.Commit"}  # on the decode node, pushed to
    assert parents("Kvd.Await") == {"Decode.Decode"}
    # answered as they are read (no task of their own), in the caller's trace all the same;
    # the decode's Release goes out after its copy, not waited for, still under its request
    assert "Prefill.Prefill" in parents("Kvd.Allocate")
    assert parents("Kvd.Release") == {"Decode.Decode"}
    send = next(s for _, s in spans if s.name == "kvd.send")
    attrs = {a.key: a.value.int_value for a in send.attributes}
    assert attrs["pdserve.kvd.blocks"] > 0 and attrs["pdserve.kvd.bytes"] > 0
    kvd_nodes = {dict((a.key, a.value.string_value) for a in s.attributes).get(
        "pdserve.kvd.peer") for _, s in spans if s.name in ("kvd.send", "kvd.receive")}
    assert len(kvd_nodes) == 2  # each node names the other: both kvds traced


def _documented() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for service, name in re.findall(r"^\| (\w+) \| `(pdserve_\w+)` \|", DOC.read_text(), re.M):
        out.setdefault(service, set()).add(name)
    return out


def test_every_documented_metric_is_served_by_its_service(stack: UpStack) -> None:
    _client(stack).completions.create(model="tiny", prompt="metrics " * 40, max_tokens=4)
    documented = _documented()
    assert set(documented) == {"gateway", "router", "prefill", "decode", "kvd"}
    endpoints = {"gateway": f"{stack.base_url.removesuffix('/v1')}/metrics",
                 "router": f"http://{stack.metrics['router']}/metrics",
                 "prefill": f"http://{stack.metrics['prefill-0']}/metrics",
                 "decode": f"http://{stack.metrics['decode-0']}/metrics",
                 "kvd": f"http://{stack.metrics['kvd-p0']}/metrics"}
    for service, names in documented.items():
        text = httpx.get(endpoints[service], timeout=10).text
        served = set(re.findall(r"^(?:# TYPE )?(pdserve_\w+?)(?:_bucket|_count|_sum|_created)?"
                                r"[{ ]", text, re.M))
        assert names <= served, (service, names - served)
    engine = httpx.get(endpoints["decode"], timeout=10).text
    series = [line for line in engine.splitlines()
              if line.startswith("pdserve_engine_requests_total{")]
    assert series and all('instance="d0"' in s and 'role="decode"' in s and 'model="tiny"' in s
                          for s in series)


def test_the_prometheus_config_names_the_ports_the_services_bound(stack: UpStack) -> None:
    """Every service bound its own (free) ports; the scrape config names what each printed,
    and every target serves /metrics."""
    config = (Path(stack.log_dir) / "prometheus.yml").read_text()
    targets = re.findall(r"targets: \['([^']+)'\]", config)
    printed = [address.removesuffix("/metrics") for address in stack.metrics.values()]
    assert sorted(targets) == sorted(printed) and len(targets) == 6, config  # gateway's: HTTP
    for target in targets:
        assert "# TYPE" in httpx.get(f"http://{target}/metrics", timeout=10).text


def test_cancelled_streams_log_no_context_error(stack: UpStack) -> None:
    """Streams the client abandons: no service logs OpenTelemetry's context-detach error
    (the stack streams its services' logs: PDSERVE_UP_VERBOSE, as --verbose)."""
    client = _client(stack)
    for _ in range(3):
        stream = client.completions.create(model="tiny", prompt="cancel me", stream=True,
                                           max_tokens=400, extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
    client.completions.create(model="tiny", prompt="and one to the end", max_tokens=8)
    time.sleep(3.0)
    logs = "\n".join(stack.lines)
    assert "[decode-0]" in logs and "[router]" in logs  # the services' logs are here
    assert "Failed to detach context" not in logs


def test_the_printed_examples_run_as_printed(stack: UpStack) -> None:
    """The commands ``pdserve up`` prints under "Try it" work pasted into a shell whose PATH
    has no virtual environment on it (the banner names its own interpreter)."""
    start = next(i for i, line in enumerate(stack.lines) if line.startswith("Try it"))
    end = next(i for i, line in enumerate(stack.lines) if line.startswith("pdserve ready"))
    commands, current = [], ""
    for line in stack.lines[start + 1:end]:
        if not line.strip():
            continue
        current += line.strip()[:-1] + " " if line.endswith("\\") else line.strip()
        if not line.endswith("\\"):
            commands.append(current)
            current = ""
    assert len(commands) == 3, commands
    shell_env = {"PATH": "/usr/bin:/bin", "HOME": str(ROOT)}
    for command in commands:
        proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                              timeout=120, env=shell_env, cwd="/")
        assert proc.returncode == 0, (command, proc.stderr[-2000:])
        assert proc.stdout.strip(), command
