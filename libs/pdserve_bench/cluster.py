"""A pdserve cluster inside one machine: each node a network namespace (``netns``).

    namespace   processes                      binds
    redis       redis-server                   <redis ip>:6379
    p0, p1, ..  kvd + prefill engine           <node ip>:50081 (kvd), :50071 (engine)
    d0, ..      kvd + decode engine            <node ip>:50081, :50071
    front       router + gateway               <front ip>:50051, HTTP :8000

Every service binds its namespace's address (never 0.0.0.0) and reaches the others over the
bridge, so kvd -> kvd bytes cross veth links as between hosts. On one machine UCX would still
reach another namespace through shared memory (same boot id, same /dev/shm), so the kvds
exclude the shared-memory transports (``--ucx-tls ^sm``), as separate hosts would by nature;
which transports UCX then picked is its own report, kvd's ``pdserve_kvd_ucx_lanes``. Being
off loopback, every plane needs its credential: the cluster makes them as ``pdserve up`` does
(``StackSecrets``: each process gets its role's in its environment) and the gateway an API
key. Children die with this process; ``netns.remove_stale`` removes what a crashed run left.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve import auth
from pdserve.env import LOG_FORMAT_VAR, LOG_LEVEL_VAR, REDIS_URL_VAR
from pdserve.procs import Proc, start_redis
from pdserve.proto.v1 import router_pb2, router_pb2_grpc
from pdserve.stack_secrets import StackSecrets
from pdserve_bench.netns import Netns, remove_stale

ROOT = Path(__file__).resolve().parents[2]  # where ``services`` is
REDIS, FRONT = "redis", "front"
KVD_PORT, KVD_METRICS_PORT, ENGINE_PORT = 50081, 9181, 50071
ROUTER_PORT, HTTP_PORT, REDIS_PORT = 50051, 8000, 6379


@dataclass(frozen=True)
class ClusterSpec:
    """The cluster's shape and the settings its faults depend on."""

    model: str = "tiny"
    num_prefill: int = 2
    num_decode: int = 1
    policy: str = "cache_aware"
    kvd_capacity_mib: int = 64
    ucx_tls: str = "^sm"  # network transports only, as between hosts
    ucx_error_handling: bool = True  # as between hosts: a lost peer's endpoint closes at once
    transfer_timeout: float = 3.0  # kvd: a stalled transfer is abandoned after this
    kvd_heartbeat: float = 1.0  # kvd registry record lives 3 heartbeats
    threads: int = 1  # torch threads per engine
    prefill_cpus: tuple[int, ...] = ()  # CPU set every prefill engine is pinned to; () = none
    decode_cpus: tuple[int, ...] = ()
    engine_args: tuple[str, ...] = ()
    kvd_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()

    @property
    def prefill_nodes(self) -> list[str]:
        return [f"p{i}" for i in range(self.num_prefill)]

    @property
    def decode_nodes(self) -> list[str]:
        return [f"d{i}" for i in range(self.num_decode)]


