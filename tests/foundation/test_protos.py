"""The generated stubs import, and a message of each service round-trips through bytes."""

from __future__ import annotations

from pdserve.proto.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    kvd_pb2,
    kvd_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)


def _roundtrip(msg):  # type: ignore[no-untyped-def]
    data = msg.SerializeToString()
    back = type(msg).FromString(data)
    assert back == msg
    assert data  # a populated message is never empty on the wire
    return back


def test_stub_modules_expose_every_service() -> None:
    assert router_pb2_grpc.RouterStub and engine_pb2_grpc.PrefillStub
    assert engine_pb2_grpc.DecodeStub and engine_pb2_grpc.EngineStub and kvd_pb2_grpc.KvdStub
    services = {s for m in (router_pb2, engine_pb2, kvd_pb2)
                for s in m.DESCRIPTOR.services_by_name}
    assert services == {"Router", "Prefill", "Decode", "Engine", "Kvd"}


def test_router_request_roundtrip() -> None:
    sampling = common_pb2.SamplingParams(max_tokens=8, temperature=0.0, top_k=5, seed=7,
                                         stop=["\n"], stop_token_ids=[2], logprobs=3)
    req = router_pb2.GenerateRequest(
        model="tiny", chat=router_pb2.ChatMessages(
            messages=[router_pb2.ChatMessage(role="user", content="hi")]),
        sampling=sampling, meta=common_pb2.RequestMeta(request_id="r1", priority=1, tenant="t"))
    back = _roundtrip(req)
    assert back.WhichOneof("input") == "chat"
    assert back.sampling.HasField("temperature") and back.sampling.temperature == 0.0
    assert not back.sampling.HasField("top_p")  # unset optional stays distinguishable


def test_engine_messages_roundtrip() -> None:
    block = common_pb2.BlockRef(hash=bytes(range(32)), checksum=2**63 + 5, node_id="n1")
    resp = engine_pb2.PrefillResponse(first_token_id=42, blocks=[block], tail_token_ids=[1, 2],
                                      finish_reason=common_pb2.FINISH_REASON_LENGTH)
    assert _roundtrip(resp).blocks[0].checksum == 2**63 + 5
    dec = engine_pb2.DecodeRequest(prompt_token_ids=[1, 2, 3], first_token_id=0, blocks=[block])
    assert _roundtrip(dec).HasField("first_token_id")  # token 0 is a real token, not "unset"
    _roundtrip(engine_pb2.EngineStats(instance_id="p0", role=common_pb2.ROLE_PREFILL,
                                      queue_depth=3, kv_blocks_free=10))


def test_kvd_messages_roundtrip() -> None:
    layout = kvd_pb2.BlockLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64,
                                 dtype="float32", model_fingerprint="tiny@0")
    assert _roundtrip(kvd_pb2.RegisterRequest(layout=layout, client_id="e0")).layout == layout
    stats = _roundtrip(kvd_pb2.KvdStats(node_id="a", num_slots=64, slots_free=60,
                                        bytes_in=1 << 40))
    assert (stats.slots_free, stats.bytes_in) == (60, 1 << 40)
