"""Processor sharing among simulated instances pinned to one CPU set (``pdserve sim --validate``
of a stack whose engines share cores): while k instances on a set compute, each runs at 1/k of
its speed, and every start or end of an operation on the set re-times the others.

An operation is a prefill batch or a decode step with its work in seconds at full speed. When
the number of operations on a set changes, each one's remaining work is charged for the time
since its last change at the old share, and its end is re-scheduled at the new one; an end
event carries the version it was scheduled with, and an older one is stale.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(slots=True)
class Op:
    work: float  # seconds left at full speed
    since: float  # when ``work`` was last charged
    share: int  # operations on the set since then (this one included)
    version: int
    payload: object  # what the end event carries


class CoreSharing:
    def __init__(self, cores: list[str]) -> None:
        self.cores = cores
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

    def _retime(self, now: float, on_set: list[int]) -> Iterator[tuple[float, int, object]]:
        for i in on_set:
            op = self.ops[i]
            op.share = len(on_set)
            self.versions[i] += 1
            op.version = self.versions[i]
            yield now + op.work * op.share, i, op.payload

    def start(self, now: float, idx: int, work: float, payload: object
              ) -> list[tuple[float, int, object]]:
        """Instance ``idx`` starts ``work`` seconds of computing: (end time, instance, payload)
        for every operation on its set, to be scheduled (the new one included)."""
        on_set = self._charge(now, idx)
        self.ops[idx] = Op(work, now, 1, 0, payload)
        return list(self._retime(now, [*on_set, idx]))

    def end(self, now: float, idx: int, version: int) -> list[tuple[float, int, object]] | None:
        """The end event of ``idx``'s operation: None when it is stale (re-timed since); else
        its operation is over and the others on its set are re-timed (returned)."""
        op = self.ops.get(idx)
        if op is None or op.version != version:
            return None
        on_set = self._charge(now, idx)
        del self.ops[idx]
        on_set.remove(idx)
        return list(self._retime(now, on_set))

    def version(self, idx: int) -> int:
        return self.versions[idx]
