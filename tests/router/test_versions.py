"""Hot reload at the router: prefill and decode of one weights version only (one block
fingerprint), the larger group first and the newest of equal ones, so the old version drains
as a rolling reload proceeds; the decode's version reaches the client in usage."""

from __future__ import annotations

from tests.router.conftest import Cluster
from tests.router.fakes import FakeEngine

PROMPT = list(range(10, 10 + 16 * 2))


def set_version(engine: FakeEngine, version: str) -> None:
    engine.stats.model_version = version
    engine.stats.kv_fingerprint = f"fp-{version}|kv=float32|NHD"


async def placements(client, n: int) -> list[tuple[str, str, str]]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(n):
        msgs = await client.generate(ids=PROMPT)
        out.append((msgs[0].placement.prefill_instance, msgs[0].placement.decode_instance,
                    msgs[-1].usage.model_version))
    return out


async def test_pairs_one_version_and_prefers_the_newest_of_equal_groups(
        cluster: Cluster) -> None:
    p1, p2 = await cluster.engine("P1", "prefill"), await cluster.engine("P2", "prefill")
    d1, d2 = await cluster.engine("D1", "decode"), await cluster.engine("D2", "decode")
    for e in (p1, p2, d1, d2):
        set_version(e, "v1")
    router, client = await cluster.router([p1, p2], [d1, d2], policy="round_robin")
    assert {p for p, _, _ in await placements(client, 4)} == {"P1", "P2"}
    # The old version's group is listed first, so only the tie-break makes v2 win below.
    set_version(p2, "v2")  # reloaded first: no v2 decode yet, so v1 serves on
    await router.poll()
    assert set(await placements(client, 3)) == {("P1", "D1", "v1"), ("P1", "D2", "v1")}
    set_version(d2, "v2")  # a v2 pair, as large as what is left of v1: the newest wins
    await router.poll()
    assert set(await placements(client, 3)) == {("P2", "D2", "v2")}
    state = {i.instance_id: i.model_version for i in router.cluster_state().instances}
    assert state == {"P1": "v1", "P2": "v2", "D1": "v1", "D2": "v2"}


async def test_the_larger_group_serves_until_the_new_one_catches_up(cluster: Cluster) -> None:
    engines = [await cluster.engine(f"P{i}", "prefill") for i in range(3)]
    decodes = [await cluster.engine(f"D{i}", "decode") for i in range(2)]
    for e in (*engines, *decodes):
        set_version(e, "v1")
    router, client = await cluster.router(engines, decodes, policy="round_robin")
    set_version(engines[0], "v2")
    set_version(decodes[0], "v2")  # v2: 2 instances, v1: 3
    await router.poll()
    for p, d, version in await placements(client, 4):
        assert (p, d, version) in {("P1", "D1", "v1"), ("P2", "D1", "v1")}


async def test_a_decode_reloaded_after_placement_is_not_handed_old_blocks(
        cluster: Cluster) -> None:
    """Placed on a decode that a rolling reload swaps while the prompt is prefilled: the
    blocks go to a decode still serving their version instead."""
    p = await cluster.engine("P", "prefill")
    decodes = [await cluster.engine(f"D{i}", "decode") for i in range(2)]
    for e in (p, *decodes):
        set_version(e, "v1")
    router, client = await cluster.router([p], decodes)

    async def reload_the_chosen_decode(request) -> None:  # type: ignore[no-untyped-def]
        chosen = next(d for d in decodes if d.node == request.destination.node_id)
        set_version(chosen, "v2")
        await router.poll()
        p.on_prefill = None

    p.on_prefill = reload_the_chosen_decode
    msgs = await client.generate(ids=PROMPT)
    chosen = msgs[0].placement.decode_instance
    other = next(d for d in decodes if d.name != chosen)
    assert [d.name for d in decodes if d.seen.decodes] == [other.name]
    assert msgs[-1].usage.model_version == "v1"
