"""The in-place actuator against a real flex engine process with its planes' credentials set,
as ``pdserve up`` runs it: the admin credential is what lets the controller switch roles."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve import auth
from pdserve.controller.actuator import ActuationError, InPlaceActuator
from pdserve.controller.monitor import GrpcStatsSource
from pdserve.controller.optimizer import Plan
from tests.services.harness import Proc, start_service

DATA, ADMIN = "data-secret-15", "admin-secret-15"


@pytest.fixture(scope="module")
def flex_engine() -> Iterator[Proc]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(auth.DATA.var, DATA)
        mp.setenv(auth.ADMIN.var, ADMIN)
        proc = start_service("prefill", "--role", "flex", "--model", "tiny", "--num-blocks", "32",
                             "--threads", "1")
    yield proc
    proc.stop()


def _creds(admin: str) -> list[tuple[str, str]]:
    return [(auth.DATA.key, DATA), (auth.ADMIN.key, admin)]


async def test_switches_with_the_admin_credential_only(flex_engine: Proc) -> None:
    wrong = InPlaceActuator([flex_engine.address], credentials=_creds("not-the-admin-secret"))
    with pytest.raises(ActuationError, match=r"Drain on 127\.0\.0\.1:\d+ failed: "
                                             "PERMISSION_DENIED: Engine/Drain needs the admin"):
        await wrong.apply(Plan(0, 1))
    right = InPlaceActuator([flex_engine.address], credentials=_creds(ADMIN))
    [flip] = await right.apply(Plan(0, 1))
    assert flip.to_role == "decode" and flip.num_in_flight == 0
    [sample] = await GrpcStatsSource([flex_engine.address], credentials=_creds(ADMIN)).sample()
    assert sample.role == "decode" and sample.is_flex and not sample.draining
    [flip] = await right.apply(Plan(1, 0))
    assert flip.to_role == "prefill"
    await wrong.close()
    await right.close()


async def test_stats_without_the_data_credential_are_left_out(flex_engine: Proc) -> None:
    assert await GrpcStatsSource([flex_engine.address], credentials=[]).sample() == []
