"""The slot table alone: states, pins, leases, LRU order, errors (no processes)."""

from __future__ import annotations

import grpc
import pytest

from pdserve.errors import StatusError
from services.kvd.pool import Pool, SlotState


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def fill(pool: Pool, first: int, n: int) -> list[int]:
    """Allocate, commit and release ``n`` blocks h(first).. ; return their slots."""
    pins = pool.allocate(n, "t", 10.0)
    for i, p in enumerate(pins):
        pool.commit(p.slot, p.pin_id, h(first + i), 1000 + i, f"entries[{i}]")
        pool.release(p.pin_id)
    pool.check_integrity()
    return [p.slot for p in pins]


def test_allocate_commit_lookup_contiguous() -> None:
    pool = Pool(8, epoch=1)
    assert fill(pool, 0, 3) == [0, 1, 2]  # low slots first: runs stay contiguous for UCX
    assert pool.lookup([h(0), h(1), h(2), h(3)]) == 3
    assert pool.lookup([h(1), h(0)]) == 2
    assert pool.lookup([h(9), h(0)]) == 0
    assert pool.num_free == 5 and pool.count(SlotState.PRESENT) == 3


def test_lru_eviction_order_and_pins_protect() -> None:
    clock = Clock()
    pool = Pool(4, epoch=1, clock=clock)
    fill(pool, 0, 4)
    clock.t = 1.0
    pin = pool.pin_present(h(0), "reader", 5.0)  # h0 now pinned: not evictable
    assert pin is not None
    pool.release(pool.pin_present(h(2), "reader", 5.0).pin_id)  # type: ignore[union-attr]
    new = pool.allocate(2, "w", 5.0)  # evicts LRU unpinned: h1 then h3 (h2 was just used)
    assert pool.counters.evicted == [h(1), h(3)]
    assert sorted(p.slot for p in new) == [1, 3]
    assert pool.lookup([h(0)]) == 1 and pool.lookup([h(2)]) == 1
    with pytest.raises(StatusError) as err:
        pool.allocate(1, "w", 5.0)  # h0 pinned, 2 WRITING, h2 evictable -> 1 ok
        pool.allocate(1, "w", 5.0)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "num_slots: 1 slots wanted, 0 free and 0 evictable of 4" in err.value.message
    pool.check_integrity()


def test_leases_expire_and_free_uncommitted_slots() -> None:
    clock = Clock()
    pool = Pool(4, epoch=1, clock=clock)
    fill(pool, 0, 1)
    reader = pool.pin_present(h(0), "reader", 1.0)
    writer = pool.allocate(2, "writer", 2.0)
    assert pool.num_pinned == 3
    clock.t = 1.5
    assert pool.expire() == 1  # the reader's pin
    assert reader is not None and reader.pin_id not in pool.pins
    clock.t = 2.5
    assert pool.expire() == 2  # the writer died before committing: its slots come back
    assert pool.num_free == 3 and pool.num_pinned == 0
    assert pool.counters.num_lease_expiries == 3
    assert all(p.pin_id not in pool.pins for p in writer)
    pool.check_integrity()


def test_duplicate_commit_keeps_present_copy() -> None:
    pool = Pool(4, epoch=1)
    [first] = fill(pool, 0, 1)
    [pin] = pool.allocate(1, "w", 5.0)
    assert pool.commit(pin.slot, pin.pin_id, h(0), 7, "entries[0]") == first
    assert pool.pins[pin.pin_id].slot == first  # the writer's pin moved to the kept copy
    pool.release(pin.pin_id)
    assert pool.num_free == 3
    pool.check_integrity()


def test_inflight_arrival_and_abandon() -> None:
    pool = Pool(4, epoch=1)
    slots = pool.reserve([h(5), h(6)])
    assert pool.count(SlotState.IN_FLIGHT) == 2 and pool.num_evictable == 0
    assert pool.arrived(slots[0], 99) is True
    pool.abandon(slots[1])
    assert pool.lookup([h(5)]) == 1 and pool.lookup([h(6)]) == 0
    [pin] = pool.allocate(1, "w", 5.0)
    pool.commit(pin.slot, pin.pin_id, h(7), 1, "entries[0]")
    again = pool.reserve([h(7)])  # a push of a block committed locally meanwhile
    assert pool.arrived(again[0], 1) is False  # local copy kept, the arrival's slot freed
    pool.check_integrity()


@pytest.mark.parametrize("slot,pin_ok,message", [
    (99, False, "entries[0].slot: slot 99 out of range 0..63"),
    (0, False, "entries[0].pin_id: 12345 is not a live pin on slot 0"),
])
def test_commit_errors_name_the_field(slot: int, pin_ok: bool, message: str) -> None:
    pool = Pool(64, epoch=1)
    pool.allocate(1, "w", 5.0)
    with pytest.raises(StatusError) as err:
        pool.commit(slot, 12345, h(0), 1, "entries[0]")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message == message
