"""The opt-in kvd-to-kvd wire codec (lz4, negotiated per transfer): its framing, the
negotiation rule, and two real kvds that both enable it moving blocks bit-exact with fewer
bytes on the wire, while a kvd without it still exchanges raw blocks with them."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pdserve.kvd.client import CommitEntry, KvdClient
from services.kvd import wirecodec
from services.kvd.config import KvdConfig
from tests.kvd.test_kvd_processes import (
    Factory,
    bytes_of,
    client,
    endpoint,
    refs,
    start,
    write,
)


def test_frames_round_trip_and_incompressible_bytes_go_raw() -> None:
    codec = wirecodec.WireCodec()
    smooth = np.zeros(1 << 16, np.uint8)
    smooth[::7] = 3
    noise = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    for data, compressed in ((smooth, True), (noise, False)):
        buf = codec.encode(data)
        assert (buf.nbytes < data.nbytes) is compressed
        assert buf.nbytes <= data.nbytes + 8  # never more than the header
        recv = codec.receive_buffer(data.nbytes)
        recv[:buf.nbytes] = buf
        out = np.empty_like(data)
        codec.decode(recv, out)
        assert np.array_equal(out, data)
    with pytest.raises(ValueError, match="bytes decoded for a 100-byte message"):
        codec.decode(codec.encode(smooth), np.empty(100, np.uint8))


def test_negotiation_and_bad_flag() -> None:
    assert wirecodec.accept("lz4", "lz4", is_quantized=False) == "lz4"
    assert wirecodec.accept("lz4", "", is_quantized=False) == ""  # callee did not opt in
    assert wirecodec.accept("lz4", "lz4", is_quantized=True) == ""  # fp8/int8: raw
    assert wirecodec.accept("", "lz4", is_quantized=False) == ""
    assert KvdConfig().wire_codec == "none"
    with pytest.raises(ValueError, match=r"--wire-codec: invalid value 'zstd' "
                                         r"\(accepted: none, lz4\)"):
        KvdConfig(wire_codec="zstd")


def _wire_bytes(port: int | None) -> dict[str, float]:
    assert port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as resp:
        text = resp.read().decode()
    return {s.labels["kind"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "pdserve_kvd_wire_codec_bytes_total"}


async def _write_smooth(c: KvdClient, n: int) -> tuple[list, list[bytes], list[int]]:
    """Blocks of a smooth signal in float16 (compressible, like real KV's exponent bytes)."""
    pins, hashes, _ = await write(c, n)
    for p in pins:
        view = c.slot_view(p.slot)
        view.copy_(torch.linspace(-1, 1, view.numel()).view(view.shape).to(torch.float16))
    from pdserve.hashing import block_checksum

    return pins, hashes, [block_checksum(c.slot_memory(p.slot)) for p in pins]


async def test_two_kvds_with_lz4_move_blocks_bit_exact(kvd_factory: Factory,
                                                       redis_url: str) -> None:
    a = start(kvd_factory, redis_url, "--wire-codec", "lz4", "--same-host", "false")  # UCX
    b = start(kvd_factory, redis_url, "--wire-codec", "lz4")
    plain = start(kvd_factory, redis_url)
    ca, cb, cp = await client(a), await client(b), await client(plain)
    for dest, src, cdst in ((b, a, cb), (plain, a, cp)):  # negotiated lz4, then raw
        for mode in ("push", "pull"):
            pins, hashes, sums = await _write_smooth(ca, 24)
            want = bytes_of(ca, pins)
            await ca.commit([CommitEntry(p, h) for p, h in zip(pins, hashes, strict=True)],
                            destination=endpoint(dest) if mode == "push" else None)
            source = endpoint(src) if mode == "pull" else None
            got = await cdst.await_blocks(refs(hashes, sums), source=source, timeout=20)
            assert bytes_of(cdst, got) == want, (dest.node_id, mode)
            await cdst.release([p.pin_id for p in got])
        if dest is b:
            sent = _wire_bytes(a.metrics_port)
            assert sent["raw"] == 2 * 24 * 4096 and sent["sent"] < sent["raw"] / 2, sent
    assert _wire_bytes(a.metrics_port)["raw"] == 2 * 24 * 4096  # nothing more to `plain`
    assert (await cb.stats()).num_checksum_failures == 0
    for c in (ca, cb, cp):
        await c.close()
