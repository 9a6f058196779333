"""Placement, the request's path through prefill and decode, and the router's answers."""

from __future__ import annotations

import threading

import grpc
import pytest

from pdserve.hashing import hash_blocks
from pdserve.proto.v1 import common_pb2, router_pb2
from services.router.preparing import Preparer
from tests.router.conftest import Cluster, request
from tests.router.fakes import FakeIndex

PROMPT = list(range(10, 10 + 16 * 5 + 3))  # 5 full blocks of 16 + a partial one


async def test_disaggregated_path_streams_first_token_then_decode(cluster: Cluster) -> None:
    p = await cluster.engine("P", "prefill")
    d = await cluster.engine("D", "decode", num_tokens=3)
    _, client = await cluster.router([p], [d])
    msgs = await client.generate(ids=PROMPT, request_id="r1", tenant="t", priority=3)
    assert [list(m.token_ids) for m in msgs] == [[7], [100], [101], [102]]
    assert msgs[0].placement.prefill_instance == "P"
    assert msgs[0].placement.decode_instance == "D"
    assert msgs[0].placement.prompt_tokens == len(PROMPT)
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert msgs[-1].usage == common_pb2.Usage(prompt_tokens=len(PROMPT), completion_tokens=4)
    pre, dec = p.seen.prefills[0], d.seen.decodes[0]
    assert list(pre.prompt_token_ids) == PROMPT
    assert pre.destination.node_id == "node-D"  # prefill pushes to the decode node's kvd
    assert pre.meta.priority == 3 and pre.meta.tenant == "t" and pre.meta.request_id == "r1"
    assert dec.first_token_id == 7 and len(dec.blocks) == len(PROMPT) // 4
    # Pushed there; whatever did not arrive (a prefix prefill loaded, not computed) is pulled.
    assert dec.source.node_id == "node-P"


async def test_text_and_chat_prompts_are_tokenized(cluster: Cluster) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    _, client = await cluster.router([p], [d])
    tok = cluster.spec.tokenizer
    assert tok is not None
    await client.generate(prompt="hello world")
    assert list(p.seen.prefills[0].prompt_token_ids) == tok.encode("hello world")
    chat = router_pb2.GenerateRequest(model="tiny")
    chat.chat.messages.add(role="user", content="hi")
    _ = [m async for m in client.stub.Generate(chat, timeout=10)]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert list(p.seen.prefills[1].prompt_token_ids) == tok.encode(text, add_special_tokens=False)


