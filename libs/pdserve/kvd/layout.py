"""The block layout engines register with kvd, and the layout of the pool segment.

One block is contiguous ``[layers][2][block_size][kv_heads][head_dim]`` of the model's KV dtype
(DESIGN.md §2); a quantized one (``float8_e4m3fn``, ``int8``) is those values (1 byte each)
followed by one float32 scale per token and head, ``[layers][2][block_size][kv_heads]``
(attention/kv_quant.py). A kvd pool holds quantized blocks of one dtype, or unquantized ones.
The pool is one POSIX shared-memory segment cut into fixed-size slots:

    offset 0            HEADER_BYTES                    + i * slot_bytes
    +-------------------+--------+--------+-----+--------+
    | header (magic,    | slot 0 | slot 1 | ... | slot   |
    |  slot_bytes, n,   |        |        |     |  n-1   |
    |  epoch, token)    |        |        |     |        |
    +-------------------+--------+--------+-----+--------+

The header lets a client check it mapped the segment it was told about; its random token
lets a peer kvd on the same host prove it mapped this very pool (``services/kvd/samehost.py``).
Slot metadata (hash, state, pins, leases, checksum) lives in the daemon only: a client reaches
a slot's bytes only through a pin, and the daemon never reuses a pinned slot, which is the
fence that keeps readers from seeing a slot being rewritten.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1}
QUANTIZED = ("float8_e4m3fn", "int8")  # with float32 per-token per-head scales
SCALE_BYTES = 4
HEADER_BYTES = 4096  # page-aligned so slot 0 starts on a page
_MAGIC = b"PDKVPOOL"
_HEADER = struct.Struct("<8sQQQ")  # magic, slot_bytes, num_slots, epoch
_TOKEN = struct.Struct("<16s")  # right after: random per pool (a peer's same-host proof)
TOKEN_BYTES = _TOKEN.size
MAX_SLOT_BYTES = 1 << 30


@dataclass(frozen=True)
class BlockLayout:
    """Shape and dtype of one KV block, as an engine registers it."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    model_fingerprint: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"layout.{name}: must be an integer >= 1, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"layout.dtype: {self.dtype!r} is not one of "
                             f"{', '.join(DTYPE_BYTES)}")
        if self.block_bytes > MAX_SLOT_BYTES:
            raise ValueError(f"layout: one block is {self.block_bytes} bytes, more than the "
                             f"{MAX_SLOT_BYTES} bytes a slot may hold")

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def is_quantized(self) -> bool:
        return self.dtype in QUANTIZED

    @property
    def block_bytes(self) -> int:
        """Slot size: the values, and the scales of a quantized dtype."""
        heads = self.num_layers * 2 * self.block_size * self.num_kv_heads
        scales = heads * SCALE_BYTES if self.is_quantized else 0
        return heads * self.head_dim * DTYPE_BYTES[self.dtype] + scales


def segment_bytes(slot_bytes: int, num_slots: int) -> int:
    return HEADER_BYTES + slot_bytes * num_slots


def write_header(buf: memoryview, slot_bytes: int, num_slots: int, epoch: int,
                 token: bytes = bytes(TOKEN_BYTES)) -> None:
    _HEADER.pack_into(buf, 0, _MAGIC, slot_bytes, num_slots, epoch)
    _TOKEN.pack_into(buf, _HEADER.size, token)


def read_token(buf: memoryview | bytes) -> bytes:
    """The pool's random token (all zeros in a pool made without one)."""
    return bytes(_TOKEN.unpack_from(buf, _HEADER.size)[0])


def read_header(buf: memoryview | bytes) -> tuple[int, int, int]:
    """``(slot_bytes, num_slots, epoch)`` of a mapped segment; ValueError if it is not a pool."""
    magic, slot_bytes, num_slots, epoch = _HEADER.unpack_from(buf, 0)
    if magic != _MAGIC:
        raise ValueError("shm segment is not a pdserve kvd pool (bad magic)")
    return slot_bytes, num_slots, epoch
