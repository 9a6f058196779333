"""The controller's wiring into the router and the launcher: the plan read from the engines'
roles, the router's settings and their errors, what the router reports per request, which
actuator each mode gets, and the flags ``pdserve up --controller`` passes on. (The loop itself:
test_loop.py; real processes: test_router_controller_stack.py.)"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import pytest

from pdserve.controller.actuator import DryRunActuator
from pdserve.controller.monitor import Sample
from pdserve.controller.optimizer import Plan
from pdserve.proto.v1 import common_pb2, engine_pb2
from pdserve.roles import Role
from services.launcher import Stack, _args, build_parser
from services.router.config import RouterConfig
from services.router.controlling import (
    PoolActuator,
    RouterController,
    current_plan,
    make_actuator,
    maybe_controller,
)
from services.router.instances import InstancePool
from services.router.model import load_model_spec
from tests.router.conftest import Cluster as RouterCluster


def _sample(role: str, flex: bool = True) -> Sample:
    return Sample("i", "a:1", 0.0, role, flex, False, 0, 0, 0, 0, 0.0, 0.0, 0, 0, 0)


@pytest.mark.parametrize(("roles", "flex_only", "plan"), [
    ([("prefill", True), ("prefill", True), ("decode", True)], True, Plan(2, 1)),
    ([("prefill", True), ("decode", False)], True, Plan(1, 0)),  # a fixed engine stays out
    ([("prefill", True), ("decode", False)], False, Plan(1, 1)),
    ([("colocated", False), ("colocated", False)], False, Plan(0, 0, 2)),
    ([("colocated", True), ("colocated", True)], True, Plan(0, 0, 2)),  # flex, switched
    ([("prefill", True), ("colocated", True)], True, Plan(1, 0, 1)),  # half way: kept as is
    ([], True, Plan(0, 0)),
])
def test_the_plan_in_force_is_the_engines_roles(roles: list[tuple[str, bool]], flex_only: bool,
                                                plan: Plan) -> None:
    assert current_plan([_sample(r, f) for r, f in roles], flex_only) == plan


BASE = {"prefill": ("127.0.0.1:1",), "decode": ("127.0.0.1:2",)}


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"controller": "auto"}, "--controller"),
    ({"slo_ttft_ms": 0.0}, "--slo-ttft-ms"),
    ({"slo_tpot_ms": -1.0}, "--slo-tpot-ms"),
    ({"controller_interval": 0.0}, "--controller-interval"),
    ({"controller_lease_ms": 10}, "--controller-lease-ms"),
    ({"controller_prefer": "latency"}, "--controller-prefer"),
    ({"controller_headroom": -0.5}, "--controller-headroom"),
])
def test_controller_settings_errors_name_the_flag(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        RouterConfig(**{**BASE, **kwargs})


async def test_flags_build_the_controller_settings() -> None:
    cfg = RouterConfig.from_argv(["--prefill", "a:1", "--decode", "b:2", "--controller",
                                  "in-place", "--slo-ttft-ms", "500", "--slo-tpot-ms", "40",
                                  "--controller-dwell", "5", "--controller-stabilize", "3"])
    assert (cfg.controller, cfg.slo_ttft_ms, cfg.slo_tpot_ms, cfg.controller_dwell,
            cfg.controller_stabilize) == ("in-place", 500.0, 40.0, 5.0, 3.0)
    pool = InstancePool(cfg.prefill, cfg.decode)
    ctl = maybe_controller(cfg, pool)
    assert ctl is not None and ctl.lease is None  # no Redis: always the leader
    assert (ctl.slo.ttft_s, ctl.slo.tpot_s) == (0.5, 0.04)
    policy = ctl.build().policy
    assert (policy.min_dwell_s, policy.stable_s) == (5.0, 3.0)
    assert maybe_controller(RouterConfig(**BASE), pool) is None  # off by default


@pytest.mark.parametrize(("argv", "allowed"), [([], True),
                                               (["--controller-colocated", "false"], False)])
async def test_colocated_plans_are_allowed_unless_the_operator_keeps_a_split(
        argv: list[str], allowed: bool) -> None:
    cfg = RouterConfig.from_argv(["--prefill", "a:1", "--decode", "b:2", "--controller",
                                  "in-place", *argv])
    ctl = maybe_controller(cfg, InstancePool(cfg.prefill, cfg.decode))
    assert ctl is not None and ctl.build().cluster.allow_colocated is allowed


@pytest.mark.parametrize(("argv", "prefer", "headroom"), [
    ([], "split", 0.2),  # a disaggregated server is run for its ITL: the split by default
    (["--controller-prefer", "goodput"], "goodput", 0.2),
    (["--controller-prefer=split", "--controller-headroom", "0.5"], "split", 0.5),
])
async def test_the_preference_reaches_the_policy(argv: list[str], prefer: str,
                                                 headroom: float) -> None:
    cfg = RouterConfig.from_argv(["--prefill", "a:1", "--decode", "b:2", "--controller",
                                  "in-place", *argv])
    ctl = maybe_controller(cfg, InstancePool(cfg.prefill, cfg.decode))
    assert ctl is not None
    policy = ctl.build().policy
    assert (policy.prefer, policy.headroom) == (prefer, headroom)


def test_a_half_way_plan_says_so() -> None:
    assert (str(Plan(1, 0, 1)), str(Plan(0, 0, 2)), str(Plan(1, 1))) == (
        "p=1 d=0 colocated=1", "colocated=2", "p=1 d=1")


async def test_each_mode_gets_its_actuator() -> None:
    pool = InstancePool(BASE["prefill"], BASE["decode"])
    assert isinstance(make_actuator(RouterConfig(**BASE, controller="dry-run"), pool),
                      DryRunActuator)
    actuator = make_actuator(RouterConfig(**BASE, controller="in-place"), pool)
    assert isinstance(actuator, PoolActuator)
    assert set(actuator.stubs()) == {"127.0.0.1:1", "127.0.0.1:2"}  # the pool's, live


async def test_the_router_reports_arrivals_and_latencies() -> None:
    c = RouterCluster(load_model_spec("tiny"))
    try:
        p = await c.engine("P", "prefill")
        d = await c.engine("D", "decode", num_tokens=3)
        router, client = await c.router([p], [d], controller="dry-run")
        ctl = router.controller
        assert isinstance(ctl, RouterController)
        msgs = await client.generate(ids=list(range(1, 9)), max_tokens=4)
        assert sum(len(m.token_ids) for m in msgs) == 4
        load = ctl.window.current(time.monotonic())
        assert (load.rate, load.input_len, load.output_len) == (1 / ctl.window.window_s, 8, 4)
        summary = ctl.latency.summary(time.monotonic())
        assert summary.count == 1 and summary.ttft_p50_s is not None
        assert summary.tpot_p50_s is not None and summary.tpot_p50_s >= 0
    finally:
        for close in reversed(c.closers):
            await close()
        for e in c.engines:
            await e.stop()


def _stack(args: list[str]) -> Stack:
    stack = Stack(_args(build_parser().parse_args(args)))
    stack.redis_url = ""
    stack.plan()
    return stack


def test_up_controller_starts_flex_engines_and_passes_the_flags() -> None:
    stack = _stack(["--controller", "--slo-ttft-ms", "800",
                    "--router-arg=--controller-dwell=3"])
    procs = {p.name: p.args for p in stack.procs}
    for name in ("prefill-0", "decode-0"):
        assert procs[name][procs[name].index("--role") + 1] == Role.FLEX
        assert procs[name][procs[name].index("--calibrate") + 1] == "true"  # measures itself
    router = procs["router"]
    assert router[router.index("--controller") + 1] == "in-place"
    assert router[router.index("--slo-ttft-ms") + 1] == "800.0"
    assert "--controller-dwell=3" in router
    plain = {p.name: p.args for p in _stack([]).procs}
    assert "--controller" not in plain["router"]
    assert "--calibrate" not in plain["prefill-0"]
    assert plain["prefill-0"][plain["prefill-0"].index("--role") + 1] == Role.PREFILL


def test_up_in_place_controller_refuses_colocated_engines() -> None:
    with pytest.raises(SystemExit, match=r"--controller in-place starts flex engines as "
                                         r"--prefill/--decode ones \(the controller switches "
                                         r"them to colocated when that serves better\); it "
                                         "cannot run with --colocated"):
        _args(build_parser().parse_args(["--controller", "--colocated"]))


def test_up_controller_mode_must_be_known(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--controller", "auto"])
    assert "argument --controller: invalid choice: 'auto'" in capsys.readouterr().err


async def test_routers_sharing_redis_elect_one_controller_and_hand_over() -> None:
    import redis.asyncio as aioredis

    prefix = f"test15b:{uuid.uuid4().hex}:"
    clients = [aioredis.Redis.from_url("redis://127.0.0.1:6379/0") for _ in range(2)]
    cfg = RouterConfig(**BASE, controller="dry-run", registry_prefix=prefix,
                       controller_lease_ms=300, controller_interval=100)
    ctls = [RouterController(cfg, InstancePool((), (), redis=c)) for c in clients]
    try:
        for ctl in ctls:
            await ctl.start()
        await asyncio.sleep(0.5)
        leaders = [ctl for ctl in ctls if ctl.lease is not None and ctl.lease.is_leader]
        assert len(leaders) == 1
        [follower] = [ctl for ctl in ctls if ctl is not leaders[0]]
        assert follower.controller is not None
        decision = await follower.controller.tick(time.monotonic())
        assert decision.reason == "not the leader" and not decision.changed
        await leaders[0].stop()  # a clean stop releases the lease: the other takes it
        await asyncio.sleep(0.4)
        assert follower.lease is not None and follower.lease.is_leader
    finally:
        for ctl in ctls:
            await ctl.stop()
        await clients[0].delete(f"{prefix}controller:leader")
        for c in clients:
            await c.aclose()


def _bench_rows(prefill_tps: float, model: str = "bench-50m", dtype: str = "float32",
                prompt_len: int = 128) -> str:
    rows = [{"num_seqs": n, "pdserve_decode_tps": n / (0.02 + 0.001 * n),
             "pdserve_prefill_tps": prefill_tps, "dtype": dtype, "model": model,
             "prompt_len": prompt_len, "threads": 1} for n in (1, 8, 32)]
    return "\n".join(json.dumps(r) for r in rows) + "\n"


async def test_the_controller_starts_from_the_operators_calibration(tmp_path: Path) -> None:
    path = tmp_path / "calibration.jsonl"
    path.write_text(_bench_rows(prefill_tps=700.0))
    cfg = RouterConfig(**BASE, controller="dry-run", controller_calibration=str(path))
    ctl = maybe_controller(cfg, InstancePool(cfg.prefill, cfg.decode))
    assert ctl is not None
    assert ctl.model.prefill_tokens_per_s == pytest.approx(700.0)
    assert ctl.model.decode_base_s == pytest.approx(0.02)
    shipped = maybe_controller(RouterConfig(**BASE, controller="dry-run"),
                               InstancePool(cfg.prefill, cfg.decode))
    assert shipped is not None and shipped.model.prefill_tokens_per_s > 1500  # the 2-core run


@pytest.mark.parametrize(("content", "message"), [
    (None, "--controller-calibration: cannot read '{path}': No such file or directory"),
    ("not json\n{oops\n", "--controller-calibration: line 2: not JSON"),
    ('{"num_seqs": 1}\n', "--controller-calibration: line 1 lacks 'pdserve_prefill_tps'"),
    (_bench_rows(900.0) + _bench_rows(900.0, dtype="bfloat16"),
     "--controller-calibration: rows of several dtypes or models (bfloat16 bench-50m, "
     "float32 bench-50m): give the rows of the one the engines run"),
])
def test_a_bad_calibration_fails_at_start_naming_the_flag(tmp_path: Path, content: str | None,
                                                          message: str) -> None:
    path = tmp_path / "calibration.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError) as err:
        RouterConfig(**BASE, controller_calibration=str(path))
    assert str(err.value).startswith(message.format(path=path))


def test_a_rows_own_prompt_length_wins() -> None:
    from pdserve.controller.capacity import from_bench_lines

    short = from_bench_lines(_bench_rows(1000.0, prompt_len=64).splitlines(), 128, 64)
    assert short.prefill_tokens_per_s == pytest.approx(1000.0)  # tokens/s either way
    # the decode law does not depend on the prompt length
    assert short.decode_base_s == pytest.approx(0.02)


def _measured_stats(prefill_tps: float, steps: dict[int, float]) -> engine_pb2.EngineStats:
    return engine_pb2.EngineStats(
        instance_id="e", role=common_pb2.ROLE_PREFILL, is_flex=True,
        measured_prefill_tokens_per_s=prefill_tps,
        measured_decode_steps=[engine_pb2.MeasuredStep(batch=b, seconds=s)
                               for b, s in steps.items()])


def _polled_pool(cfg: RouterConfig, *stats: engine_pb2.EngineStats) -> InstancePool:
    pool = InstancePool(cfg.prefill, cfg.decode)
    for inst, st in zip(pool.instances.values(), stats, strict=True):
        inst.apply_stats(st)
        inst.is_healthy = True
    return pool


async def test_the_controller_starts_from_the_engines_own_measurements() -> None:
    cfg = RouterConfig(**BASE, controller="dry-run")
    pool = _polled_pool(cfg, _measured_stats(800.0, {1: 0.015, 32: 0.055}),
                        _measured_stats(900.0, {1: 0.017, 32: 0.057}))
    ctl = maybe_controller(cfg, pool)
    assert ctl is not None
    loop = ctl.build()
    assert loop.model is ctl.model and ctl.model.prefill_tokens_per_s == pytest.approx(850.0)
    assert [b for b, _ in ctl.model.decode_points] == [1, 32]  # each batch's mean
    assert [t for _, t in ctl.model.decode_points] == pytest.approx([0.016, 0.056])
    assert ctl.current_model() is ctl.model


async def test_the_engines_measurements_are_used_only_when_every_engine_has_them(
        tmp_path: Path) -> None:
    cfg = RouterConfig(**BASE, controller="dry-run")
    shipped = maybe_controller(cfg, InstancePool(cfg.prefill, cfg.decode))
    assert shipped is not None
    pool = _polled_pool(cfg, _measured_stats(800.0, {1: 0.015, 32: 0.055}),
                        _measured_stats(0.0, {}))  # one engine started without --calibrate
    ctl = maybe_controller(cfg, pool)
    assert ctl is not None
    ctl.build()
    assert ctl.model == shipped.model
    # an operator's file wins over the engines' measurements
    path = tmp_path / "calibration.jsonl"
    path.write_text(_bench_rows(prefill_tps=700.0))
    cfg = RouterConfig(**BASE, controller="dry-run", controller_calibration=str(path))
    pool = _polled_pool(cfg, _measured_stats(800.0, {1: 0.015, 32: 0.055}),
                        _measured_stats(900.0, {1: 0.017, 32: 0.057}))
    ctl = maybe_controller(cfg, pool)
    assert ctl is not None
    ctl.build()
    assert ctl.model.prefill_tokens_per_s == pytest.approx(700.0)
