"""``pdserve up``'s ports: every service binds its own (``--port 0``), the supervisor reads it
from the ready line and writes it into the flags of the services started after it; a restart
rebinds the same port, and only if that one was taken meanwhile takes a free one, its
dependants' flags following."""

from __future__ import annotations

import socket

from pdserve.procs import Proc
from services.launcher import Stack, _args, build_parser


def _planned() -> tuple[Stack, Proc, Proc]:
    stack = Stack(_args(build_parser().parse_args(["--kvd-capacity-mib", "8", "--port", "0"])))
    stack.redis_url = ""
    stack.plan()
    procs = {p.name: p for p in stack.procs}
    return stack, procs["kvd-p0"], procs["prefill-0"]


def _flag(proc: Proc, name: str) -> str:
    return proc.args[proc.args.index(name) + 1]


def test_every_service_is_planned_on_port_0_and_named_by_a_placeholder() -> None:
    stack, kvd, prefill = _planned()
    assert all(_flag(p, "--port") == "0" for p in stack.procs)
    assert _flag(prefill, "--kvd") == "<kvd-p0>"
    router = next(p for p in stack.procs if p.name == "router")
    assert _flag(router, "--prefill") == "<prefill-0>"
    assert _flag(router, "--decode") == "<decode-0>"
    assert _flag(stack.gateway, "--router") == "<router>"


def test_a_fixed_gateway_port_stays_fixed() -> None:
    stack = Stack(_args(build_parser().parse_args(["--port", "8123"])))
    stack.redis_url = ""
    stack.plan()
    assert _flag(stack.gateway, "--port") == "8123"


def test_the_ready_line_port_reaches_the_dependants_and_a_restart_rebinds_it() -> None:
    stack, kvd, prefill = _planned()
    try:
        stack._start_one(kvd)
        bound = kvd.port
        assert bound > 0 and _flag(kvd, "--port") == str(bound)
        assert _flag(prefill, "--kvd") == f"127.0.0.1:{bound}"
        assert kvd.metrics.startswith("127.0.0.1:")  # /metrics: its own free port, read too
        kvd.stop()
        kvd.start(kvd.env)  # as supervise() restarts it: the same flags, the same port
        stack._await_restart(kvd)
        assert kvd.port == bound and _flag(prefill, "--kvd") == f"127.0.0.1:{bound}"
    finally:
        kvd.stop()
        stack.pidfile.remove()


def test_a_restart_whose_port_was_taken_moves_and_its_dependants_follow() -> None:
    stack, kvd, prefill = _planned()
    try:
        stack._start_one(kvd)
        taken = kvd.port
        kvd.stop()
        with socket.socket() as squatter:  # another process got the port meanwhile
            squatter.bind(("127.0.0.1", taken))
            squatter.listen()
            kvd.start(kvd.env)
            stack._await_restart(kvd)  # reports it did not become ready
            assert kvd.popen is not None and kvd.popen.wait(timeout=10) != 0
            assert stack._rebind_failed(kvd)
            assert _flag(kvd, "--port") == "0"
            kvd.start(kvd.env)
            stack._await_restart(kvd)
        assert kvd.port not in (0, taken)
        assert _flag(kvd, "--port") == str(kvd.port)
        assert _flag(prefill, "--kvd") == f"127.0.0.1:{kvd.port}"
    finally:
        kvd.stop()
        stack.pidfile.remove()


def test_a_service_that_died_otherwise_keeps_its_port() -> None:
    stack, kvd, _ = _planned()
    try:
        stack._start_one(kvd)
        assert kvd.popen is not None
        kvd.popen.kill()
        kvd.popen.wait()
        assert not stack._rebind_failed(kvd)
        assert _flag(kvd, "--port") == str(kvd.port)
    finally:
        kvd.stop()
        stack.pidfile.remove()


def test_an_embedded_router_gets_the_routers_flags_and_follows_the_engines() -> None:
    stack = Stack(_args(build_parser().parse_args(["--port", "0", "--embedded-router"])))
    stack.redis_url = ""
    stack.plan()
    router = next(p for p in stack.procs if p.name == "router")
    assert _flag(stack.gateway, "--router") == "embedded"
    flags = _flag(stack.gateway, "--router-flags").split(" ")
    assert flags == router.args[router.args.index("--model"):router.args.index("--metrics-port")]
    assert "PDSERVE_SECRET" in stack.gateway.env  # it calls the engines as the router does
    prefill = next(p for p in stack.procs if p.name == "prefill-0")
    stack._bound(prefill, 4321)  # the engine's ready line: both routers follow
    assert _flag(router, "--prefill") == "127.0.0.1:4321"
    assert "--prefill 127.0.0.1:4321 " in _flag(stack.gateway, "--router-flags")
    stack.pidfile.remove()
