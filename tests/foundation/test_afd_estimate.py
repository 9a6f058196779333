"""scripts/afd_estimate.py: its arithmetic on hand-computed cases, the premise its search rests
on, and docs/afd.md quoting exactly what it prints."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "afd.md"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("afd_estimate",
                                                  ROOT / "scripts" / "afd_estimate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


afd = _load()
Q, GPU, NUM = afd.QWEN3_235B, afd.H200, afd.Numerics()


# -- shapes and bytes ----------------------------------------------------------------------------


def test_qwen3_shapes_add_up_to_the_model_card() -> None:
    # Model card: 235B total, 22B activated. Attention per layer: q 4096x8192, k and v
    # 4096x512 each, o 8192x4096, router 4096x128.
    assert Q.attn_params_per_layer == 4096 * 8192 * 2 + 4096 * 512 * 2 + 4096 * 128 == 71_827_456
    assert Q.expert_params == 3 * 4096 * 1536 == 18_874_368
    assert Q.total_params == pytest.approx(235e9, rel=0.01)
    assert Q.active_params == pytest.approx(22e9, rel=0.02)
    # K and V, 4 KV heads of 128, bf16, 94 layers.
    assert Q.kv_bytes_per_token_layer(2.0) * Q.num_layers == 2 * 4 * 128 * 2 * 94 == 192_512
    assert Q.attn_flops_per_kv == 4 * 64 * 128


def test_bytes_on_the_wire_per_token() -> None:
    # A->F: 4096 fp8 values + 32 fp32 scales (one per 128) + 8 x (int32 id + fp32 weight).
    assert afd.dispatch_bytes_per_token(Q, NUM) == 4096 + 32 * 4 + 8 * 8 == 4288
    # F->A: 4096 bf16 values.
    assert afd.combine_bytes_per_token(Q, NUM) == 8192


def test_reproduces_stepmesh_table_for_step3() -> None:
    # StepMesh's Introduction.md, Table 1 (Step-3, 2A2F, batch 128, hidden 7168, 161.3 Gb/s):
    # A2F 2 x 128 x 7168 x 1 B in 91 us, F2A the same in bf16 in 182 us.
    a2f, f2a = 2 * 128 * 7168 * 1, 2 * 128 * 7168 * 2
    bw = 161.3e9 / 8
    assert afd.transfer_time(a2f, bw) == pytest.approx(91e-6, abs=0.5e-6)
    assert afd.transfer_time(f2a, bw) == pytest.approx(182e-6, abs=0.5e-6)
    assert afd.transfer_time(a2f, bw, latency=10e-6) == pytest.approx(101e-6, abs=0.5e-6)


def test_wire_rows_for_a_256_token_micro_batch() -> None:
    budget = 0.050 / 94 / 3
    node, m2n, per_expert = afd.wire_rows(Q, NUM, 256, budget, ffn_gpus=8)
    assert node.out_bytes == 256 * 4288 and node.back_bytes == 256 * 8192 == 2 * 2**20
    assert node.need_gbps == pytest.approx((256 * 4288 + 256 * 8192) * 8 / budget / 1e9)
    assert node.need_gbps == pytest.approx(144.15, abs=0.01)
    assert per_expert.out_bytes == 8 * node.out_bytes and per_expert.back_bytes == 16 * 2**20
    assert node.out_bytes < m2n.out_bytes < per_expert.out_bytes


def test_distinct_owners_on_hand_cases() -> None:
    # 8 experts in 2 shards of 4, top-2: a shard is missed when both picks are in the other
    # shard, C(4,2)/C(8,2) = 6/28.
    assert afd.distinct_owners(8, 2, 2) == pytest.approx(2 * (1 - 6 / 28))
    assert afd.distinct_owners(128, 8, 1) == 1.0
    assert afd.distinct_owners(128, 8, 128) == pytest.approx(8.0)  # one expert per shard
    # 16 experts per GPU of 8: a GPU is missed by all 8 picks with prob prod (112-i)/(128-i).
    miss = math.prod((112 - i) / (128 - i) for i in range(8))
    assert miss == pytest.approx(0.33258, abs=1e-5)
    assert afd.distinct_owners(128, 8, 8) == pytest.approx(8 * (1 - miss))
    assert afd.distinct_owners(128, 8, 8) == pytest.approx(5.339, abs=1e-3)
    with pytest.raises(ValueError, match="equal shards"):
        afd.distinct_owners(128, 8, 3)


def test_experts_touched() -> None:
    assert afd.experts_touched(16, 128, 8, 0) == 0.0
    assert afd.experts_touched(128, 128, 8, 1) == pytest.approx(8.0)
    assert afd.experts_touched(16, 128, 8, 10_000) == pytest.approx(16.0)


# -- roofline times ------------------------------------------------------------------------------


def test_attention_is_bound_by_reading_weights_and_kv() -> None:
    # 64 sequences at 4096 positions: 71,827,456 B of fp8 weights + 64*4096*2048 B of KV.
    t = afd.attention_time(Q, GPU, NUM, 64, 4096)
    assert t == pytest.approx((71_827_456 + 64 * 4096 * 2048) / 4.8e12)
    assert t == pytest.approx(126.81e-6, abs=0.01e-6)


def test_experts_are_compute_bound_when_batched_memory_bound_when_not() -> None:
    # 4096 tokens over 8 GPUs: 4096 slots per GPU, 2 FLOPs per MAC at 1979 TFLOP/s fp8
    # (78.1 us) beats reading 16 experts' 18,874,368 fp8 bytes each (62.9 us).
    big = afd.expert_time(Q, GPU, NUM, 4096, 8)
    assert big == pytest.approx(2 * 4096 * 18_874_368 / 1979e12)
    # One token touches one local expert on average (8 of 128, 16 local): one expert's bytes.
    one = afd.expert_time(Q, GPU, NUM, 1, 8)
    assert one == pytest.approx(18_874_368 / 4.8e12)
    assert afd.expert_time(Q, GPU, NUM, 4096, 8, imbalance=1.5) == pytest.approx(1.5 * big)


def test_layer_period_is_the_loop_or_the_busiest_resource() -> None:
    assert afd.layer_period([1, 2, 3, 4], [1, 3, 2, 4], 1) == 10  # one micro-batch: the loop
    assert afd.layer_period([1, 2, 3, 4], [1, 3, 2, 4], 2) == 10  # 2 x 4 < 10
    assert afd.layer_period([1, 2, 3, 4], [1, 3, 2, 4], 3) == 12  # the busiest resource


def test_afd_transfer_times_on_a_hand_case() -> None:
    # One attention GPU, one 8-GPU FFN node, 100 tokens: the attention NIC is the busier end
    # (100 tokens out vs 12.5 in per FFN GPU), so A->F = 10 us + 100 * 4288 B / 50 GB/s.
    load = afd.Workload(context=4096)
    plan = afd.AfdPlan(attn_gpus=1, ffn_gpus=8, instances=1, mode="node", micro_batches=2,
                       micro_batch=100)
    est = afd.estimate_afd(Q, GPU, NUM, load, plan)
    assert est.t_send == pytest.approx(10e-6 + 100 * 4288 / 50e9)
    assert est.t_back == pytest.approx(10e-6 + 100 * 8192 / 50e9)
    assert est.t_attn == pytest.approx(afd.attention_time(Q, GPU, NUM, 100, 4096))
    period = afd.layer_period([est.t_attn, est.t_send, est.t_ffn, est.t_back],
                              [est.t_attn, est.t_ffn, est.t_send - 10e-6, est.t_back - 10e-6], 2)
    assert est.tpot == pytest.approx(94 * period + 2 * afd.head_time(Q, GPU, NUM, 100))
    assert est.tokens_per_s_per_gpu == pytest.approx(1 * 200 / est.tpot / 9)
    with pytest.raises(ValueError, match="one 8-GPU node"):
        afd.estimate_afd(Q, GPU, NUM, load, replace(plan, attn_gpus=5, mode="in-node"))


def test_colocated_in_one_node_dispatches_over_nvlink() -> None:
    load = afd.Workload(context=4096)
    est = afd.estimate_colocated(Q, GPU, NUM, load, afd.ColocatedPlan(8, 1, 100))
    remote = afd.distinct_owners(128, 8, 8) * 7 / 8
    assert est.t_send == pytest.approx(3e-6 + 100 * remote * 4288 / 450e9)
    wide = afd.estimate_colocated(Q, GPU, NUM, load, afd.ColocatedPlan(16, 1, 100))
    assert wide.t_send > 10e-6  # part of the traffic leaves the node: NIC latency and rate


def test_kv_capacity() -> None:
    # 0.9 x 141 GB minus fp8 attention weights of 94 layers and bf16 embedding + lm_head,
    # over 4096 x 192,512 B per sequence: 149 sequences.
    resident = afd.attention_weight_bytes(Q, NUM)
    assert resident == 94 * 71_827_456 + 2 * 151_936 * 4096 * 2
    assert afd.max_sequences(Q, GPU, NUM, afd.Workload(context=4096), resident) == 149
    assert afd.expert_weight_bytes(Q, NUM, 8) == 94 * 16 * 18_874_368
    assert afd.max_sequences(Q, GPU, NUM, afd.Workload(), 200e9) == 0


@pytest.mark.parametrize("plan", [
    afd.AfdPlan(16, 8, 1, "node", 3, 1), afd.AfdPlan(32, 16, 1, "gpu", 2, 1),
    afd.AfdPlan(4, 4, 1, "in-node", 2, 1)])
def test_search_premise_time_and_rate_grow_with_the_micro_batch(plan: object) -> None:
    # afd_candidates takes the largest micro-batch within the SLO by bisection: that needs
    # TPOT non-decreasing and tokens/s per GPU non-decreasing in the micro-batch.
    load = afd.Workload(context=2048)
    ests = [afd.estimate_afd(Q, GPU, NUM, load, replace(plan, micro_batch=b))
            for b in range(1, 400, 7)]
    assert all(a.tpot <= b.tpot for a, b in zip(ests, ests[1:], strict=False))
    assert all(a.tokens_per_s_per_gpu <= b.tokens_per_s_per_gpu * (1 + 1e-12)
               for a, b in zip(ests, ests[1:], strict=False))


# -- the CLI and the doc -------------------------------------------------------------------------


def _lines(argv: list[str]) -> list[str]:
    lines, _ = afd.run(afd.parse_args(argv))
    return lines


def test_afd_loses_to_wide_ep_but_beats_one_node_ep_at_long_context() -> None:
    _, wide = afd.run(afd.parse_args(["--contexts", "4096"]))
    _, narrow = afd.run(afd.parse_args(["--contexts", "16384", "--max-ep", "8"]))
    assert wide["results"][0]["afd_over_colocated"] < 1.0
    assert narrow["results"][0]["afd_over_colocated"] > 1.0


def test_cli_prints_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert afd.main(["--json", "--contexts", "4096"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    report = json.loads(out[0])
    assert report["model"]["name"] == "Qwen3-235B-A22B"
    assert {"colocated", "afd", "afd_over_colocated"} <= report["results"][0].keys()


def test_doc_quotes_what_the_script_prints() -> None:
    doc = DOC.read_text()
    assert "python scripts/afd_estimate.py" in doc
    missing = [line for line in _lines([]) if line.strip() and line not in doc]
    assert not missing, f"docs/afd.md does not quote these lines of the script: {missing}"


@pytest.mark.parametrize("argv", [["--max-ep", "8"], ["--kv-dtype", "fp8"], ["--tpot-ms", "20"],
                                  ["--nic-gbps", "800"]])
def test_doc_quotes_the_sensitivity_runs(argv: list[str]) -> None:
    quoted = f"$ python scripts/afd_estimate.py {' '.join(argv)}\n{_lines(argv)[-1]}\n"
    assert quoted in DOC.read_text(), f"docs/afd.md does not quote {quoted!r}"