async def test_long_prompt_is_prepared_off_the_event_loop(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    router, client = await cluster.router([p], [d])
    offloaded = []
    original = Preparer._offload

    async def counting_offload(self, work):  # type: ignore[no-untyped-def]
        offloaded.append(threading.get_ident())
        return await original(self, lambda: (offloaded.append(threading.get_ident()),
                                             work())[1])

    monkeypatch.setattr(Preparer, "_offload", counting_offload)
    await client.generate(prompt="short")
    assert offloaded == []
    text = "the quick brown fox " * 250  # above HEAVY_PROMPT characters: a worker thread
    await client.generate(prompt=text)
    loop_thread = threading.get_ident()  # tokenizing and hashing ran in worker threads
    assert len(offloaded) == 4 and offloaded[0::2] == [loop_thread] * 2
    assert loop_thread not in offloaded[1::2]
    tok = cluster.spec.tokenizer
    assert tok is not None
    ids = tok.encode(text)
    assert list(p.seen.prefills[1].prompt_token_ids) == ids
    assert router.cluster_state().num_prompt_blocks == len(ids) // 16


async def test_cache_aware_picks_the_prefill_node_holding_the_prefix(cluster: Cluster) -> None:
    a, b = await cluster.engine("A", "prefill"), await cluster.engine("B", "prefill")
    d = await cluster.engine("D", "decode")
    index = FakeIndex()
    hashes = hash_blocks(PROMPT, 16, cluster.spec.fingerprint)
    index.add("node-B", hashes[:4])
    router, client = await cluster.router([a, b], [d], index=index)
    for _ in range(3):
        msgs = await client.generate(ids=PROMPT)
        assert msgs[0].placement.prefill_instance == "B"
        assert msgs[0].placement.cached_blocks == 4
    state = router.cluster_state()
    assert (state.num_prefix_hit_blocks, state.num_prompt_blocks) == (12, 15)
    assert index.num_lookups == 3  # one round trip per request
    # A tenant's salt changes every hash: B's blocks are no hit for it.
    msgs = await client.generate(ids=PROMPT, cache_salt="other")
    assert msgs[0].placement.cached_blocks == 0


async def test_cache_aware_spreads_cold_requests_and_avoids_a_queue(cluster: Cluster) -> None:
    a, b = await cluster.engine("A", "prefill"), await cluster.engine("B", "prefill")
    d = await cluster.engine("D", "decode")
    index = FakeIndex()
    index.add("node-B", hash_blocks(PROMPT, 16, cluster.spec.fingerprint)[:1])
    b.stats.queue_depth = 50  # one cached block is not worth waiting behind 50 prompts
    router, client = await cluster.router([a, b], [d], index=index)
    assert (await client.generate(ids=PROMPT))[0].placement.prefill_instance == "A"
    b.stats.queue_depth = 0
    await router.poll()
    cold = [(await client.generate(ids=[1, 2, 3]))[0].placement.prefill_instance
            for _ in range(4)]
    assert sorted(cold) == ["A", "A", "B", "B"]


async def test_round_robin_alternates_and_ignores_the_cache(cluster: Cluster) -> None:
    a, b = await cluster.engine("A", "prefill"), await cluster.engine("B", "prefill")
    d1, d2 = await cluster.engine("D1", "decode"), await cluster.engine("D2", "decode")
    index = FakeIndex()
    index.add("node-B", hash_blocks(PROMPT, 16, cluster.spec.fingerprint))
    _, client = await cluster.router([a, b], [d1, d2], index=index, policy="round_robin")
    placements = [(await client.generate(ids=PROMPT))[0].placement for _ in range(4)]
    assert [pl.prefill_instance for pl in placements] == ["A", "B", "A", "B"]
    assert [pl.decode_instance for pl in placements] == ["D1", "D2", "D1", "D2"]


async def test_least_load_picks_the_idle_instances(cluster: Cluster) -> None:
    a, b = await cluster.engine("A", "prefill"), await cluster.engine("B", "prefill")
    d1, d2 = await cluster.engine("D1", "decode"), await cluster.engine("D2", "decode")
    a.stats.queue_depth, d1.stats.num_running = 5, 9
    _, client = await cluster.router([a, b], [d1, d2], policy="least_load")
    for _ in range(2):
        placement = (await client.generate(ids=PROMPT))[0].placement
        assert (placement.prefill_instance, placement.decode_instance) == ("B", "D2")


async def test_colocated_engine_does_both_phases(cluster: Cluster) -> None:
    c = await cluster.engine("C", "colocated", num_tokens=2)
    _, client = await cluster.router(decode=[c])
    msgs = await client.generate(ids=PROMPT)
    assert [list(m.token_ids) for m in msgs] == [[100], [101]]
    assert msgs[0].placement.decode_instance == "C" and not msgs[0].placement.prefill_instance
    assert not c.seen.decodes[0].HasField("first_token_id")
    assert msgs[-1].usage == common_pb2.Usage(prompt_tokens=len(PROMPT), completion_tokens=2,
                                              cached_tokens=4)


async def test_prefill_final_first_token_ends_the_request(cluster: Cluster) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    p.prefill_finish = common_pb2.FINISH_REASON_STOP
    _, client = await cluster.router([p], [d])
    msgs = await client.generate(ids=PROMPT, max_tokens=1)
    assert len(msgs) == 1 and list(msgs[0].token_ids) == [7]
    assert msgs[0].finish_reason == common_pb2.FINISH_REASON_STOP
    assert msgs[0].usage.completion_tokens == 1
    assert d.seen.decodes == []


async def test_list_models_and_cluster_state(cluster: Cluster) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    d.stats.num_running, d.stats.decode_tokens_per_s = 2, 55.0
    _, client = await cluster.router([p], [d], policy="least_load")
    models = await client.stub.ListModels(router_pb2.ListModelsRequest(), timeout=5)
    assert [(m.id, m.max_context, m.block_size) for m in models.models] == [("tiny", 4096, 16)]
    await client.generate(ids=PROMPT)
    state = await client.stub.ClusterState(router_pb2.ClusterStateRequest(), timeout=5)
    assert state.policy == "least_load" and not state.index_available
    assert state.num_requests == 1
    by_id = {i.instance_id: i for i in state.instances}
    assert by_id["D"].role == common_pb2.ROLE_DECODE and by_id["D"].healthy
    assert (by_id["D"].num_running, by_id["D"].decode_tokens_per_s) == (2, 55.0)
    assert by_id["P"].num_routed == 1 and by_id["D"].kvd_node == "node-D"


@pytest.mark.parametrize(("mutate", "code", "needle"), [
    (lambda r: r.ClearField("prompt"), grpc.StatusCode.INVALID_ARGUMENT, "input:"),
    (lambda r: setattr(r, "prompt", ""), grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not"),
    (lambda r: r.sampling.__setattr__("temperature", -1.0), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.temperature"),
    (lambda r: r.sampling.__setattr__("top_p", 0.0), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.top_p"),
    (lambda r: r.sampling.__setattr__("temperature", float("nan")),
     grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
    (lambda r: r.sampling.__setattr__("logprobs", 21), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.logprobs"),
    (lambda r: r.sampling.__setattr__("max_tokens", 5000), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.max_tokens"),
    (lambda r: r.sampling.stop.append(""), grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop"),
    (lambda r: r.prompt_token_ids.ids.extend(range(300)), grpc.StatusCode.INVALID_ARGUMENT,
     "prompt: 300 tokens, above the limit of 200"),
    (lambda r: r.chat.messages.add(role="robot", content="x"),
     grpc.StatusCode.INVALID_ARGUMENT, "chat.messages[0].role"),
    (lambda r: r.chat.SetInParent(), grpc.StatusCode.INVALID_ARGUMENT, "chat.messages"),
    (lambda r: setattr(r, "model", "gpt-9"), grpc.StatusCode.NOT_FOUND, "model: 'gpt-9'"),
])
async def test_bad_requests_name_the_field(cluster: Cluster, mutate, code, needle) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    _, client = await cluster.router([p], [d], max_prompt_tokens=200)
    req = request(prompt="hello")
    req.ClearField("prompt")
    req.prompt = "hello"
    mutate(req)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _ = [m async for m in client.stub.Generate(req, timeout=5)]
    assert err.value.code() == code
    assert needle in err.value.details()
    assert p.seen.prefills == []


async def test_max_tokens_beyond_the_context_is_rejected(cluster: Cluster) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    _, client = await cluster.router([p], [d], max_prompt_tokens=5000, max_tokens=5000)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.generate(ids=[1] * 4000, max_tokens=200)
    assert "sampling.max_tokens" in err.value.details() and "4096" in err.value.details()
    await client.generate(ids=[1] * 4000, max_tokens=0)  # 0: the room left, 96
    assert p.seen.prefills[0].sampling.max_tokens == 96


async def test_no_capacity_is_unavailable(cluster: Cluster) -> None:
    p = await cluster.engine("P", "prefill")
    _, client = await cluster.router([p], [])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.generate(ids=PROMPT)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no capacity" in err.value.details()
