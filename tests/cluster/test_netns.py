"""The namespace harness cleans up after itself, also after its owner was killed (SIGKILL):
children die with it, and the next run's ``remove_stale`` deletes what is left."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from pdserve_bench import netns
from pdserve_bench.netns import Netns, remove_stale
from tests.cluster.conftest import eventually

ROOT = Path(__file__).resolve().parents[2]

# The owner: two nodes; a supervised child in one (it must die with the owner) and a process
# started in the other behind the harness's back (it outlives the owner: remove_stale's job).
_OWNER = """
import os, subprocess, sys, time
from pdserve_bench.netns import Netns
from pdserve.procs import Proc
net = Netns(["a", "b"])
net.create()
child = Proc("child", [*net["a"].exec_args(), sys.executable, "-c",
                       "import time; print('pdserve child listening on x:1', flush=True); "
                       "time.sleep(120)"], 1)
child.start(dict(os.environ))
child.wait_ready(30)
stray = subprocess.Popen([*net["b"].exec_args(), "sleep", "120"], start_new_session=True)
print(net.owner, child.popen.pid, stray.pid, flush=True)
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # dead, not yet reaped by its new parent


def test_a_killed_run_leaves_nothing_behind_the_next_cleanup() -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'libs'}"}
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], env=env, cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    pid, child, stray = map(int, owner.stdout.readline().split())
    prefix = f"{netns.PREFIX}{pid}"
    assert {f"{prefix}-a", f"{prefix}-b"} <= set(netns._netns_names())
    assert f"{prefix}br" in netns._link_names()
    owner.kill()  # no cleanup code of its own runs
    owner.wait()
    eventually(lambda: _gone(child), 5, "the supervised child dying with its owner")
    assert not _gone(stray)
    removed = remove_stale()
    assert {f"{prefix}-a", f"{prefix}-b", f"{prefix}br"} <= set(removed)
    mine = [n for n in [*netns._netns_names(), *netns._link_names()] if n.startswith(prefix)]
    assert mine == []
    eventually(lambda: _gone(stray), 5, "the stray process killed with its namespace")


def test_close_removes_everything_and_live_runs_are_not_stale() -> None:
    net = Netns(["x"])
    net.create()
    try:
        assert net.leftovers()
        remove_stale()  # this run's owner is alive: nothing of it is stale
        assert sorted(net.leftovers()) == sorted([net.bridge, net["x"].veth, net["x"].netns])
    finally:
        net.close()
    time.sleep(0.1)
    assert net.leftovers() == []


def test_bench_cluster_transfer_moves_every_path_over_tcp(tmp_path: Path) -> None:
    """``pdserve bench cluster``'s transfer part, tiny batches: every path delivers, UCX says
    TCP on the namespace's link; nothing of the run is left behind."""
    from pdserve_bench.cluster_bench import run_transfer

    result = run_transfer([1, 4], True, tmp_path)
    assert result["ucx_lanes"] == ["tcp/eth0"]
    assert [r["batch_bytes"] for r in result["rows"]] == [1 << 20, 4 << 20]
    for row in result["rows"]:
        for key in ("ucx_gbps", "grpc_gbps", "kvd_gbps", "e2e_gbps"):
            assert row[key] > 0, (key, row)
    assert [n for n in netns._netns_names() if n.startswith(f"{netns.PREFIX}{os.getpid()}-")] == []
