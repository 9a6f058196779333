"""The disaggregated path end to end with real processes: two kvds (UCX between them), a
prefill and a decode instance (plus a second prefill on kvd A's node), real Redis.

    P (kvd A) ──push──► kvd B ──► D         P2 shares kvd A: it loads prefixes P left there
"""

from __future__ import annotations

import asyncio
import functools
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch
import transformers

from pdserve.hashing import hash_blocks
from pdserve.index import NodeRecord, RedisPrefixIndex
from pdserve.llm import LLM
from pdserve.models import save_builtin
from pdserve.proto.v1 import common_pb2, engine_pb2, kvd_pb2, kvd_pb2_grpc
from pdserve.sampling_params import SamplingParams
from tests.conftest import RedisServer
from tests.services.harness import Client, Proc, start_services, stop_all, tokens_of

MAX_TOKENS = 10
PROMPTS = {"short": [(5 * i) % 250 + 2 for i in range(7)],
           "one_block": [(11 * i) % 250 + 2 for i in range(16)],
           "many_blocks": [(13 * i) % 250 + 2 for i in range(83)]}
ENGINE_FLAGS = ["--num-blocks", "96", "--max-num-batched-tokens", "32", "--threads", "1"]


@dataclass
class Cluster:
    model: str
    redis_url: str
    kvd_a: Proc
    kvd_b: Proc
    prefill: Proc
    prefill2: Proc
    decode: Proc

    def endpoint(self, kvd: Proc) -> common_pb2.KvdEndpoint:
        return common_pb2.KvdEndpoint(node_id=f"node-{kvd.port}", address=kvd.address)


def _start_cluster(model: str, redis_url: str) -> Iterator[Cluster]:
    procs: list[Proc] = []
    try:
        procs += start_services(*[("kvd", "--capacity-mib", "32", "--redis-url", redis_url)] * 2)
        kvd_a, kvd_b = procs
        common = ["--model", model, "--redis-url", redis_url, *ENGINE_FLAGS]
        procs += start_services(
            ("prefill", "--kvd", kvd_a.address, "--instance-id", f"{model}-p0", *common),
            ("prefill", "--kvd", kvd_a.address, "--instance-id", f"{model}-p1", *common),
            ("decode", "--kvd", kvd_b.address, "--instance-id", f"{model}-d0",
             "--kvd-timeout", "3", *common))
        yield Cluster(model, redis_url, *procs)  # type: ignore[arg-type]
    finally:
        stop_all(procs)


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def cluster(request: pytest.FixtureRequest, redis_server: RedisServer) -> Iterator[Cluster]:
    yield from _start_cluster(request.param, redis_server.url)


@functools.cache
def llm(model: str) -> LLM:
    return LLM(model, num_blocks=96)


