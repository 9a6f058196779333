"""Issue 20: a 3-node cluster in network namespaces (2 prefill nodes, 1 decode node, each a kvd
and an engine; Redis and router + gateway in namespaces of their own), served through the
official ``openai`` client, with the faults only a network has.

Defined outcomes, each asserted below:
- partition of the node whose kvd is sending a request's KV (its link down mid-transfer):
  the decode node's kvd abandons the transfer (no progress for ``transfer_timeout``), the
  decode answers ABORTED, the router prefills the prompt again on the other prefill node and
  the client gets the reference text; the router takes the node out within seconds, the
  index stops counting its blocks (its record expires); when the link returns the node is
  routed to again, the index re-learns its blocks and its kvd ships over UCX again, without a
  restart; no pin or engine block is left held anywhere.
- node loss (namespace destroyed with its processes) mid-transfer: the same fail-over; new
  requests are routed around it within 10 s.
- Redis unreachable from one node only: requests are served as before (Redis is soft state);
  that node's kvd reports the index unavailable and its blocks drop out of lookups; when the
  route returns they are re-learned.
- the decode node partitioned while it streams an answer: the router's keepalive pings find
  the connection dead, the client has the tokens so far and a clear error within seconds; new
  requests fail fast while no decode node is reachable; the node rejoins when the link returns.
The tests share one cluster and run in file order; node loss comes last.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from dataclasses import dataclass

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pdserve import LLM
from pdserve.hashing import block_checksum
from pdserve.index import RedisPrefixIndex
from pdserve.kvd.client import CommitEntry, KvdClient
from pdserve.kvd.layout import BlockLayout
from pdserve.proto.v1 import common_pb2
from pdserve_bench.cluster import REDIS, NetnsCluster
from tests.cluster.conftest import (
    MAX_TOKENS,
    SPEC,
    engine_stats,
    eventually,
    kvd_stats,
    reference,
)

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. " * 6]


def client(cluster: NetnsCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key=cluster.api_key, max_retries=0,
                         timeout=60)


def complete(cluster: NetnsCluster, prompt: str) -> str:
    resp = client(cluster).completions.create(model="tiny", prompt=prompt,
                                              max_tokens=MAX_TOKENS, temperature=0)
    return resp.choices[0].text


@dataclass
class Background:
    """One completion running in a thread while a test breaks the network."""

    text: str | None = None
    error: BaseException | None = None
    seconds: float = 0.0

    def run(self, cluster: NetnsCluster, prompt: str) -> threading.Thread:
        def go() -> None:
            start = time.monotonic()
            try:
                self.text = complete(cluster, prompt)
            except BaseException as exc:  # noqa: BLE001 - the test asserts on it
                self.error = exc
            self.seconds = time.monotonic() - start

        thread = threading.Thread(target=go, daemon=True)
        thread.start()
        return thread


def sender_mid_transfer(cluster: NetnsCluster) -> str:
    """The prefill node whose kvd holds transfer pins while the decode node's kvd has the
    blocks in flight: its bytes are announced, not yet delivered."""

    def find() -> str | None:
        for node in SPEC.prefill_nodes:
            if kvd_stats(cluster, node).slots_pinned > 0:
                return node
        return None

    node = eventually(find, 10, "a prefill kvd sending")
    assert kvd_stats(cluster, "d0").slots_in_flight > 0
    return node


def indexed_nodes(cluster: NetnsCluster, hashes: list[bytes]) -> set[str]:
    """Nodes the prefix index answers as holding the first of ``hashes`` (one lookup)."""

    async def lookup() -> dict[str, int]:
        index = RedisPrefixIndex(cluster.redis_url)
        try:
            return await index.lookup(hashes[:1])
        finally:
            await index.close()

    return set(asyncio.run(lookup()))


def nothing_held(cluster: NetnsCluster) -> bool:
    """No kvd pin, no slot in flight or being written, no engine block in use, anywhere."""
    for node in cluster.nodes:
        if node in cluster.net.lost:
            continue
        k, e = kvd_stats(cluster, node), engine_stats(cluster, node)
        if k.slots_pinned or k.slots_in_flight or k.slots_writing or e.kv_blocks_used:
            return False
    return True


def put_blocks(cluster: NetnsCluster, llm: LLM, src: str, dst: str | None = None,
               n: int = 3) -> list[bytes]:
    """``n`` fresh blocks written on ``src``'s kvd and committed (their hashes); with ``dst``,
    pushed there and checked to arrive bit-exact over the kvd -> kvd data path."""
    engine, cfg = llm.engine, llm.engine.config  # the layout the engines registered
    layout = BlockLayout(cfg.num_layers, engine.kv.block_size, cfg.num_kv_heads, cfg.head_dim,
                         engine.kv_dtype, engine.fingerprint)

    async def go() -> list[bytes]:
        secret = cluster.data_secret
        a = KvdClient(cluster.kvd_address(src), f"test-{src}", secret=secret)
        b = KvdClient(cluster.kvd_address(dst), f"test-{dst}", secret=secret) if dst else None
        try:
            await a.register(layout)
            pins = await a.allocate(n)
            for p in pins:
                view = a.slot_view(p.slot)
                view.copy_(torch.randn(view.shape).to(view.dtype))
            want = [bytes(a.slot_memory(p.slot)) for p in pins]
            sums = [block_checksum(a.slot_memory(p.slot)) for p in pins]
            hashes = [time.time_ns().to_bytes(16, "big") + i.to_bytes(16, "big")
                      for i in range(n)]
            dest = (common_pb2.KvdEndpoint(node_id=cluster.kvd_node_id(dst),
                                           address=cluster.kvd_address(dst)) if dst else None)
            await a.commit([CommitEntry(p, h) for p, h in zip(pins, hashes, strict=True)],
                           dest, release=True)
            if b is not None:
                await b.register(layout)
                refs = [common_pb2.BlockRef(hash=h, checksum=s)
                        for h, s in zip(hashes, sums, strict=True)]
                got = await b.await_blocks(refs, timeout=10)
                assert [bytes(b.slot_memory(p.slot)) for p in got] == want
                await b.release([p.pin_id for p in got])
            return hashes
        finally:
            await a.close()
            if b is not None:
                await b.close()

    return asyncio.run(go())


def indexed_blocks(cluster: NetnsCluster, llm: LLM) -> dict[str, list[bytes]]:
    """Fresh blocks on every prefill node's kvd, once the index answers that it holds them."""
    out = {}
    for node in SPEC.prefill_nodes:
        hashes = put_blocks(cluster, llm, node)
        eventually(lambda n=node, h=hashes: cluster.kvd_node_id(n) in indexed_nodes(cluster, h),
                   10, f"{node}'s blocks in the index")
        out[node] = hashes
    return out


