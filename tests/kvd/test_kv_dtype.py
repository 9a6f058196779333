"""A kvd pool holds one KV dtype: a quantized (fp8/int8) layout is refused by a pool of
unquantized blocks (and the reverse) at Register, and a peer's Transfer of another dtype is
refused, so quantized and unquantized instances never exchange blocks. Real kvd processes."""

from __future__ import annotations

import grpc
import pytest

from pdserve.kvd.client import KvdClient
from pdserve.kvd.layout import BlockLayout
from pdserve.proto.v1 import common_pb2, kvd_pb2, kvd_pb2_grpc
from tests.kvd.test_kvd_processes import Factory, client, start

FLOAT16 = BlockLayout(2, 16, 2, 16, "float16")  # 4096 bytes
INT8 = BlockLayout(2, 16, 2, 28, "int8")  # 2*2*16*2 * (28 values + 4 scale bytes) = 4096 bytes


def test_quantized_layouts_size_values_and_scales() -> None:
    assert FLOAT16.block_bytes == INT8.block_bytes == 4096
    fp8 = BlockLayout(30, 16, 3, 64, "float8_e4m3fn")  # SmolLM2-135M
    assert fp8.block_bytes == 30 * 2 * 16 * 3 * (64 + 4)
    assert fp8.is_quantized and not FLOAT16.is_quantized
    with pytest.raises(ValueError, match="layout.dtype: 'fp8' is not one of"):
        BlockLayout(2, 16, 2, 16, "fp8")


async def test_register_refuses_another_kv_dtype(kvd_factory: Factory, redis_url: str) -> None:
    kvd = start(kvd_factory, redis_url)
    first = await client(kvd, INT8)
    second = KvdClient(kvd.address, "float-engine")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await second.register(FLOAT16)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        "layout.dtype: KV cache dtype float16, but this pool holds int8 blocks (first "
        "registered layout); quantized and unquantized KV caches never share blocks")
    same = await client(kvd, INT8)  # the same dtype registers
    assert same.slot_view(0).dtype.itemsize == 1 and len(same.slot_view(0)) == 4096
    for c in (first, second, same):
        await c.close()


async def test_transfer_of_another_kv_dtype_is_refused(kvd_factory: Factory,
                                                       redis_url: str) -> None:
    kvd = start(kvd_factory, redis_url)
    c = await client(kvd, INT8)
    req = kvd_pb2.TransferRequest(
        direction=kvd_pb2.TransferRequest.DIRECTION_PUSH, slot_bytes=4096, kv_dtype="float16",
        peer=common_pb2.KvdEndpoint(node_id="other", address="127.0.0.1:1"),
        ucx_address=b"x", blocks=[common_pb2.BlockRef(hash=b"h" * 32)], slots=[0],
        transfer_id=1)
    async with grpc.aio.insecure_channel(kvd.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kvd_pb2_grpc.KvdStub(ch).Transfer(req, timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == (
        "kv_dtype: peer blocks are float16, this pool holds int8; quantized and unquantized "
        "KV caches never exchange blocks")
    await c.close()
