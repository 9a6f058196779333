"""``pdserve bench faults``: kill each process of a live stack under a steady load and report
what the clients saw: seconds from the kill to the first successful request sent after it,
requests lost (failed) per fault, when the supervisor had it running again, and whether every
kvd and engine was back to nothing pinned and nothing in use.

    pdserve bench faults [--decode 2] [--clients 2] [--faults decode-1,kvd-d0,...]
                         [--warm-up S] [--json]

``--warm-up`` runs the load that long before the first kill: a stack in steady state (each
engine with its warm spare, which ``pdserve up`` starts 10 s apart once the stack is up) rather
than one killed in its first seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass

from pdserve_bench.chaos import ChaosStack

DEFAULT_FAULTS = ("decode-1", "kvd-d0", "prefill-0", "kvd-p0", "redis")


@dataclass
class Sent:
    start: float
    end: float
    ok: bool
    error: str


@dataclass
class FaultRow:
    fault: str
    recovery_s: float  # kill -> first success of a request sent after it
    num_lost: int  # requests in flight at or sent after the kill that failed
    num_sent: int
    restart_s: float  # kill -> the supervisor's new process up
    clean: bool  # nothing pinned / in use on any kvd or engine afterwards
    first_error: str


class Load:
    """``clients`` threads sending one small completion after another."""

    def __init__(self, stack: ChaosStack, clients: int, max_tokens: int) -> None:
        self.stack, self.max_tokens = stack, max_tokens
        self.sent: list[Sent] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            r = self.stack.probe(max_tokens=self.max_tokens, timeout=60)
            self.sent.append(Sent(start, time.monotonic(), r.ok, r.error))
            if not r.ok:
                time.sleep(0.05)


def run_fault(stack: ChaosStack, name: str, load: Load, settle_s: float) -> FaultRow:
    old_pid = stack.children()[name]
    before = len(load.sent)
    killed = time.monotonic()
    stack.kill(name)
    stack.wait_restarted(name, old_pid, timeout=120)
    restart_s = time.monotonic() - killed
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # a success sent after the kill, then settle
        after = [s for s in load.sent[before:] if s.start >= killed and s.ok]
        if after:
            break
        time.sleep(0.1)
    time.sleep(settle_s)
    window = [s for s in load.sent if s.end >= killed]
    firsts = [s.end for s in window if s.ok and s.start >= killed]
    lost = [s for s in window if not s.ok]
    return FaultRow(name, round(min(firsts) - killed, 3) if firsts else float("inf"),
                    len(lost), len(window), round(restart_s, 3), False,
                    lost[0].error[:160] if lost else "")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench faults", description=__doc__.split("\n")[0])
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--clients", type=int, default=2, help="concurrent load clients")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--faults", default=",".join(DEFAULT_FAULTS),
                   help="comma-separated child names to kill -9, in order")
    p.add_argument("--settle", type=float, default=3.0,
                   help="seconds of load after the first success before the next fault")
    p.add_argument("--warm-up", type=float, default=0.0,
                   help="seconds of load before the first fault (0: kill at once)")
    p.add_argument("--json", action="store_true", help="also print one JSON line per fault")
    return p.parse_args(argv)


def children_of(num_prefill: int, num_decode: int) -> list[str]:
    """The children ``pdserve up --prefill P --decode D`` runs, by name."""
    nodes = [(f"kvd-p{i}", f"prefill-{i}") for i in range(num_prefill)]
    nodes += [(f"kvd-d{i}", f"decode-{i}") for i in range(num_decode)]
    return ["redis", *(n for pair in nodes for n in pair), "router", "gateway"]


def main(argv: list[str] | None = None) -> int:
    ns = _args(argv)
    known = children_of(ns.prefill, ns.decode)
    unknown = [n for n in ns.faults.split(",") if n not in known]
    if unknown:
        print(f"pdserve bench faults: error: --faults: no child {unknown[0]!r} in a stack of "
              f"{ns.prefill} prefill + {ns.decode} decode nodes (it runs {', '.join(known)})",
              file=sys.stderr)
        return 2
    rows: list[FaultRow] = []
    args = ["--model", "tiny", "--prefill", str(ns.prefill), "--decode", str(ns.decode),
            "--kvd-capacity-mib", "16"]
    with ChaosStack(args) as stack:
        with Load(stack, ns.clients, ns.max_tokens) as load:
            time.sleep(ns.warm_up)
            for name in ns.faults.split(","):
                rows.append(run_fault(stack, name, load, ns.settle))
        idle = stack.wait_idle()  # the load has stopped: everything released?
        counted = [n for n in stack.addresses if n.startswith(("kvd-", "prefill-", "decode-"))]
    for row in rows:
        row.clean = all(n in idle and not any(idle[n]) for n in counted)
    _print(rows, ns)
    return 0


def _print(rows: list[FaultRow], ns: argparse.Namespace) -> None:
    print(f"kill -9 under load: {ns.clients} clients, {ns.max_tokens}-token completions, "
          f"tiny model, {ns.prefill} prefill + {ns.decode} decode nodes, "
          f"first kill after {ns.warm_up:g} s of load")
    print(f"{'fault':<11}{'recovery s':>11}{'lost':>6}{'sent':>6}{'restart s':>11}  first error")
    for r in rows:
        print(f"{r.fault:<11}{r.recovery_s:>11.2f}{r.num_lost:>6}{r.num_sent:>6}"
              f"{r.restart_s:>11.2f}  {r.first_error[:70]}")
    clean = all(r.clean for r in rows)
    print(f"clean afterwards: {'yes' if clean else 'NO'} (kvds: nothing pinned, in flight or "
          "being written; engines: nothing queued, running or holding KV blocks)")
    if ns.json:
        for r in rows:
            print(json.dumps({"bench": "faults", **asdict(r)}))