def lanes(cluster: NetnsCluster, node: str) -> dict[tuple[str, str], float]:
    """kvd's ``pdserve_kvd_ucx_lanes``: (peer, transport/device) -> lanes (UCX's report)."""
    out = {}
    for fam in text_string_to_metric_families(cluster.kvd_metrics(node)):
        for s in fam.samples:
            if s.name == "pdserve_kvd_ucx_lanes":
                out[(s.labels["peer"], s.labels["transport"])] = s.value
    return out


def test_three_nodes_serve_the_reference_text_over_tcp(cluster: NetnsCluster,
                                                       llm: LLM) -> None:
    for prompt in PROMPTS:
        assert complete(cluster, prompt) == reference(llm, prompt)
    # the multi-block prompt's KV crossed from a prefill node to the decode node
    assert kvd_stats(cluster, "d0").bytes_in > 0
    # UCX's own report: between nodes only TCP on the namespace's interface, no shared memory
    got = lanes(cluster, "d0")
    assert got and {t for _, t in got} == {"tcp/eth0"}, got
    assert {p for p, _ in got} <= {cluster.kvd_node_id(n) for n in SPEC.prefill_nodes}
    for peer, _ in got:
        assert f"ucx endpoint peer={peer} transports=tcp/eth0" in cluster.log("kvd-d0")
    # every listening socket (gRPC, HTTP, metrics, Redis, UCX's TCP listener) binds its
    # namespace's address, never 0.0.0.0
    for name, node in cluster.net.nodes.items():
        out = subprocess.run([*node.exec_args(), "ss", "-Hltnu"], capture_output=True,
                             text=True, check=True).stdout
        bound = {line.split()[4].rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")
                 for line in out.splitlines() if line.strip()}
        assert bound == {node.ip}, (name, out)


def test_redis_unreachable_from_one_node(cluster: NetnsCluster, llm: LLM) -> None:
    node, node_id = "p0", cluster.kvd_node_id("p0")
    held = indexed_blocks(cluster, llm)[node]
    cluster.net.blackhole(node, cluster.ip(REDIS))
    try:
        eventually(lambda: not kvd_stats(cluster, node).index_available, 10,
                   f"{node}'s kvd noticing Redis is gone")
        eventually(lambda: node_id not in indexed_nodes(cluster, held), 10,
                   f"the index dropping {node}'s blocks")
        assert all(kvd_stats(cluster, n).index_available for n in cluster.nodes if n != node)
        for prompt in ("Redis is out of reach of one node. " * 4, PROMPTS[1]):
            assert complete(cluster, prompt) == reference(llm, prompt)
        assert cluster.healthy() == set(cluster.nodes)  # still routed to: Redis is soft state
    finally:
        cluster.net.unblackhole(node, cluster.ip(REDIS))
    eventually(lambda: kvd_stats(cluster, node).index_available, 10,
               f"{node}'s kvd reaching Redis again")
    eventually(lambda: node_id in indexed_nodes(cluster, held), 10,
               f"the index re-learning {node}'s blocks")
    eventually(lambda: nothing_held(cluster), 10, "every pin released")


