"""What the two halves of shipping share: the pool, the mapped segment, the transport and its
peers, the codec negotiation, the counters and the background tasks of one kvd."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.kvd.layout import QUANTIZED
from pdserve.proto.v1 import common_pb2
from services.kvd import wirecodec
from services.kvd.index_sync import IndexSync
from services.kvd.peers import Peers
from services.kvd.pool import PinRecord, Pool
from services.kvd.samehost import SameHost
from services.kvd.transfer import UcxTransport
from services.kvd.wirecodec import WireCodec

RPC_TIMEOUT_S = 5.0


@dataclass
class Counters:
    bytes_in: int = 0
    bytes_out: int = 0
    num_transfers: int = 0
    num_errors: int = 0
    num_checksum_failures: int = 0
    num_refetches: int = 0
    num_same_host: int = 0


class Link:
    """One kvd's side of every transfer: read by ``sending.Sender`` and ``receiving.Receiver``."""

    def __init__(self, pool: Pool, arr: np.ndarray, data_offset: int, slot_bytes: int,
                 transport: UcxTransport, peers: Peers, sync: IndexSync,
                 me: common_pb2.KvdEndpoint, transfer_timeout: float,
                 kv_dtype: str = "", codec: WireCodec | None = None,
                 same_host: SameHost | None = None, segment: tuple[str, bytes] = ("", b"")
                 ) -> None:
        self.pool = pool
        self.arr = arr
        self.data_offset = data_offset
        self.slot_bytes = slot_bytes
        self.transport = transport
        self.peers = peers
        self.sync = sync
        self.me = me
        self.timeout = transfer_timeout
        self.kv_dtype = kv_dtype  # announced in every Transfer; the peer refuses a mismatch
        self.codec = codec  # offered per transfer, used if the peer accepts (wirecodec.py)
        self.offer = "" if codec is None or kv_dtype in QUANTIZED else codec.name
        self.counters = Counters()
        # Same-host pushes (``samehost``): peer pools mapped here (None: off), and this pool's
        # segment name and token offered to receivers ("": not offered)
        self.same_host = same_host
        self.segment = segment
        self.tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def stop(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.same_host is not None:
            self.same_host.close()

    def slot_view(self, slot: int) -> memoryview:
        start = self.data_offset + slot * self.slot_bytes
        return self.arr[start:start + self.slot_bytes].data

    def accept(self, offered: str) -> str:
        return wirecodec.accept(offered, self.offer, self.kv_dtype in QUANTIZED)

    def agreed(self, codec: str) -> WireCodec | None:
        return self.codec if codec and self.codec is not None and codec == self.codec.name \
            else None

    def release(self, pins: list[PinRecord]) -> None:
        for p in pins:
            self.pool.release(p.pin_id)


class Half:
    """The sending or the receiving half of a kvd's transfers: the shared ``Link`` and the
    parts of it both halves use, under short names."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.pool = link.pool
        self.slot_bytes = link.slot_bytes
        self.counters = link.counters
        self._transport = link.transport
        self._peers = link.peers
        self._me = link.me
        self._timeout = link.timeout
        self._spawn = link.spawn
        self._accept = link.accept
        self._agreed = link.agreed
        self._offer = link.offer
        self.kv_dtype = link.kv_dtype
