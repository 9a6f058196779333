"""Nodes of a test cluster as Linux network namespaces on one bridge (root only).

    host namespace (this process: the tests, the benchmark client)
      pdcl<pid>br  bridge, 10.220.X.1/24        X: a /24 no host route uses yet
       ├── pdcl<pid>v0 ══ veth ══ eth0 10.220.X.10   namespace pdcl<pid>-<node 0>
       ├── pdcl<pid>v1 ══ veth ══ eth0 10.220.X.11   namespace pdcl<pid>-<node 1>
       └── ...

Every name carries the owning process's pid, so concurrent runs never touch each other's
namespaces or links, and ``remove_stale`` can clean up after a run that died (its pid is gone):
it kills the processes left in those namespaces and deletes them and their links. Faults:
``link_down``/``link_up`` (a partition: the node's cable pulled; TCP connections stall, nothing
is reset), ``blackhole``/``unblackhole`` (one node loses its route to one address), ``destroy``
(node loss: its processes killed, its namespace and link deleted).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.procs import pid_alive

PREFIX = "pdcl"
SUBNET_BASE = "10.220"
NODE_DEVICE = "eth0"  # each node's end of its link, inside its namespace
_OWNED = re.compile(rf"^{PREFIX}(\d+)(?:-|br$|v\d+$|pb$)")


class NetnsError(RuntimeError):
    """An ``ip`` command failed; the message has the command and its stderr."""


def ip(*args: str, check: bool = True) -> str:
    """Run ``ip <args>``; its stdout (NetnsError on failure when ``check``)."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (None: they can): not root, no iproute2, or the
    kernel/container refuses a namespace or a bridge (a probe of each, removed at once)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run as root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}pb"
    try:
        ip("netns", "add", probe)
        ip("netns", "del", probe)
        ip("link", "add", probe, "type", "bridge")
        ip("link", "del", probe)
    except (NetnsError, OSError, subprocess.TimeoutExpired) as exc:
        ip("netns", "del", probe, check=False)
        ip("link", "del", probe, check=False)
        return f"cannot create a network namespace and a bridge here: {exc}"
    return None



def _kill_netns_processes(netns: str) -> None:
    """SIGKILL every process in ``netns`` and wait until none is left (5 s at most)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pids = [int(p) for p in ip("netns", "pids", netns, check=False).split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _netns_names() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list", check=False).splitlines() if line]


def _link_names() -> list[str]:
    out = ip("-o", "link", "show", check=False)
    return [line.split(": ")[1].split("@")[0] for line in out.splitlines() if ": " in line]


def remove_stale() -> list[str]:
    """Delete the namespaces and links of runs whose owner process is gone; their names."""
    removed = []
    for name in _netns_names():
        m = _OWNED.match(name)
        if m and not pid_alive(int(m.group(1))):
            _kill_netns_processes(name)
            ip("netns", "del", name, check=False)
            removed.append(name)
    for name in _link_names():
        m = _OWNED.match(name)
        if m and not pid_alive(int(m.group(1))):
            ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def _free_subnet(start: int) -> str:
    """A ``10.220.X`` /24 that no route of this host's namespace uses."""
    used = ip("-4", "route", "show", "table", "all", check=False)
    for i in range(256):
        candidate = f"{SUBNET_BASE}.{(start + i) % 256}"
        if f"{candidate}." not in used:
            return candidate
    raise NetnsError(f"no free /24 under {SUBNET_BASE}.0.0/16")


@dataclass(frozen=True)
class NetNode:
    """One node: its name in the cluster, its namespace, the host end of its link, its IP."""

    name: str
    netns: str
    veth: str
    ip: str

    def exec_args(self) -> list[str]:
        """Prefix that runs a command inside this node's namespace."""
        return ["ip", "netns", "exec", self.netns]


class Netns:
    """The namespaces, links and bridge of one run; ``close`` removes every one of them."""

    def __init__(self, names: Sequence[str]) -> None:
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"names: must be distinct and non-empty, got {list(names)}")
        self.owner = os.getpid()
        self.bridge = f"{PREFIX}{self.owner}br"
        self.subnet = _free_subnet(self.owner % 256)
        self.host_ip = f"{self.subnet}.1"
        self.nodes = {name: NetNode(name, f"{PREFIX}{self.owner}-{name}",
                                    f"{PREFIX}{self.owner}v{i}", f"{self.subnet}.{10 + i}")
                      for i, name in enumerate(names)}
        self.lost: set[str] = set()

    def __getitem__(self, name: str) -> NetNode:
        return self.nodes[name]

    def create(self) -> None:
        """Bridge with the host's address, then one namespace + veth per node (loopback up)."""
        try:
            # A fixed MAC: a bridge that picks its ports' lowest changes it when a port goes
            # (node loss), and every namespace's ARP entry for the host then points nowhere
            # for ~30 s: the host's connections to the survivors hang.
            mac = f"02:70:{':'.join(f'{b:02x}' for b in self.owner.to_bytes(4, 'big'))}"
            ip("link", "add", self.bridge, "address", mac, "type", "bridge")
            ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for node in self.nodes.values():
                ip("netns", "add", node.netns)
                ip("link", "add", node.veth, "type", "veth", "peer", "name", NODE_DEVICE,
                   "netns", node.netns)
                ip("link", "set", node.veth, "master", self.bridge, "up")
                ip("-n", node.netns, "addr", "add", f"{node.ip}/24", "dev", NODE_DEVICE)
                ip("-n", node.netns, "link", "set", NODE_DEVICE, "up")
                ip("-n", node.netns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def link_down(self, name: str) -> None:
        """Partition ``name``: its link stops carrying frames (nothing is reset)."""
        ip("link", "set", self.nodes[name].veth, "down")

    def link_up(self, name: str) -> None:
        ip("link", "set", self.nodes[name].veth, "up")

    def blackhole(self, name: str, address: str) -> None:
        """``name`` silently drops everything it sends to ``address`` (the rest flows)."""
        ip("-n", self.nodes[name].netns, "route", "add", "blackhole", f"{address}/32")

    def unblackhole(self, name: str, address: str) -> None:
        ip("-n", self.nodes[name].netns, "route", "del", "blackhole", f"{address}/32")

    def destroy(self, name: str) -> None:
        """Node loss: every process in the namespace killed, namespace and link deleted."""
        node = self.nodes[name]
        self.lost.add(name)
        _kill_netns_processes(node.netns)
        ip("link", "del", node.veth, check=False)
        ip("netns", "del", node.netns, check=False)

    def close(self) -> None:
        """Remove everything this run created (idempotent; safe after a partial create)."""
        for node in self.nodes.values():
            if node.netns in _netns_names():
                _kill_netns_processes(node.netns)
            ip("link", "del", node.veth, check=False)
            ip("netns", "del", node.netns, check=False)
        ip("link", "del", self.bridge, check=False)

    def leftovers(self) -> list[str]:
        """Namespaces and links of this run that still exist (empty after ``close``)."""
        mine = re.compile(rf"^{PREFIX}{self.owner}(?:-|br$|v\d+$)")
        return [n for n in [*_netns_names(), *_link_names()] if mine.match(n)]
