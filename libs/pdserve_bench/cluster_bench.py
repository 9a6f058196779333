"""``pdserve bench cluster [--json] [--quick] [--only transfer|serving]``: the cross-node
numbers, with nodes as network namespaces joined by veth links and a bridge (root only).

transfer -- two nodes a and b; in one run, the same bytes moved from a to b by
  (a) raw ucxx over TCP (a sender in a, a receiver in b), timed until b's acknowledgement:
      the ceiling;
  (b) kvd -> kvd: Commit with push on a's kvd until every block is present at b's;
  (c) the engine path: write slots on a, Commit+push, Await on b, read them, Release;
  (d) a gRPC byte stream, 1 MiB messages (a source in a, a sink in b).
  Batches of 1, 64 and 256 blocks of 1 MiB (``--quick``: 1, 16, 64); GB/s, medians.
serving -- 2 prefill nodes + 1 decode node (``bench-50m``, prefills on CPU 0, decode on CPU 1),
  seeded multi-turn chats at one rate, round_robin then cache_aware: TTFT, the prefix hit rate
  and the KV bytes that crossed to the decode node.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pdserve import auth
from pdserve.cpuinfo import cpu_flags, cpu_model
from pdserve.env import LOG_LEVEL_VAR, SECRET_VAR
from pdserve.kvd.client import KvdClient
from pdserve.procs import Proc, child_argv
from pdserve.proto.v1 import common_pb2
from pdserve_bench.cluster import ROOT, ClusterSpec, NetnsCluster
from pdserve_bench.compare import router_counters, with_hit_rate
from pdserve_bench.netns import NODE_DEVICE, NetNode, Netns, remove_stale, unavailable_reason
from pdserve_bench.runner import LoadSettings, Target, run_load_async
from pdserve_bench.serve import token_counter
from pdserve_bench.transfer import LAYOUT, MIB, KvdPair
from pdserve_bench.workload import PromptMaker, WorkloadSpec

KVD_PORT, METRICS_PORT = 50081, 9181
MULTITURN = {"turns": [3, 5], "first_turn_input": [128, 256], "turn_input": [16, 48],
             "turn_output": [16, 32]}  # bench/configs/default.toml's multiturn


def _env(secret: str = "") -> dict[str, str]:
    out = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'libs'}", "PYTHONUNBUFFERED": "1",
           LOG_LEVEL_VAR: "info"}
    if secret:  # the data-plane credential a kvd off loopback requires, never on a flag
        out[SECRET_VAR] = secret
    return out


def _peer(node: NetNode, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(child_argv([*node.exec_args(), sys.executable, "-m",
                                        "pdserve_bench.cluster_peers", *args]), cwd=ROOT,
                            env=_env(), stdout=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen[str], timeout: float = 600) -> dict[int, float]:
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
    return {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}


def lanes(metrics_text: str) -> list[str]:
    """``transport/device`` of every UCX lane kvd reports (``pdserve_kvd_ucx_lanes``)."""
    return sorted({s.labels["transport"] for fam in text_string_to_metric_families(metrics_text)
                   for s in fam.samples if s.name == "pdserve_kvd_ucx_lanes"})


def _kvd(node: NetNode, peer: NetNode, capacity_mib: int, log_dir: Path, secret: str) -> Proc:
    """A kvd in ``node`` that may ship to and from ``peer``'s (no Redis registry here)."""
    proc = Proc(f"kvd-{node.name}", [
        *node.exec_args(), sys.executable, "-m", "services.kvd", "--host", node.ip,
        "--port", str(KVD_PORT), "--node-id", node.netns, "--ucx-host", node.ip,
        "--ucx-tls", "^sm", "--ucx-error-handling", "true", "--capacity-mib",
        str(capacity_mib), "--metrics-port", str(METRICS_PORT),
        "--peers", f"{peer.ip}:{KVD_PORT}"], KVD_PORT,
        log=log_dir / f"kvd-{node.name}.log", cwd=ROOT)
    proc.start(_env(secret))
    return proc


