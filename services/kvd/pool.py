"""The slot table of the shared-memory pool: states, pins with leases, LRU eviction.

Pure bookkeeping, no I/O: the daemon owns this table and is the only writer of slot states.

    FREE ──allocate──► WRITING ──commit──► PRESENT ──evict (LRU, unpinned)──► FREE
      │                   └──lease expires / release──► FREE          ▲
      └──reserve (inbound)──► IN_FLIGHT ──verified──► PRESENT ────────┘
                                  └──bad / peer lost──► FREE

Invariants (``check_integrity``): every slot is in exactly one state; FREE slots are in the
free heap and nothing else; PRESENT slots are in ``by_hash``; an unpinned PRESENT slot is in
the LRU and a pinned one is not; pin counts equal the live pins. A pinned slot is never
reused, so a client reading through a pin never sees its bytes rewritten.

Pins belong to the client that took them: pin ids are random 63-bit numbers (unguessable),
and ``release``/``commit`` act only on the caller's own; ``check_quota`` bounds how many slots
one client holds pinned.
"""

from __future__ import annotations

import enum
import heapq
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from pdserve.errors import BadRequest, StatusError


class SlotState(enum.IntEnum):
    FREE = 0
    WRITING = 1
    PRESENT = 2
    IN_FLIGHT = 3


@dataclass
class Slot:
    state: SlotState = SlotState.FREE
    hash: bytes = b""
    checksum: int = 0
    num_pins: int = 0
    epoch: int = 0


@dataclass
class PinRecord:
    pin_id: int
    slot: int
    client_id: str
    expires_at: float


@dataclass
class PoolCounters:
    num_evictions: int = 0
    num_lease_expiries: int = 0
    evicted: list[bytes] = field(default_factory=list)  # drained by the index sync


