"""Mid-stream failover against scripted engines: what the router asks of the next prefill and
decode when a decode dies after tokens went out, and when it gives up."""

from __future__ import annotations

import grpc
import pytest

from pdserve.proto.v1 import common_pb2
from tests.router.conftest import Cluster, request

PROMPT = list(range(10, 10 + 16 * 3))


async def _stream(client, max_tokens: int = 8) -> tuple[list[list[int]], list]:
    call = client.stub.Generate(request(ids=PROMPT, max_tokens=max_tokens), timeout=10)
    messages = [m async for m in call]
    return [list(m.token_ids) for m in messages], messages


async def test_a_decode_dying_mid_stream_hands_the_answer_so_far_to_another(
        cluster: Cluster) -> None:
    p = await cluster.engine("P", "prefill")
    d1, d2 = await cluster.engine("D1", "decode"), await cluster.engine("D2", "decode")
    d1.decode_fail_after = 2  # sends 100, 101, then dies
    _, client = await cluster.router([p], [d1, d2], policy="round_robin")
    got, messages = await _stream(client)
    # The client's stream goes on: D2's (scripted) tokens follow the ones D1 sent.
    assert got == [[7], [100], [101], [100], [101], [102]]
    again = p.seen.prefills[1]  # the prompt and the answer but its last token, for their KV
    assert list(again.prompt_token_ids) == [*PROMPT, 7, 100]
    assert again.sampling.temperature == 0 and again.sampling.ignore_eos
    resumed = d2.seen.decodes[0]
    assert list(resumed.prompt_token_ids) == [*PROMPT, 7, 100]
    assert resumed.first_token_id == 101  # the last token sent, as a prefill's first
    assert resumed.prior_output == 2  # 7 and 100 are output: text and stops go on after them
    assert resumed.sampling.max_tokens == 8 - 2
    assert len(resumed.blocks) == len(again.prompt_token_ids) // 4  # the new prefill's
    usage = messages[-1].usage
    assert usage.failovers == 1 and usage.completion_tokens == 6
    assert usage.prompt_tokens == len(PROMPT)


async def test_without_a_healthy_prefill_the_next_decode_computes_the_kv(
        cluster: Cluster) -> None:
    p = await cluster.engine("P", "prefill")
    d1, d2 = await cluster.engine("D1", "decode"), await cluster.engine("D2", "decode")
    d1.decode_fail_after = 1
    _, client = await cluster.router([p], [d1, d2], policy="round_robin")

    async def then_gone(_: object) -> None:  # the re-prefill finds P gone
        p.prefill_errors, p.on_prefill = [grpc.StatusCode.UNAVAILABLE], None
    p.on_prefill = then_gone
    got, messages = await _stream(client)
    assert got == [[7], [100], [100], [101], [102]]
    resumed = d2.seen.decodes[0]
    assert list(resumed.prompt_token_ids) == [*PROMPT, 7] and resumed.first_token_id == 100
    assert resumed.prior_output == 1 and not resumed.blocks  # no blocks: computed there
    assert messages[-1].usage.failovers == 1


async def test_failovers_stop_at_max_retries_with_the_reason(cluster: Cluster) -> None:
    p = await cluster.engine("P", "prefill")
    engines = [await cluster.engine(f"D{i}", "decode") for i in range(3)]
    for d in engines:
        d.decode_fail_after = 1
    _, client = await cluster.router([p], engines, policy="round_robin", max_retries=1)
    call = client.stub.Generate(request(ids=PROMPT), timeout=10)
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for m in call:
            got.append(list(m.token_ids))
    assert got == [[7], [100], [100]]  # one failover, then its decode died too
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "1 failovers already" in err.value.details()


async def test_a_finished_answer_reports_no_failover(cluster: Cluster) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    _, client = await cluster.router([p], [d])
    _, messages = await _stream(client)
    assert messages[-1].usage.failovers == 0
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


async def test_a_colocated_engine_dying_mid_stream_fails_over_to_another(
        cluster: Cluster) -> None:
    c1, c2 = await cluster.engine("C1", "colocated"), await cluster.engine("C2", "colocated")
    c1.decode_fail_after = 2  # sends 100, 101, then dies
    _, client = await cluster.router([], [c1, c2], policy="round_robin")
    got, messages = await _stream(client)
    assert got == [[100], [101], [100], [101], [102]]
    resumed = c2.seen.decodes[0]  # no prefill engine: C2 computes the KV of the answer so far
    assert list(resumed.prompt_token_ids) == [*PROMPT, 100] and resumed.first_token_id == 101
    assert resumed.prior_output == 1 and resumed.sampling.max_tokens == 8 - 1
    assert [m.HasField("placement") for m in messages].count(True) == 1
    assert messages[-1].usage.failovers == 1
