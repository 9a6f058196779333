"""Chaos tests: real ``pdserve up`` stacks (tiny model) hurt the way an operator's machines are
(kill -9, SIGSTOP), asserting on the client's view, the recovery time and that nothing stays
pinned or in use on any kvd or engine afterwards. Long cases are marked ``slow`` (``make
chaos``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve_bench.chaos import ChaosStack

# One prefill node and two decode nodes: a decode (or its kvd) that dies has a peer that serves
# meanwhile; the single prefill shows recovery by restart.
STACK_ARGS = ["--model", "tiny", "--prefill", "1", "--decode", "2", "--kvd-capacity-mib", "16"]


@pytest.fixture(scope="module")
def stack() -> Iterator[ChaosStack]:
    with ChaosStack(STACK_ARGS) as s:
        yield s


def healthy(stack: ChaosStack, names: tuple[str, ...] = ()) -> None:
    """The stack serves and every named child is up (a previous case's restart is done)."""
    for name in names:
        assert name in stack.children(), f"{name} is not running"
    recovery = stack.recover(lambda: None, timeout=60)
    assert recovery.seconds < 60


def assert_idle(stack: ChaosStack) -> None:
    held = stack.wait_idle(timeout=10)
    assert len(held) == len([n for n in stack.addresses if not n.startswith(("router", "gate"))])
    assert all(not any(v) for v in held.values()), held
