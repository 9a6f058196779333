"""Flag, config and layout validation: each error names its field."""

from __future__ import annotations

import pytest

from pdserve.kvd.layout import BlockLayout
from services.kvd.config import KvdConfig
from services.kvd.transfer import Message, plan_messages


@pytest.mark.parametrize("kwargs,field", [
    ({"host": ""}, "--host"),
    ({"capacity_mib": 0}, "--capacity-mib"),
    ({"transfer_timeout": 0.0}, "--transfer-timeout"),
    ({"max_batch_blocks": 0}, "--max-batch-blocks"),
    ({"copy_threads": 0}, "--copy-threads"),
    ({"copy_threads": 65}, "--copy-threads"),
    ({"redis_url": "http://x"}, "--redis-url"),
])
def test_config_errors_name_the_flag(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        KvdConfig(**kwargs)  # type: ignore[arg-type]


def test_flags_and_env_twins() -> None:
    cfg = KvdConfig.from_argv(["--capacity-mib", "8", "--fault-corrupt-every", "3"])
    assert cfg.capacity_mib == 8 and cfg.fault_corrupt_every == 3 and cfg.ucx_tls == "^cma"
    assert cfg.copy_threads == 2 and KvdConfig.from_argv(["--copy-threads", "1"]).copy_threads == 1


@pytest.mark.parametrize("kwargs,field", [
    ({"num_layers": 0}, "layout.num_layers"),
    ({"head_dim": -1}, "layout.head_dim"),
    ({"dtype": "fp4"}, "layout.dtype"),  # (int8 and float8_e4m3fn are quantized KV)
])
def test_layout_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    base: dict[str, object] = {"num_layers": 2, "block_size": 16, "num_kv_heads": 2,
                               "head_dim": 32, "dtype": "float16"}
    with pytest.raises(ValueError, match=field):
        BlockLayout(**{**base, **kwargs})  # type: ignore[arg-type]


def test_layout_bytes_match_the_issue_example() -> None:
    lay = BlockLayout(16, 16, 8, 128, "bfloat16")
    assert lay.block_bytes == 1 << 20 and lay.shape == (16, 2, 16, 8, 128)


def test_plan_messages_coalesces_runs_contiguous_on_both_sides() -> None:
    plan = plan_messages([0, 1, 2, 5, 6, 7], [10, 11, 3, 4, 5, 9], 4096, 2 * 4096)
    assert plan == [Message(0, 10, 2), Message(2, 3, 1), Message(5, 4, 2), Message(7, 9, 1)]