class Pool:
    """Slot states of one pool of ``num_slots`` slots (see the module docstring)."""

    def __init__(self, num_slots: int, epoch: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots: must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.epoch = epoch
        self._clock = clock
        self.slots = [Slot() for _ in range(num_slots)]
        self._free = list(range(num_slots))  # a min-heap: low slots first keeps runs contiguous
        self.by_hash: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # unpinned PRESENT slots, oldest first
        self.pins: dict[int, PinRecord] = {}
        self.counters = PoolCounters()

    # -- queries ---------------------------------------------------------------------------
    def check_slot(self, slot: int, field_name: str) -> Slot:
        if not 0 <= slot < self.num_slots:
            raise BadRequest(f"{field_name}: slot {slot} out of range 0..{self.num_slots - 1}")
        return self.slots[slot]

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Length of the leading run of ``hashes`` present here."""
        n = 0
        for h in hashes:
            if h not in self.by_hash:
                break
            n += 1
        return n

    def count(self, state: SlotState) -> int:
        return sum(1 for s in self.slots if s.state == state)

    def pins_of(self, client_id: str) -> int:
        return sum(1 for p in self.pins.values() if p.client_id == client_id)

    def check_quota(self, client_id: str, n: int, limit: int) -> None:
        """RESOURCE_EXHAUSTED if ``n`` more pins would put ``client_id`` above ``limit``."""
        held = self.pins_of(client_id)
        if held + n > limit:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"client {client_id!r} holds {held} pinned slots; {n} more would "
                              f"pass its quota of {limit} (--max-client-share)")

    def own_pin(self, pin_id: int, client_id: str) -> PinRecord | None:
        """The live pin ``pin_id`` if ``client_id`` took it, else None."""
        pin = self.pins.get(pin_id)
        return pin if pin is not None and pin.client_id == client_id else None

    @property
    def num_pinned(self) -> int:
        return sum(1 for s in self.slots if s.num_pins > 0)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    # -- allocation --------------------------------------------------------------------------
    def _take(self, n: int, what: str) -> list[int]:
        """``n`` slots (free first, then evicting LRU blocks), all or none."""
        if n > len(self._free) + len(self._lru):
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{what}: {n} slots wanted, {len(self._free)} free and "
                              f"{len(self._lru)} evictable of {self.num_slots}")
        while len(self._free) < n:
            self._evict_one()
        return [heapq.heappop(self._free) for _ in range(n)]

    def _evict_one(self) -> None:
        slot, _ = self._lru.popitem(last=False)
        s = self.slots[slot]
        del self.by_hash[s.hash]
        self.counters.evicted.append(s.hash)
        self.counters.num_evictions += 1
        self._set_free(slot)

    def _set_free(self, slot: int) -> None:
        s = self.slots[slot]
        s.state, s.hash, s.checksum, s.num_pins = SlotState.FREE, b"", 0, 0
        heapq.heappush(self._free, slot)

    def allocate(self, n: int, client_id: str, lease_s: float) -> list[PinRecord]:
        """``n`` WRITING slots, each pinned under a lease. RESOURCE_EXHAUSTED at once if not."""
        pins = []
        for slot in self._take(n, "num_slots"):
            s = self.slots[slot]
            s.state, s.epoch = SlotState.WRITING, self.epoch
            pins.append(self._pin(slot, client_id, lease_s))
        return pins

    def reserve(self, hashes: Sequence[bytes]) -> list[int]:
        """IN_FLIGHT slots for blocks about to arrive (never evictable while in flight)."""
        slots = self._take(len(hashes), "blocks")
        for slot, h in zip(slots, hashes, strict=True):
            s = self.slots[slot]
            s.state, s.hash, s.epoch = SlotState.IN_FLIGHT, h, self.epoch
        return slots

    # -- pins --------------------------------------------------------------------------------
    def _pin(self, slot: int, client_id: str, lease_s: float) -> PinRecord:
        s = self.slots[slot]
        s.num_pins += 1
        self._lru.pop(slot, None)
        pin_id = secrets.randbits(63)
        while pin_id == 0 or pin_id in self.pins:
            pin_id = secrets.randbits(63)
        pin = PinRecord(pin_id, slot, client_id, self._clock() + lease_s)
        self.pins[pin.pin_id] = pin
        return pin

    def pin_present(self, h: bytes, client_id: str, lease_s: float) -> PinRecord | None:
        """Pin the block ``h`` if it is present here; None if not."""
        slot = self.by_hash.get(h)
        if slot is None:
            return None
        return self._pin(slot, client_id, lease_s)

    def release(self, pin_id: int) -> bool:
        """Drop one pin; a WRITING slot whose last pin goes was never committed: it is freed."""
        pin = self.pins.pop(pin_id, None)
        if pin is None:
            return False
        s = self.slots[pin.slot]
        s.num_pins -= 1
        if s.num_pins == 0:
            if s.state == SlotState.WRITING:
                self._set_free(pin.slot)
            elif s.state == SlotState.PRESENT:
                self._lru[pin.slot] = None  # most recently used end
        return True

    def release_client(self, client_id: str) -> int:
        """Drop every pin ``client_id`` holds (its session ended: the client is gone)."""
        mine = [p.pin_id for p in self.pins.values() if p.client_id == client_id]
        for pin_id in mine:
            self.release(pin_id)
        return len(mine)

    def expire(self) -> int:
        """Release every pin whose lease has passed (a dead client cannot leak the pool)."""
        now = self._clock()
        expired = [p.pin_id for p in self.pins.values() if p.expires_at <= now]
        for pin_id in expired:
            self.release(pin_id)
        self.counters.num_lease_expiries += len(expired)
        return len(expired)

    # -- state changes -----------------------------------------------------------------------
    def commit(self, slot: int, pin_id: int, h: bytes, checksum: int, field_name: str) -> int:
        """Publish a WRITING slot as block ``h``; return the slot that now holds ``h``.

        If ``h`` is already present elsewhere, this slot is freed and the existing one kept.
        The writer's pin moves with the block (released by the caller when asked to).
        """
        s = self.check_slot(slot, f"{field_name}.slot")
        pin = self.pins.get(pin_id)
        if pin is None or pin.slot != slot:
            raise BadRequest(f"{field_name}.pin_id: {pin_id} is not a live pin on slot {slot}")
        if s.state != SlotState.WRITING:
            raise BadRequest(f"{field_name}.slot: slot {slot} is {s.state.name}, not WRITING")
        existing = self.by_hash.get(h)
        if existing is not None:
            self.release(pin_id)  # frees the WRITING slot: the present copy wins
            moved = self._pin(existing, pin.client_id, pin.expires_at - self._clock())
            del self.pins[moved.pin_id]
            moved.pin_id = pin_id  # the writer keeps its pin id, now on the present copy
            self.pins[pin_id] = moved
            return existing
        s.state, s.hash, s.checksum = SlotState.PRESENT, h, checksum
        self.by_hash[h] = slot
        return slot

    def arrived(self, slot: int, checksum: int) -> bool:
        """An IN_FLIGHT slot was verified: make it PRESENT. False if the hash got here first
        by another path (the slot is then freed and the present copy kept)."""
        s = self.slots[slot]
        assert s.state == SlotState.IN_FLIGHT, f"slot {slot} is {s.state.name}"
        if s.hash in self.by_hash:
            self._set_free(slot)
            return False
        s.state, s.checksum = SlotState.PRESENT, checksum
        self.by_hash[s.hash] = slot
        self._lru[slot] = None
        return True

    def abandon(self, slot: int) -> None:
        """An IN_FLIGHT slot whose bytes will never be good (bad checksum, peer lost)."""
        assert self.slots[slot].state == SlotState.IN_FLIGHT
        self._set_free(slot)

    # -- integrity ---------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant of the module docstring is broken."""
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is twice in the free heap"
        pins_per_slot: dict[int, int] = {}
        for p in self.pins.values():
            pins_per_slot[p.slot] = pins_per_slot.get(p.slot, 0) + 1
        for i, s in enumerate(self.slots):
            assert (s.state == SlotState.FREE) == (i in free), f"slot {i} {s.state.name} vs free"
            assert s.num_pins == pins_per_slot.get(i, 0), f"slot {i} pin count"
            is_present = s.state == SlotState.PRESENT
            assert is_present == (self.by_hash.get(s.hash) == i), f"slot {i} hash map"
            assert (i in self._lru) == (is_present and s.num_pins == 0), f"slot {i} LRU"
        assert len(self.by_hash) == self.count(SlotState.PRESENT), "stale hash map entry"
