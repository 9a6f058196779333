"""Optional lossless compression of kvd-to-kvd messages, negotiated per transfer. Off by
default: on this host's link it does not pay (``pdserve bench wirecodec``, docs/benchmarks.md).

    caller offers its --wire-codec in Transfer.codec ──► callee accepts it (Transfer reply's
    codec) only if its own --wire-codec is the same and its pool is unquantized; "" = raw

A compressed message is ``[u64 payload length | payload]`` in a buffer of the raw size plus
the header (a UCX receive may be larger than the message); a payload as long as the raw bytes
is sent raw (length 0), so incompressible data costs one failed attempt, never more bytes.
The receiver decompresses into the pool slots before the usual checksum verification, so a
codec bug is caught as a checksum mismatch, like any corruption.
"""

from __future__ import annotations

import struct

import numpy as np
from prometheus_client import Counter

CODECS = ("none", "lz4")
_HEADER = struct.Struct("<Q")
WIRE_BYTES = Counter("pdserve_kvd_wire_codec_bytes", "Bytes of messages sent through the wire "
                     "codec: before (raw) and after (sent) it", ["kind"])


class WireCodec:
    """lz4 frames (``lz4``, the fastest level) around one message's bytes."""

    name = "lz4"

    def __init__(self) -> None:
        import lz4.frame

        self._lz4 = lz4.frame

    def encode(self, view: np.ndarray) -> np.ndarray:
        """The buffer to send for ``view`` (header, then lz4 frame or the raw bytes)."""
        payload = self._lz4.compress(view.data, compression_level=0, store_size=True)
        raw = len(payload) >= view.nbytes
        out = np.empty(_HEADER.size + (view.nbytes if raw else len(payload)), np.uint8)
        _HEADER.pack_into(out.data, 0, 0 if raw else len(payload))
        out[_HEADER.size:] = view if raw else np.frombuffer(payload, np.uint8)
        WIRE_BYTES.labels("raw").inc(view.nbytes)
        WIRE_BYTES.labels("sent").inc(out.nbytes)
        return out

    @staticmethod
    def receive_buffer(nbytes: int) -> np.ndarray:
        return np.empty(_HEADER.size + nbytes, np.uint8)

    def decode(self, buf: np.ndarray, out: np.ndarray) -> None:
        """Write the message in ``buf`` into ``out`` (its slots); ValueError if it is not a
        message of ``out``'s size."""
        (length,) = _HEADER.unpack_from(buf.data, 0)
        if length == 0:
            out[:] = buf[_HEADER.size:_HEADER.size + out.nbytes]
            return
        data = self._lz4.decompress(buf[_HEADER.size:_HEADER.size + length].data)
        if len(data) != out.nbytes:
            raise ValueError(f"wire codec: {len(data)} bytes decoded for a {out.nbytes}-byte "
                             "message")
        out[:] = np.frombuffer(data, np.uint8)


def make(name: str) -> WireCodec | None:
    """The codec ``--wire-codec`` names (None for "none")."""
    return None if name in ("", "none") else WireCodec()


def accept(offered: str, mine: str, is_quantized: bool) -> str:
    """The codec a callee answers an offer with: the same one, or "" (raw)."""
    if is_quantized or offered in ("", "none") or offered != mine:
        return ""
    return offered
