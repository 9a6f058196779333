"""``choose_flips``: which flex engines switch, to what, and in which order, for every move
between prefill/decode splits and colocated (pure: Stats samples in, flips out)."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.controller.actuator import ActuationError, choose_flips
from pdserve.controller.monitor import Sample
from pdserve.controller.optimizer import Plan


def _engines(*specs: str) -> list[Sample]:
    """``"p2"``: a prefill engine with 2 requests queued or running, at address ``e<i>``."""
    role = {"p": "prefill", "d": "decode", "c": "colocated", "f": "prefill"}
    return [Sample(f"i{i}", f"e{i}", 0.0, role[s[0]], s[0] != "f", False, int(s[1:]), 0, 0,
                   0, 0.0, 0.0, 0, 0, 0) for i, s in enumerate(specs)]


def _flips(engines: list[Sample], plan: Plan) -> list[str]:
    return [f"{s.address}->{role}" for s, role in choose_flips(engines, plan)]


@pytest.mark.parametrize(("engines", "plan", "flips"), [
    # prefill <-> decode: the least busy of the role over its target leaves
    (["p3", "p1", "d0"], Plan(1, 2), ["e1->decode"]),
    (["p0", "d5", "d2"], Plan(2, 1), ["e2->prefill"]),
    (["p0", "d0"], Plan(1, 1), []),  # the plan in force
    # to colocated: the decode engine first (a colocated engine serves while the rest follow)
    (["p0", "d4"], Plan(0, 0, 2), ["e1->colocated", "e0->colocated"]),
    (["p1", "p0", "d2"], Plan(0, 0, 3), ["e2->colocated", "e1->colocated", "e0->colocated"]),
    # from colocated: the least busy first; the last colocated engine goes last
    (["c2", "c0"], Plan(1, 1), ["e1->decode", "e0->prefill"]),
    (["c0", "c1", "c2"], Plan(2, 1), ["e0->decode", "e1->prefill", "e2->prefill"]),
    (["c0", "c1", "c2"], Plan(1, 2), ["e0->decode", "e1->prefill", "e2->decode"]),
    # half way (a failed switch): colocated leaves before the other disaggregated role
    (["p0", "c0"], Plan(1, 1), ["e1->decode"]),
    (["p0", "c3", "d0"], Plan(0, 0, 3), ["e2->colocated", "e0->colocated"]),
    # a fixed-role engine is not the controller's to move
    (["f0", "p0", "d0"], Plan(0, 0, 2), ["e2->colocated", "e1->colocated"]),
])
def test_flips_reach_the_plan_keeping_capacity(engines: list[str], plan: Plan,
                                               flips: list[str]) -> None:
    assert _flips(_engines(*engines), plan) == flips


def test_a_plan_for_another_number_of_engines_is_refused() -> None:
    with pytest.raises(ActuationError, match=r"plan colocated=3 needs 3 flex engines, 2 "
                                             "answered Stats"):
        choose_flips(_engines("p0", "d0"), Plan(0, 0, 3))


def test_an_engine_that_reports_no_role_is_refused() -> None:
    engines = _engines("p0", "d0")
    engines[1] = dataclasses.replace(engines[1], role="unknown")
    with pytest.raises(ActuationError, match=r"flex engines \['e1'\] report no role"):
        choose_flips(engines, Plan(1, 1))
