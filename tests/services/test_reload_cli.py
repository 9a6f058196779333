"""``pdserve reload``'s plan before it touches anything: the order (prefill and decode
interleaved, so a same-version pair forms early) and the refusal to take out a role's only
engine; its errors as the operator sees them."""

from __future__ import annotations

import pytest

from pdserve.proto.v1 import common_pb2, router_pb2
from services.reload import ReloadError, check_capacity, held_secrets, main, order

P, D, C = common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE, common_pb2.ROLE_COLOCATED


def states(*pairs: tuple[str, int]) -> list[router_pb2.InstanceState]:
    return [router_pb2.InstanceState(instance_id=name, role=role, healthy=True)
            for name, role in pairs]


def test_order_interleaves_prefill_and_decode_then_colocated() -> None:
    got = order(states(("d1", D), ("c0", C), ("p1", P), ("d0", D), ("p0", P), ("p2", P)))
    assert [i.instance_id for i in got] == ["p0", "d0", "p1", "d1", "p2", "c0"]


def test_a_roles_only_engine_is_not_taken_out() -> None:
    check_capacity(states(("p0", P), ("p1", P), ("d0", D), ("d1", D)))
    with pytest.raises(ReloadError, match="d0 is the only decode engine: while it reloads "
                                          "nothing could serve"):
        check_capacity(states(("p0", P), ("p1", P), ("d0", D)))


def test_secrets_dir_must_exist(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ReloadError, match="--secrets: '/no/such/dir' is not a directory"):
        held_secrets("/no/such/dir")
    (tmp_path / "PDSERVE_ADMIN_SECRET").write_text("s3cret\n")
    assert held_secrets(str(tmp_path))["admin"] == "s3cret"


def test_an_unreachable_router_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--model", "x", "--router", "127.0.0.1:1", "--timeout", "2"])
    assert code == 1
    assert "pdserve reload: error: UNAVAILABLE" in capsys.readouterr().err