def offline(model: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return llm(model).generate([prompt], params)[0].token_ids


@functools.cache
def hf_model(model: str) -> transformers.PreTrainedModel:
    path = save_builtin(model, tempfile.mkdtemp(prefix=f"pdserve-{model}-"))
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model: str, prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(hf_model(model)(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


async def p_to_d(cluster: Cluster, prefill: Proc, rid: str, prompt: list[int],
                 max_tokens: int = MAX_TOKENS) -> tuple[engine_pb2.PrefillResponse, list[int]]:
    async with grpc.aio.insecure_channel(prefill.address) as pch, \
            grpc.aio.insecure_channel(cluster.decode.address) as dch:
        dest = cluster.endpoint(cluster.kvd_b)
        first = await Client(pch).prefill(rid, prompt, max_tokens, destination=dest,
                                          ignore_eos=True)
        chunks = await Client(dch).decode(rid, prompt, max_tokens, prefilled=first,
                                          ignore_eos=True)
    return first, [first.first_token_id, *tokens_of(chunks)]


async def engine_stats(proc: Proc) -> engine_pb2.EngineStats:
    async with grpc.aio.insecure_channel(proc.address) as ch:
        return await Client(ch).stats()


async def kvd_stats(proc: Proc) -> kvd_pb2.KvdStats:
    async with grpc.aio.insecure_channel(proc.address) as ch:
        return await kvd_pb2_grpc.KvdStub(ch).Stats(kvd_pb2.KvdStatsRequest(), timeout=10)


async def assert_nothing_held(cluster: Cluster) -> None:
    """Engines: no request, no referenced page. kvds: no pinned or in-flight slot."""
    for _ in range(100):  # releases and pushes finish asynchronously
        kvds = [await kvd_stats(k) for k in (cluster.kvd_a, cluster.kvd_b)]
        if all(k.slots_pinned == 0 and k.slots_in_flight == 0 for k in kvds):
            break
        await asyncio.sleep(0.05)
    assert [(k.slots_pinned, k.slots_in_flight) for k in kvds] == [(0, 0), (0, 0)]
    for proc in (cluster.prefill, cluster.prefill2, cluster.decode):
        stats = await engine_stats(proc)
        assert (stats.queue_depth, stats.num_running, stats.kv_blocks_used) == (0, 0, 0), proc


@pytest.mark.parametrize("name", sorted(PROMPTS))
async def test_prefill_then_decode_gives_the_offline_and_transformers_tokens(
        cluster: Cluster, name: str) -> None:
    prompt = PROMPTS[name]
    first, tokens = await p_to_d(cluster, cluster.prefill, f"{cluster.model}-{name}", prompt)
    assert len(first.blocks) == len(prompt) // 16
    assert list(first.tail_token_ids) == prompt[len(prompt) // 16 * 16:]
    assert tokens == offline(cluster.model, prompt)
    assert tokens == hf_greedy(cluster.model, prompt)
    await assert_nothing_held(cluster)


@pytest.mark.parametrize("cluster", ["tiny"], indirect=True)  # MoE: the parity test
async def test_shared_prefix_computes_only_new_tokens(cluster: Cluster) -> None:
    prefix = [(17 * i) % 250 + 2 for i in range(64)]
    first_prompt, second_prompt = prefix + [3, 4, 5], prefix + [9, 8, 7, 6, 5, 4, 3]
    await p_to_d(cluster, cluster.prefill, f"{cluster.model}-pre-a", first_prompt)
    for prefill in (cluster.prefill, cluster.prefill2):  # engine cache, then kvd A's pool
        before = await engine_stats(prefill)
        first, tokens = await p_to_d(cluster, prefill, f"{cluster.model}-pre-b-{prefill.port}",
                                     second_prompt)
        after = await engine_stats(prefill)
        assert first.cached_tokens == len(prefix)
        computed = after.prefill_tokens_computed - before.prefill_tokens_computed
        assert computed == len(second_prompt) - len(prefix)
        assert tokens == offline(cluster.model, second_prompt)
    await assert_nothing_held(cluster)


@pytest.mark.parametrize("cluster", ["tiny"], indirect=True)  # MoE: the parity test
async def test_ten_concurrent_requests_finish_and_leak_nothing(cluster: Cluster) -> None:
    prompts = [[(7 * i + j) % 250 + 2 for j in range(5 + 9 * i)] for i in range(10)]
    results = await asyncio.gather(*[
        p_to_d(cluster, cluster.prefill, f"{cluster.model}-c{i}", p)
        for i, p in enumerate(prompts)])
    for prompt, (_, tokens) in zip(prompts, results, strict=True):
        assert tokens == offline(cluster.model, prompt)
    await assert_nothing_held(cluster)


@pytest.mark.parametrize("cluster", ["tiny"], indirect=True)  # MoE: the parity test
async def test_cancelled_decode_frees_its_blocks(cluster: Cluster) -> None:
    prompt = PROMPTS["many_blocks"]
    rid = f"{cluster.model}-cancel"
    async with grpc.aio.insecure_channel(cluster.prefill.address) as pch, \
            grpc.aio.insecure_channel(cluster.decode.address) as dch:
        first = await Client(pch).prefill(rid, prompt, 500, ignore_eos=True,
                                          destination=cluster.endpoint(cluster.kvd_b))
        call = Client(dch).decode_stream(rid, prompt, 500, prefilled=first, ignore_eos=True)
        seen = 0
        async for chunk in call:
            seen += len(chunk.token_ids)
            if seen >= 3:
                break
        call.cancel()
    await assert_nothing_held(cluster)


@pytest.mark.parametrize("cluster", ["tiny"], indirect=True)  # MoE: the parity test
async def test_blocks_that_never_arrive_fail_with_deadline_exceeded(cluster: Cluster) -> None:
    prompt = [(19 * i) % 250 + 2 for i in range(40)]  # never prefilled anywhere
    fingerprint = llm(cluster.model).engine.fingerprint
    refs = [common_pb2.BlockRef(hash=h, checksum=1) for h in hash_blocks(prompt, 16, fingerprint)]
    with socket.socket() as blackhole:  # a "kvd" that accepts connections and never answers
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(8)
        source = common_pb2.KvdEndpoint(node_id="ghost",
                                        address=f"127.0.0.1:{blackhole.getsockname()[1]}")
        # Registered in the index like a real node (an unregistered source is refused:
        # test_an_unregistered_source_is_refused), so the decode's kvd does try it.
        index = RedisPrefixIndex(cluster.redis_url)
        await index.register_node(NodeRecord("ghost", source.address, b"ucx", 1, 1), ttl=60)
        await index.close()
        fake = engine_pb2.PrefillResponse(first_token_id=5, blocks=refs, source=source)
        async with grpc.aio.insecure_channel(cluster.decode.address) as dch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                # The client allows 20 s: the decode's own --kvd-timeout (3 s) must end it.
                await Client(dch).decode(f"{cluster.model}-lost", prompt, 4, prefilled=fake,
                                         timeout=20)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await assert_nothing_held(cluster)


@pytest.mark.parametrize("cluster", ["tiny"], indirect=True)
async def test_an_unregistered_source_is_refused(cluster: Cluster) -> None:
    """A forged pull source: the decode node's kvd would send its credential there and take
    whatever bytes came back. It refuses before connecting."""
    prompt = [(23 * i) % 250 + 2 for i in range(40)]
    fingerprint = llm(cluster.model).engine.fingerprint
    refs = [common_pb2.BlockRef(hash=h, checksum=1) for h in hash_blocks(prompt, 16, fingerprint)]
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(0.5)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        fake = engine_pb2.PrefillResponse(first_token_id=5, blocks=refs, source=common_pb2.
                                          KvdEndpoint(node_id="forged", address=address))
        async with grpc.aio.insecure_channel(cluster.decode.address) as dch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await Client(dch).decode(f"{cluster.model}-forged", prompt, 4, prefilled=fake,
                                         timeout=20)
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody ever connected
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert f"source: {address} is not a registered kvd node" in (err.value.details() or "")
    await assert_nothing_held(cluster)