@dataclass
class NetnsCluster:
    """Start with ``start()``, always ``stop()``: it removes every namespace and link."""

    spec: ClusterSpec
    log_dir: Path
    procs: dict[str, Proc] = field(default_factory=dict)
    redis: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.net = Netns([REDIS, FRONT, *self.spec.prefill_nodes, *self.spec.decode_nodes])
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'libs'}",
                    "PYTHONUNBUFFERED": "1", LOG_LEVEL_VAR: "info",
                    LOG_FORMAT_VAR: "text"}  # ``log`` is read back (pool names, UCX lanes)
        self.env.pop(REDIS_URL_VAR, None)
        # Off loopback every plane needs its credential, as pdserve up hands them out: each
        # process gets only its role's, in its environment; the gateway an API key.
        self.secrets = StackSecrets(os.environ)
        self.secrets.set_redis_url(self.secrets.private_redis_url(self.ip(REDIS), REDIS_PORT))
        self.api_key = f"sk-cluster-{secrets.token_hex(16)}"
        self.keys_file = self.secrets.directory / "api-keys"
        self.keys_file.write_text(f"{self.api_key},cluster\n")
        self.keys_file.chmod(0o600)

    # -- addresses -------------------------------------------------------------------------
    @property
    def nodes(self) -> list[str]:
        return [*self.spec.prefill_nodes, *self.spec.decode_nodes]

    def ip(self, node: str) -> str:
        return self.net[node].ip

    @property
    def redis_url(self) -> str:
        return self.secrets.redis_url

    def metadata(self, *creds: auth.Credential) -> tuple[tuple[str, str], ...]:
        """gRPC metadata presenting this stack's ``creds`` (``auth.DATA`` for kvd and engine
        Stats, ``auth.CLIENT`` for the router)."""
        held = {c.name: self.secrets.values[c.var] for c in auth.CREDENTIALS}
        return auth.metadata(creds, held)

    @property
    def data_secret(self) -> str:
        return self.secrets.values[auth.DATA.var]

    @property
    def router_address(self) -> str:
        return f"{self.ip(FRONT)}:{ROUTER_PORT}"

    @property
    def base_url(self) -> str:
        return f"http://{self.ip(FRONT)}:{HTTP_PORT}/v1"

    def kvd_address(self, node: str) -> str:
        return f"{self.ip(node)}:{KVD_PORT}"

    def kvd_node_id(self, node: str) -> str:
        """Unique on the machine (the run's namespace name): kvds of other stacks on this
        host (``pdserve up``'s ``node-p0``...) share /dev/shm, where the pool is named by it."""
        return self.net[node].netns

    def engine_address(self, node: str) -> str:
        return f"{self.ip(node)}:{ENGINE_PORT}"

    def kvd_metrics(self, node: str) -> str:
        """kvd's Prometheus text, fetched over the bridge."""
        url = f"http://{self.ip(node)}:{KVD_METRICS_PORT}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return str(resp.read().decode())

    def log(self, name: str) -> str:
        """The whole log (stderr) of process ``name`` so far, e.g. ``kvd-d0``."""
        path = self.log_dir / f"{name}.log"
        return path.read_text() if path.exists() else ""

    # -- life ------------------------------------------------------------------------------
    def _add(self, name: str, node: str, module: str, port: int, flags: Sequence[str],
             cpus: Sequence[int] = ()) -> Proc:
        args = [*self.net[node].exec_args(), sys.executable, "-m", f"services.{module}",
                "--host", self.ip(node), "--port", str(port), *flags]
        (self.log_dir / f"{name}.log").unlink(missing_ok=True)
        proc = Proc(name, args, port, set(cpus) or None, self.secrets.env_for(module, self.env),
                    log=self.log_dir / f"{name}.log", cwd=ROOT)
        self.procs[name] = proc
        return proc

    def _plan(self) -> list[list[Proc]]:
        """The processes in start order: kvds, then engines, then router, then gateway."""
        s = self.spec  # Redis's URL (and password) reach the services in their environment
        kvds, engines = [], []
        for role, nodes, cpus in (("prefill", s.prefill_nodes, s.prefill_cpus),
                                  ("decode", s.decode_nodes, s.decode_cpus)):
            for node in nodes:
                kvds.append(self._add(f"kvd-{node}", node, "kvd", KVD_PORT, [
                    "--node-id", self.kvd_node_id(node), "--ucx-host", self.ip(node),
                    "--ucx-tls", s.ucx_tls,
                    "--ucx-error-handling", str(s.ucx_error_handling).lower(),
                    "--capacity-mib", str(s.kvd_capacity_mib),
                    "--transfer-timeout", str(s.transfer_timeout),
                    "--heartbeat", str(s.kvd_heartbeat),
                    "--metrics-port", str(KVD_METRICS_PORT), *s.kvd_args]))
                engines.append(self._add(f"{role}-{node}", node, role, ENGINE_PORT, [
                    "--model", s.model, "--role", role, "--instance-id", node,
                    "--kvd", self.kvd_address(node), "--threads", str(s.threads),
                    *s.engine_args], cpus))
        router = self._add("router", FRONT, "router", ROUTER_PORT, [
            "--model", s.model, "--policy", s.policy,
            "--prefill", ",".join(self.engine_address(n) for n in s.prefill_nodes),
            "--decode", ",".join(self.engine_address(n) for n in s.decode_nodes),
            *s.router_args])
        gateway = self._add("gateway", FRONT, "gateway", HTTP_PORT,
                            ["--router", self.router_address, "--grpc-port", "0",
                             "--keys-file", str(self.keys_file)])
        return [kvds, engines, [router], [gateway]]

    def start(self, timeout: float = 180.0) -> NetnsCluster:
        """Namespaces, Redis, then each wave of services started together; RuntimeError (with
        the failing service's last log lines) if one is not ready within ``timeout``."""
        remove_stale()
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found on PATH (apt-get install redis-server)")
        try:
            self.net.create()
            self.redis = start_redis(exe, self.ip(REDIS), REDIS_PORT,
                                     self.secrets.redis_password, self.net[REDIS].exec_args())
            deadline = time.monotonic() + timeout
            for wave in self._plan():
                for proc in wave:
                    proc.start(proc.env)
                for proc in wave:
                    proc.wait_ready(max(1.0, deadline - time.monotonic()))
            self.wait_routable(deadline - time.monotonic())
        except BaseException:
            self.stop()
            raise
        return self

    def cluster_state(self) -> router_pb2.ClusterStateResponse:
        """The router's view: instances with health and counters, index availability."""
        with grpc.insecure_channel(self.router_address) as ch:
            return router_pb2_grpc.RouterStub(ch).ClusterState(
                router_pb2.ClusterStateRequest(), timeout=5, metadata=self.metadata(auth.CLIENT))

    def healthy(self) -> set[str]:
        """Instance ids the router currently routes to."""
        return {i.instance_id for i in self.cluster_state().instances if i.healthy}

    def wait_routable(self, timeout: float, nodes: Sequence[str] | None = None) -> None:
        """Until the router sees the engines of ``nodes`` (default: all live ones) healthy."""
        want = set(nodes if nodes is not None else
                   [n for n in self.nodes if n not in self.net.lost])
        deadline = time.monotonic() + timeout
        while True:
            try:
                if want <= self.healthy():
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router did not see {sorted(want)} healthy in time")
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop every service (all at once: SIGTERM, then SIGKILL after 10 s), Redis, then
        remove namespaces, links and any kvd pool left in /dev/shm."""
        live = [p.popen for p in self.procs.values()
                if p.popen is not None and p.popen.poll() is None]
        for popen in live:
            popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for popen in live:
            try:
                popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
        if self.redis is not None and self.redis.poll() is None:
            self.redis.terminate()
            self.redis.wait(timeout=10)
        self.secrets.remove()
        self.net.close()
        for path in self.pools():  # a killed kvd (node loss) could not unlink its pool
            path.unlink(missing_ok=True)

    def pools(self) -> list[Path]:
        """The shared-memory pool files the kvds created (named in their logs) that exist."""
        names = {m for n in self.nodes for m in re.findall(r"shm=(\S+)", self.log(f"kvd-{n}"))}
        return [Path("/dev/shm", name) for name in sorted(names)
                if Path("/dev/shm", name).exists()]
