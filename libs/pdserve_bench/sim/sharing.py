"""Processor sharing among simulated instances pinned to one CPU set (``pdserve sim --validate``
of a stack whose engines share cores): while k instances on a set compute, each runs at 1/k of
its speed, and every start or end of an operation on the set re-times the others.

An operation is a prefill batch or a decode step with its work in seconds at full speed. When
the number of operations on a set changes, each one's remaining work is charged for the time
since its last change at the old share, and its end is re-scheduled at the new one; an end
event carries the version it was scheduled with, and an older one is stale.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Push = Callable[[float, int, object], None]  # Sim.push(time, kind, obj)


@dataclass(slots=True)
class Op:
    work: float  # seconds left at full speed
    since: float  # when ``work`` was last charged
    share: int  # operations on the set since then (this one included)
    version: int
    kind: int  # the end event's kind and what it carries (with the version)
    payload: object


class CoreSharing:
    """Schedules the end events of operations on shared CPU sets through ``push``; each carries
    ``(payload, version)``."""

    def __init__(self, cores: list[str], push: Push) -> None:
        self.cores, self.push = cores, push
        self.ops: dict[int, Op] = {}  # by instance index
        self.versions = [0] * len(cores)

    def _on_set(self, idx: int) -> list[int]:
        return [i for i in self.ops if self.cores[i] == self.cores[idx]]

    def _charge(self, now: float, idx: int) -> list[int]:
        on_set = self._on_set(idx)
        for i in on_set:
            op = self.ops[i]
            op.work = max(0.0, op.work - (now - op.since) / op.share)
            op.since = now
        return on_set

    def _retime(self, now: float, on_set: list[int]) -> None:
        for i in on_set:
            op = self.ops[i]
            op.share = len(on_set)
            self.versions[i] += 1
            op.version = self.versions[i]
            self.push(now + op.work * op.share, op.kind, (op.payload, op.version))

    def start(self, now: float, idx: int, work: float, kind: int, payload: object) -> None:
        """Instance ``idx`` starts ``work`` seconds of computing; every operation on its set is
        re-timed (the new one included)."""
        on_set = self._charge(now, idx)
        self.ops[idx] = Op(work, now, 1, 0, kind, payload)
        self._retime(now, [*on_set, idx])

    def end(self, now: float, idx: int, version: int) -> bool:
        """At an end event of ``idx``'s operation: False when it is stale (re-timed since);
        else the operation is over and the others on its set are re-timed."""
        op = self.ops.get(idx)
        if op is None or op.version != version:
            return False
        on_set = self._charge(now, idx)
        del self.ops[idx]
        on_set.remove(idx)
        self._retime(now, on_set)
        return True
