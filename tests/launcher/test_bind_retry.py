"""``pdserve up``'s bind retry: a port taken between being picked and being bound is replaced
by a fresh one, and the flags that name the service follow it."""

from __future__ import annotations

import socket

from services.launcher import Stack, _args, build_parser


def test_a_taken_port_is_replaced_and_dependents_follow() -> None:
    stack = Stack(_args(build_parser().parse_args(["--kvd-capacity-mib", "8"])))
    stack.redis_url = ""
    stack.plan()
    kvd = next(p for p in stack.procs if p.name == "kvd-p0")
    prefill = next(p for p in stack.procs if p.name == "prefill-0")
    taken = kvd.port
    with socket.socket() as squatter:  # got the port first (another stack, say)
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        try:
            stack._start_one(kvd)
            assert kvd.port != taken
            assert prefill.args[prefill.args.index("--kvd") + 1] == f"127.0.0.1:{kvd.port}"
            assert kvd.args[kvd.args.index("--port") + 1] == str(kvd.port)
        finally:
            kvd.stop()
            stack.pidfile.remove()