async def _kvd_rows(a: str, b: str, b_id: str, sizes: list[int], quick: bool, secret: str
                    ) -> dict[int, dict[str, float]]:
    import torch

    ca, cb = KvdClient(a, "bench-a", secret=secret), KvdClient(b, "bench-b", secret=secret)
    try:
        await ca.register(LAYOUT)
        await cb.register(LAYOUT)
        pair = KvdPair(ca, cb, common_pb2.KvdEndpoint(node_id=b_id, address=b))
        await pair.kvd_once(1)  # endpoints, channels
        out = torch.empty(LAYOUT.shape, dtype=torch.bfloat16)
        rows = {}
        for n in sizes:
            reps = 20 if n == 1 else (3 if quick or n >= 256 else 5)
            kvd = [await pair.kvd_once(n) for _ in range(reps)]
            e2e = [await pair.e2e_once(n, out) for _ in range(reps)]
            rows[n] = {"kvd_gbps": n * MIB / statistics.median(kvd) / 1e9,
                       "kvd_best_gbps": n * MIB / min(kvd) / 1e9,
                       "e2e_gbps": n * MIB / statistics.median(e2e) / 1e9,
                       "kvd_latency_ms": statistics.median(kvd) * 1e3}
        return rows
    finally:
        await ca.close()
        await cb.close()


def run_transfer(sizes: list[int], quick: bool, log_dir: Path) -> dict[str, Any]:
    """Every path of the module docstring over the same a -> b link, one after the other."""
    remove_stale()
    log_dir.mkdir(parents=True, exist_ok=True)
    net = Netns(["a", "b"])
    net.create()
    procs: list[subprocess.Popen[str]] = []
    kvds: list[Proc] = []
    reps = "3" if quick else "5"
    spec = ",".join(map(str, sizes))
    try:
        a, b = net["a"], net["b"]
        recv = _peer(b, "ucx-recv", NODE_DEVICE, spec, reps)
        procs.append(recv)
        assert recv.stdout is not None
        ucx = _result(_peer(a, "ucx-send", recv.stdout.readline().strip(), NODE_DEVICE, spec,
                            reps))
        sink = _peer(b, "grpc-sink", b.ip)
        procs.append(sink)
        assert sink.stdout is not None
        sink_address = sink.stdout.readline().split("listening on ")[1].strip()
        grpc = _result(_peer(a, "grpc-source", sink_address, spec, reps))
        secret = secrets.token_urlsafe(32)
        kvds = [_kvd(n, m, 2 * max(sizes) + 64, log_dir, secret) for n, m in ((a, b), (b, a))]
        for k in kvds:
            k.wait_ready(120)
        kvd = asyncio.run(_kvd_rows(f"{a.ip}:{KVD_PORT}", f"{b.ip}:{KVD_PORT}", b.netns, sizes,
                                    quick, secret))
        from urllib.request import urlopen

        with urlopen(f"http://{a.ip}:{METRICS_PORT}/metrics", timeout=5) as resp:
            used = lanes(resp.read().decode())
    finally:
        for k in kvds:
            k.stop()
        for p in procs:
            p.kill()
            p.wait()
        net.close()
    rows = [{"batch_bytes": n * MIB, "ucx_gbps": ucx[n], "grpc_gbps": grpc[n], **kvd[n]}
            for n in sizes]
    return {"ucx_lanes": used, "rows": rows}


def run_serving(rate: float, num_requests: int, model: str, log_dir: Path
                ) -> list[dict[str, Any]]:
    """round_robin, then cache_aware, each on a fresh cluster: the same seeded chats."""
    cpus = os.sched_getaffinity(0)
    pin = {0, 1} <= cpus
    load = LoadSettings(workload=WorkloadSpec.from_mapping("multiturn", MULTITURN),
                        rates=(rate,), seed=0, num_requests=num_requests,
                        request_timeout_s=180.0, slo_ttft_ms=2000.0, slo_tpot_ms=200.0,
                        warmup_requests=2, progress=False)
    maker = PromptMaker(token_counter(model))
    out = []
    for policy in ("round_robin", "cache_aware"):
        spec = ClusterSpec(model=model, num_prefill=2, num_decode=1, policy=policy,
                           kvd_capacity_mib=512, prefill_cpus=(0,) if pin else (),
                           decode_cpus=(1,) if pin else ())
        print(f"== serving: {policy}", file=sys.stderr, flush=True)
        cluster = NetnsCluster(spec, log_dir / policy).start(600)
        try:
            out.append(asyncio.run(_drive(cluster, load, maker)) | {"policy": policy})
        finally:
            cluster.stop()
    return out


async def _drive(cluster: NetnsCluster, load: LoadSettings, maker: PromptMaker
                 ) -> dict[str, Any]:
    target = Target(base_url=cluster.base_url, api="chat", continuous_usage=True,
                    api_key=cluster.api_key)
    creds = cluster.metadata(auth.CLIENT)
    before = await router_counters(cluster.router_address, creds)
    bytes_before = _bytes_in(cluster, "d0")
    (run,) = await run_load_async(target, load, maker)
    after = await router_counters(cluster.router_address, creds)
    run = with_hit_rate(run, before, after)
    flat = run.summary.flat()
    return {"rate": run.rate, **{k: flat[k] for k in (
        "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p99_ms",
        "throughput_rps", "errors", "num_requests")},
        "prefix_hit_rate": run.summary.extra.get("prefix_hit_rate"),
        "kv_mib_to_decode_node": (_bytes_in(cluster, "d0") - bytes_before) / MIB,
        "ucx_lanes": lanes(cluster.kvd_metrics("d0"))}


