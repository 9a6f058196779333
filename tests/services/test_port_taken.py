"""A gRPC service told to listen on a port another process holds exits 1 with one line naming
the address (grpcio raises a RuntimeError with a traceback there), and the transfer bench's
kvd pair starts again on fresh ports when one it picked is taken before the kvd binds it."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from pdserve_bench import transfer_kvds
from tests.e2e.stack import ROOT, child_env


@pytest.fixture
def held_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_a_service_on_a_taken_port_exits_1_with_one_line(held_port: int) -> None:
    proc = subprocess.run([sys.executable, "-m", "services.kvd", "--port", str(held_port),
                           "--capacity-mib", "8", "--metrics-port", "-1"],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        f"pdserve kvd: error: cannot bind 127.0.0.1:{held_port} (in use, or not an address of "
        "this host)")
    assert "Traceback" not in proc.stderr


def test_the_kvd_pair_starts_again_when_a_picked_port_is_taken(
        held_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    picks = iter([[held_port, held_port + 1]])
    real = transfer_kvds._free_ports
    monkeypatch.setattr(transfer_kvds, "_free_ports", lambda n: next(picks, None) or real(n))
    pair = transfer_kvds.kvd_pair(8)
    try:
        ports = [int(addr.rsplit(":", 1)[1]) for _, addr in pair]
        assert held_port not in ports and all(proc.poll() is None for proc, _ in pair)
    finally:
        for proc, _ in pair:
            proc.terminate()
            proc.wait(timeout=30)


def test_a_pair_whose_ports_stay_taken_says_so(held_port: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer_kvds, "_free_ports", lambda n: [held_port, held_port + 1])
    with pytest.raises(RuntimeError) as err:
        transfer_kvds.kvd_pair(8, tries=2)
    assert str(err.value).startswith(
        "kvd pair: a picked port was taken before it bound, 2 times; the last kvd said: ")
    assert f"cannot bind 127.0.0.1:{held_port}" in str(err.value)
