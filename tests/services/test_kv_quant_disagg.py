"""Prefill -> kvd -> kvd -> decode with a quantized KV cache (real processes, UCX, Redis): the
int8 blocks (values and scales) cross as they are, and the decode continues with exactly the
tokens an offline engine with the same cache dtype produces."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams
from tests.conftest import RedisServer
from tests.services.harness import Client, Proc, start_services, stop_all, tokens_of
from tests.services.test_disaggregated import ENGINE_FLAGS, MAX_TOKENS, PROMPTS

KV = "int8"


@pytest.fixture(scope="module")
def procs(redis_server: RedisServer) -> Iterator[list[Proc]]:
    started: list[Proc] = []
    url = redis_server.url
    try:
        started += start_services(*[("kvd", "--capacity-mib", "16", "--redis-url", url)] * 2)
        kvd_a, kvd_b = started
        common = ["--model", "tiny", "--redis-url", url, "--kv-cache-dtype", KV, *ENGINE_FLAGS]
        started += start_services(
            ("prefill", "--kvd", kvd_a.address, "--instance-id", "q-p0", *common),
            ("decode", "--kvd", kvd_b.address, "--instance-id", "q-d0", "--kvd-timeout", "3",
             *common))
        yield started
    finally:
        stop_all(started)


async def test_quantized_blocks_cross_kvds_and_decode_matches_offline(procs: list[Proc]
                                                                      ) -> None:
    from pdserve.proto.v1 import common_pb2

    kvd_b, prefill, decode = procs[1], procs[2], procs[3]
    prompt = PROMPTS["many_blocks"]
    async with grpc.aio.insecure_channel(prefill.address) as pch, \
            grpc.aio.insecure_channel(decode.address) as dch:
        dest = common_pb2.KvdEndpoint(node_id=f"node-{kvd_b.port}", address=kvd_b.address)
        first = await Client(pch).prefill("q-1", prompt, MAX_TOKENS, destination=dest,
                                          ignore_eos=True)
        chunks = await Client(dch).decode("q-1", prompt, MAX_TOKENS, prefilled=first,
                                          ignore_eos=True)
        stats = await Client(dch).stats()
    assert len(first.blocks) == len(prompt) // 16
    assert stats.kv_fingerprint.endswith("|kv=int8|NHD")
    offline = LLM("tiny", num_blocks=96, max_num_batched_tokens=32, kv_cache_dtype=KV)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    assert [first.first_token_id, *tokens_of(chunks)] == offline.generate(
        [prompt], params)[0].token_ids
    # The decode imported every full block (it did not recompute them).
    assert stats.prefill_tokens_computed <= len(prompt) - 16 * len(first.blocks) + 1