def _bytes_in(cluster: NetnsCluster, node: str) -> float:
    for fam in text_string_to_metric_families(cluster.kvd_metrics(node)):
        for s in fam.samples:
            if s.name == "pdserve_kvd_bytes_in_total":
                return float(s.value)
    return 0.0


def hardware() -> dict[str, Any]:
    """What the numbers ran on: CPU model and the flags that matter, cores, the link."""
    flags = cpu_flags()
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "avx2": "avx2" in flags,
            "avx512f": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "amx": any(f.startswith("amx") for f in flags),
            "link": "veth pairs on a Linux bridge (MTU 1500), no RDMA"}


def _print_transfer(result: dict[str, Any]) -> None:
    print(f"UCX lanes kvd a -> b: {', '.join(result['ucx_lanes']) or 'none reported'}")
    print(f"{'batch':>8} {'ucxx':>8} {'kvd':>8} {'kvd best':>8} {'engine':>8} {'grpc':>8} "
          f"{'kvd lat':>10} {'kvd/ucxx':>9} {'kvd/grpc':>9}")
    for r in result["rows"]:
        print(f"{r['batch_bytes'] // MIB:>5}MiB {r['ucx_gbps']:>8.2f} {r['kvd_gbps']:>8.2f} "
              f"{r['kvd_best_gbps']:>8.2f} {r['e2e_gbps']:>8.2f} {r['grpc_gbps']:>8.2f} "
              f"{r['kvd_latency_ms']:>8.2f}ms {r['kvd_gbps'] / r['ucx_gbps']:>9.2f} "
              f"{r['kvd_gbps'] / r['grpc_gbps']:>9.2f}")
    print("(GB/s, medians; a -> b across the bridge; engine = write slots -> read on b)")


def _print_serving(rows: list[dict[str, Any]]) -> None:
    print(f"{'policy':>12} {'rate':>5} {'ttft p50':>9} {'ttft p90':>9} {'ttft p99':>9} "
          f"{'hit rate':>9} {'KV MiB to d0':>13} {'errors':>7}")
    for r in rows:
        hit = r["prefix_hit_rate"]
        print(f"{r['policy']:>12} {r['rate']:>5g} {r['ttft_p50_ms']:>9.1f} "
              f"{r['ttft_p90_ms']:>9.1f} {r['ttft_p99_ms']:>9.1f} "
              f"{'-' if hit is None else f'{hit:.3f}':>9} {r['kv_mib_to_decode_node']:>13.1f} "
              f"{r['errors']:>7}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench cluster", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="also print the results as JSON")
    ap.add_argument("--quick", action="store_true", help="smaller batches, fewer requests")
    ap.add_argument("--only", choices=["transfer", "serving"], help="one part only")
    ap.add_argument("--rate", type=float, default=1.0, help="serving: requests/s")
    ap.add_argument("--num-requests", type=int, default=0,
                    help="serving: requests per policy (default 30, --quick 12)")
    ap.add_argument("--model", default="bench-50m", help="serving: the model")
    ap.add_argument("--log-dir", default="", help="service logs (default: a temp dir)")
    ap.add_argument("--skip-unavailable", action="store_true",
                    help="without namespaces (not root...), say why and exit 0 (make bench)")
    args = ap.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        print(f"pdserve bench cluster: {'skipped' if args.skip_unavailable else 'error'}: "
              f"{reason}", file=sys.stderr)
        return 0 if args.skip_unavailable else 2
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-bench-cluster-"))
    result: dict[str, Any] = {"hardware": hardware()}
    print(f"hardware: {json.dumps(result['hardware'])}\nlogs: {log_dir}", flush=True)
    if args.only in (None, "transfer"):
        result["transfer"] = run_transfer([1, 16, 64] if args.quick else [1, 64, 256],
                                          args.quick, log_dir / "transfer")
        _print_transfer(result["transfer"])
    if args.only in (None, "serving"):
        num = args.num_requests or (12 if args.quick else 30)
        result["serving"] = run_serving(args.rate, num, args.model, log_dir / "serving")
        _print_serving(result["serving"])
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