def test_partition_mid_transfer_fails_over_and_leaks_nothing(cluster: NetnsCluster,
                                                             llm: LLM) -> None:
    prompt = "A partition cuts this transfer short. " * 6
    held_by = indexed_blocks(cluster, llm)
    victim = Background()
    thread = victim.run(cluster, prompt)
    node = sender_mid_transfer(cluster)
    other, held = next(n for n in SPEC.prefill_nodes if n != node), held_by[node]
    cluster.net.link_down(node)
    down = time.monotonic()
    try:
        thread.join(30)
        # failed over: prefilled again on the other node, within the transfer timeout
        assert victim.error is None and victim.text == reference(llm, prompt)
        assert time.monotonic() - down < SPEC.transfer_timeout + 5
        eventually(lambda: node not in cluster.healthy(), 10, f"the router dropping {node}")
        during = "Served while a node is cut off. " * 4
        assert complete(cluster, during) == reference(llm, during)
        eventually(lambda: cluster.kvd_node_id(node) not in indexed_nodes(cluster, held), 10,
                   f"the index dropping the partitioned {node}'s blocks")
    finally:
        cluster.net.link_up(node)
    cluster.wait_routable(15)
    eventually(lambda: cluster.kvd_node_id(node) in indexed_nodes(cluster, held), 15,
               f"the index re-learning {node}'s blocks")
    eventually(lambda: nothing_held(cluster), 10, "every pin released after the partition")
    # no restart: the healed node's kvd ships to the decode node over a new UCX endpoint
    put_blocks(cluster, llm, node, "d0")
    put_blocks(cluster, llm, other, "d0")
    assert complete(cluster, prompt) == reference(llm, prompt)
    eventually(lambda: nothing_held(cluster), 10, "every pin released")


def test_decode_node_partitioned_mid_stream_fails_fast(cluster: NetnsCluster,
                                                        llm: LLM) -> None:
    """The router's keepalive finds the stream's connection dead: the client gets the tokens
    so far and a clear error in seconds, not at its deadline; the node rejoins afterwards."""
    chunks: list[str] = []
    failure: list[BaseException] = []

    def stream() -> None:
        try:
            for c in client(cluster).completions.create(
                    model="tiny", prompt="Stream a long answer. " * 4, max_tokens=400,
                    temperature=0, stream=True):
                chunks.append(c.choices[0].text if c.choices else "")
        except BaseException as exc:  # noqa: BLE001 - asserted below
            failure.append(exc)

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    eventually(lambda: len(chunks) >= 3, 20, "the answer streaming")
    cluster.net.link_down("d0")
    down = time.monotonic()
    try:
        thread.join(20)
        assert failure, "the stream neither failed nor ended while its decode node was cut off"
        assert time.monotonic() - down < 10
        assert "decode on d0 failed after" in str(failure[0])
        eventually(lambda: "d0" not in cluster.healthy(), 10, "the router dropping d0")
        # No decode node left: the router waits for one to come back (--max-wait, 30 s), but
        # never past the client's deadline, then says why.
        asked = time.monotonic()
        with pytest.raises(openai.APIError) as err:
            client(cluster).completions.create(
                model="tiny", prompt="Nowhere to decode. " * 4, max_tokens=MAX_TOKENS,
                temperature=0, extra_headers={"X-Request-Timeout": "3"})
        assert time.monotonic() - asked < 6
        assert "no capacity" in str(err.value) and "none came back within" in str(err.value)
    finally:
        cluster.net.link_up("d0")
    cluster.wait_routable(15)
    prompt = "Back on the network. " * 4
    assert complete(cluster, prompt) == reference(llm, prompt)
    eventually(lambda: nothing_held(cluster), 15, "every pin and engine block released")


def test_node_loss_is_routed_around_within_10s(cluster: NetnsCluster, llm: LLM) -> None:
    prompt = "This node will not come back. " * 6
    held_by = indexed_blocks(cluster, llm)
    victim = Background()
    thread = victim.run(cluster, prompt)
    node = sender_mid_transfer(cluster)
    held = held_by[node]
    cluster.net.destroy(node)
    lost = time.monotonic()
    thread.join(30)
    assert victim.error is None and victim.text == reference(llm, prompt)
    after = "Served after a node was lost. " * 4
    assert complete(cluster, after) == reference(llm, after)
    assert time.monotonic() - lost < 10
    eventually(lambda: node not in cluster.healthy(), 10 - (time.monotonic() - lost),
               f"the router dropping the lost {node}")
    eventually(lambda: cluster.kvd_node_id(node) not in indexed_nodes(cluster, held), 10,
               f"the index dropping the lost {node}'s blocks")
    assert cluster.net[node].netns not in cluster.net.leftovers()
    eventually(lambda: nothing_held(cluster), 10, "every pin released after the loss")

