"""Attention-FFN disaggregation (AFD) vs colocated expert parallelism, estimated by roofline.

A paper estimate for docs/afd.md, not a simulator and not a measurement: every time below is
max(FLOPs / peak FLOP/s, bytes / peak bandwidth) of one kernel or one transfer, with no launch
overhead, no kernel inefficiency and uniform expert routing. Real numbers are lower; the
*ratio* AFD / colocated is the useful output, and even that only to the extent the two sides
lose the same fraction to reality.

    python scripts/afd_estimate.py              # the tables quoted in docs/afd.md, then JSON
    python scripts/afd_estimate.py --json       # the JSON line only

Decode only (one new token per sequence per step); prefill is not modelled. One model
(Qwen3-235B-A22B, config below), one GPU type for both pools (H200-class, numbers below).

The decode step, per MoE layer, for one micro-batch of ``b`` tokens on one attention GPU:

    attention GPU         NIC (A->F)          FFN GPUs                  NIC (F->A)
    T_attn(b)  ------>  T_send  ------>  T_ffn(m GPUs' tokens)  ---->  T_back  --> next layer

With ``p`` micro-batches in flight (ping-pong), a layer takes
``max(T_attn + T_send + T_ffn + T_back, p * max(busy time of any one resource))``: the chain
of one micro-batch must come back before that micro-batch's next layer, and no resource (GPU,
NIC direction) can do more than its own work. Colocated (every GPU runs attention and its share
of the experts, expert parallelism over ``N`` GPUs) is the same loop with the two GPU stages on
one GPU, dispatch over NVLink inside a node.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TypeVar

# -- inputs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeModel:
    """The shapes that set bytes and FLOPs; every layer is an MoE layer, norms are ignored."""

    name: str
    hidden: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_inter: int  # moe_intermediate_size: one expert is gate+up [2I, H] and down [H, I]
    vocab: int
    source: str

    @property
    def attn_params_per_layer(self) -> int:
        """q, k, v, o projections and the router (which runs on the attention side)."""
        q_dim, kv_dim = self.num_q_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return 2 * self.hidden * q_dim + 2 * self.hidden * kv_dim + self.hidden * self.num_experts

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_inter

    @property
    def embed_params(self) -> int:
        """Input embedding and lm_head (untied)."""
        return 2 * self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        per_layer = self.attn_params_per_layer + self.num_experts * self.expert_params
        return self.num_layers * per_layer + self.embed_params

    @property
    def active_params(self) -> int:
        per_layer = self.attn_params_per_layer + self.top_k * self.expert_params
        return self.num_layers * per_layer + self.embed_params

    def kv_bytes_per_token_layer(self, kv_bytes: float) -> float:
        return 2 * self.num_kv_heads * self.head_dim * kv_bytes

    @property
    def attn_flops_per_kv(self) -> int:
        """FLOPs of one query token against one cached position: QK^T and PV, all heads."""
        return 2 * 2 * self.num_q_heads * self.head_dim


# Qwen3-235B-A22B, from its config.json (hidden_size, num_hidden_layers, num_attention_heads,
# num_key_value_heads, head_dim, num_experts, num_experts_per_tok, moe_intermediate_size,
# vocab_size; no shared expert, decoder_sparse_step 1, mlp_only_layers []).
QWEN3_235B = MoeModel(
    name="Qwen3-235B-A22B", hidden=4096, num_layers=94, num_q_heads=64, num_kv_heads=4,
    head_dim=128, num_experts=128, top_k=8, expert_inter=1536, vocab=151936,
    source="https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json",
)


@dataclass(frozen=True)
class Gpu:
    """Peak numbers of one GPU and its links (per direction; links are full duplex)."""

    name: str
    flops_bf16: float     # dense tensor-core FLOP/s
    flops_fp8: float
    hbm_bw: float         # B/s
    hbm_bytes: float
    nic_bw: float         # B/s, one NIC per GPU (GPUDirect RDMA)
    nic_latency: float    # s per transfer, one way, software included
    nvlink_bw: float      # B/s
    nvlink_latency: float
    gpus_per_node: int


# NVIDIA H200 SXM: 989 TFLOP/s bf16 and 1979 fp8 dense (the datasheet's 1979/3958 are with
# sparsity), 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s both directions; one ConnectX-7 NDR
# 400 Gb/s NIC per GPU as in DGX H200. Latencies are assumptions, not datasheet values.
H200 = Gpu(
    name="H200 SXM", flops_bf16=989e12, flops_fp8=1979e12, hbm_bw=4.8e12, hbm_bytes=141e9,
    nic_bw=400e9 / 8, nic_latency=10e-6, nvlink_bw=450e9, nvlink_latency=3e-6, gpus_per_node=8,
)


@dataclass(frozen=True)
class Numerics:
    """Bytes per element where they matter. FP8 weights run FP8 GEMMs; attention math is bf16."""

    weight_bytes: float = 1.0     # FP8 checkpoint (Qwen/Qwen3-235B-A22B-FP8)
    embed_bytes: float = 2.0      # embedding and lm_head stay bf16
    kv_bytes: float = 2.0         # bf16 KV cache (pdserve's default today)
    dispatch_bytes: float = 1.0   # hidden states A->F in FP8 (as Step-3's AFD does) ...
    dispatch_scale_group: int = 128  # ... with one fp32 scale per 128 values
    combine_bytes: float = 2.0    # expert outputs F->A in bf16 (as Step-3's AFD does)
    route_bytes: int = 8          # per (token, expert): int32 expert id + fp32 weight


@dataclass(frozen=True)
class Workload:
    context: int = 4096           # mean KV length of a decoding sequence
    tpot_slo: float = 0.050       # s; Step-3's AFD is reported at 50 ms TPOT
    mem_fraction: float = 0.90    # of HBM usable for weights + KV (the rest: activations, ...)
    expert_imbalance: float = 1.0  # hottest FFN GPU's load / mean (1.0 = uniform routing)


# -- pure arithmetic -----------------------------------------------------------------------------


def roofline(flops: float, nbytes: float, flops_rate: float, bw: float) -> float:
    """Time of a kernel bound by compute or by memory, whichever is slower."""
    return max(flops / flops_rate, nbytes / bw)


def transfer_time(nbytes: float, bw: float, latency: float = 0.0) -> float:
    """One transfer: a fixed cost, then the bytes at line rate."""
    return latency + nbytes / bw


def distinct_owners(num_experts: int, top_k: int, num_parts: int) -> float:
    """Expected number of shards (equal slices of the experts) a token's top-k experts fall
    in, under uniform routing: each shard misses all k with probability C(E - E/s, k) / C(E, k).
    """
    if num_experts % num_parts:
        raise ValueError(f"{num_experts} experts do not split into {num_parts} equal shards")
    per = num_experts // num_parts
    miss = math.comb(num_experts - per, top_k) / math.comb(num_experts, top_k)
    return num_parts * (1.0 - miss)


def experts_touched(num_local: int, num_experts: int, top_k: int, num_tokens: float) -> float:
    """Expected local experts that receive at least one of ``num_tokens`` tokens (their weights
    are read; an untouched expert costs nothing)."""
    miss: float = (1.0 - top_k / num_experts) ** num_tokens
    return num_local * (1.0 - miss)


def dispatch_bytes_per_token(model: MoeModel, num: Numerics) -> float:
    """One hidden state on the wire, A->F: FP8 values, fp32 group scales, its top-k routes."""
    scales = math.ceil(model.hidden / num.dispatch_scale_group) * 4
    return model.hidden * num.dispatch_bytes + scales + model.top_k * num.route_bytes


def combine_bytes_per_token(model: MoeModel, num: Numerics) -> float:
    """One (partially) combined expert output on the wire, F->A."""
    return model.hidden * num.combine_bytes


def attention_time(model: MoeModel, gpu: Gpu, num: Numerics, tokens: float,
                   context: int) -> float:
    """One layer's attention block on one GPU for ``tokens`` decode tokens (one per sequence):
    projection and router GEMMs (weights read once) plus paged attention over ``context``
    cached positions each (KV read once). Memory-bound at any realistic batch."""
    gemm_flops = 2 * tokens * model.attn_params_per_layer
    core_flops = tokens * context * model.attn_flops_per_kv
    compute = gemm_flops / gpu.flops_fp8 + core_flops / gpu.flops_bf16
    nbytes = (model.attn_params_per_layer * num.weight_bytes
              + tokens * context * model.kv_bytes_per_token_layer(num.kv_bytes))
    return max(compute, nbytes / gpu.hbm_bw)


def expert_time(model: MoeModel, gpu: Gpu, num: Numerics, global_tokens: float,
                num_shards: int, imbalance: float = 1.0) -> float:
    """One layer's experts on one of ``num_shards`` GPUs that split the experts evenly, for a
    micro-batch of ``global_tokens`` tokens routed over all of them (``k`` slots per token)."""
    local = model.num_experts // num_shards
    slots = global_tokens * model.top_k / num_shards * imbalance
    flops = 2 * slots * model.expert_params
    touched = experts_touched(local, model.num_experts, model.top_k, global_tokens)
    return roofline(flops, touched * model.expert_params * num.weight_bytes,
                    gpu.flops_fp8, gpu.hbm_bw)


def head_time(model: MoeModel, gpu: Gpu, num: Numerics, tokens: float) -> float:
    """lm_head for ``tokens`` tokens (its bf16 weight read once)."""
    return roofline(2 * tokens * model.vocab * model.hidden,
                    model.vocab * model.hidden * num.embed_bytes, gpu.flops_bf16, gpu.hbm_bw)


def layer_period(stages: Sequence[float], busy: Sequence[float], micro_batches: int) -> float:
    """Steady-state time of one layer for all ``micro_batches``: the loop latency of one
    micro-batch (``stages`` in sequence) or the busiest resource, whichever is longer."""
    return max(sum(stages), micro_batches * max(busy))


def kv_bytes_per_sequence(model: MoeModel, num: Numerics, context: int) -> float:
    return context * model.num_layers * model.kv_bytes_per_token_layer(num.kv_bytes)


def attention_weight_bytes(model: MoeModel, num: Numerics) -> float:
    """What every attention-side GPU holds besides KV: all layers' attention and router
    weights, embedding and lm_head."""
    return (model.num_layers * model.attn_params_per_layer * num.weight_bytes
            + model.embed_params * num.embed_bytes)


def expert_weight_bytes(model: MoeModel, num: Numerics, num_shards: int) -> float:
    """One GPU's share of all layers' experts when ``num_shards`` GPUs split them."""
    local = model.num_experts // num_shards
    return model.num_layers * local * model.expert_params * num.weight_bytes


# -- the two deployments -------------------------------------------------------------------------


@dataclass(frozen=True)
class AfdPlan:
    """m attention GPUs and n = instances * ffn_gpus FFN GPUs.

    mode "node": each FFN instance (ffn_gpus GPUs of one node, NVLink) holds a full copy of the
    experts; an attention GPU sends each token once to its instance, which fans it out to the
    owner GPUs over NVLink and returns one combined vector. mode "gpu": one instance; tokens
    go straight to every FFN GPU that owns one of their experts (M2N), partial sums come back.
    mode "in-node": "gpu" with all m + n GPUs in one node, so the exchange runs on NVLink
    (cuda_ipc) instead of the NICs.
    """

    attn_gpus: int
    ffn_gpus: int       # per instance
    instances: int
    mode: str           # "node" | "gpu" | "in-node"
    micro_batches: int
    micro_batch: int    # tokens per attention GPU per micro-batch

    @property
    def num_gpus(self) -> int:
        return self.attn_gpus + self.ffn_gpus * self.instances


@dataclass(frozen=True)
class ColocatedPlan:
    """N GPUs in one expert-parallel group; each runs attention for its own sequences."""

    ep_gpus: int
    micro_batches: int  # 1, or 2 for two-batch overlap of compute and dispatch
    micro_batch: int

    @property
    def num_gpus(self) -> int:
        return self.ep_gpus


@dataclass(frozen=True)
class Estimate:
    tpot: float          # s per decode step
    tokens_per_s_per_gpu: float
    bottleneck: str      # what sets the layer period
    t_attn: float        # per layer per micro-batch, s
    t_ffn: float
    t_send: float
    t_back: float
    batch_per_gpu: int   # sequences per attention(-running) GPU


def _bottleneck(stages: Sequence[float], busy: dict[str, float], micro_batches: int) -> str:
    name, worst = max(busy.items(), key=lambda kv: kv[1])
    return name if micro_batches * worst >= sum(stages) else "latency chain"


def estimate_afd(model: MoeModel, gpu: Gpu, num: Numerics, load: Workload,
                 plan: AfdPlan) -> Estimate:
    b, p = plan.micro_batch, plan.micro_batches
    per_instance = plan.attn_gpus / plan.instances
    tokens = per_instance * b  # one micro-batch as an FFN instance sees it
    out_tok, back_tok = dispatch_bytes_per_token(model, num), combine_bytes_per_token(model, num)
    if plan.mode == "node":
        copies_out = 1.0  # per attention GPU: each token crosses the NIC once
        copies_in = tokens / plan.ffn_gpus  # per FFN GPU NIC: tokens spread over the node
        # Fan-out to the owner GPUs and partial sums back, over NVLink (full duplex: the
        # larger direction counts; the copy a GPU keeps for itself is free).
        fan = distinct_owners(model.num_experts, model.top_k, plan.ffn_gpus)
        remote = fan * (plan.ffn_gpus - 1) / plan.ffn_gpus
        nvlink = copies_in * remote * max(out_tok, back_tok) / gpu.nvlink_bw
    elif plan.mode in ("gpu", "in-node"):
        fan = distinct_owners(model.num_experts, model.top_k, plan.ffn_gpus)
        copies_out = fan
        copies_in = tokens * fan / plan.ffn_gpus
        nvlink = 0.0
    else:
        raise ValueError(f"mode must be 'node', 'gpu' or 'in-node', not {plan.mode!r}")
    if plan.mode == "in-node":
        if plan.num_gpus > gpu.gpus_per_node:
            raise ValueError(f"{plan.num_gpus} GPUs do not fit one {gpu.gpus_per_node}-GPU node")
        bw, latency, wire = gpu.nvlink_bw, gpu.nvlink_latency, "NVLink"
    else:
        bw, latency, wire = gpu.nic_bw, gpu.nic_latency, "NIC"
    # A NIC direction is as slow as its busier end: the attention GPU sending its b tokens'
    # copies, or the FFN GPU taking in its share of every attention GPU's.
    xfer_send = transfer_time(max(b * copies_out, copies_in) * out_tok, bw)
    xfer_back = transfer_time(max(b * copies_out, copies_in) * back_tok, bw)
    t_attn = attention_time(model, gpu, num, b, load.context)
    t_ffn = expert_time(model, gpu, num, tokens, plan.ffn_gpus, load.expert_imbalance) + nvlink
    t_send, t_back = latency + xfer_send, latency + xfer_back
    stages = (t_attn, t_send, t_ffn, t_back)
    busy = {"attention GPU": t_attn, "FFN GPU": t_ffn, f"{wire} A->F": xfer_send,
            f"{wire} F->A": xfer_back}
    period = layer_period(stages, list(busy.values()), p)
    tpot = model.num_layers * period + p * head_time(model, gpu, num, b)
    rate = plan.attn_gpus * p * b / tpot / plan.num_gpus
    return Estimate(tpot, rate, _bottleneck(stages, busy, p), t_attn, t_ffn, t_send, t_back,
                    p * b)


def estimate_colocated(model: MoeModel, gpu: Gpu, num: Numerics, load: Workload,
                       plan: ColocatedPlan) -> Estimate:
    b, p, n = plan.micro_batch, plan.micro_batches, plan.ep_gpus
    fan = distinct_owners(model.num_experts, model.top_k, n)
    remote = fan * (n - 1) / n  # owners other than this GPU, per token
    in_node = min(n, gpu.gpus_per_node)
    off_node = remote * (n - in_node) / max(n - 1, 1)
    on_node = remote - off_node

    def link(per_token: float) -> tuple[float, float]:
        """(busy time, latency) of moving b tokens' copies to/from their owners."""
        nvl = transfer_time(b * on_node * per_token, gpu.nvlink_bw)
        nic = transfer_time(b * off_node * per_token, gpu.nic_bw)
        latency = gpu.nic_latency if off_node else gpu.nvlink_latency if on_node else 0.0
        return max(nvl, nic), latency

    xfer_send, lat = link(dispatch_bytes_per_token(model, num))
    xfer_back, _ = link(combine_bytes_per_token(model, num))
    t_attn = attention_time(model, gpu, num, b, load.context)
    t_ffn = expert_time(model, gpu, num, n * b, n, load.expert_imbalance)
    t_send, t_back = lat + xfer_send, lat + xfer_back
    stages = (t_attn, t_send, t_ffn, t_back)
    busy = {"GPU": t_attn + t_ffn, "dispatch": xfer_send, "combine": xfer_back}
    period = layer_period(stages, list(busy.values()), p)
    tpot = model.num_layers * period + p * head_time(model, gpu, num, b)
    return Estimate(tpot, p * b / tpot, _bottleneck(stages, busy, p), t_attn, t_ffn, t_send,
                    t_back, p * b)


Plan = TypeVar("Plan", AfdPlan, ColocatedPlan)


# -- memory limits and the search ----------------------------------------------------------------


def max_sequences(model: MoeModel, gpu: Gpu, num: Numerics, load: Workload,
                  resident_bytes: float) -> int:
    """Sequences whose KV fits next to ``resident_bytes`` of weights (0 if the weights don't)."""
    room = gpu.hbm_bytes * load.mem_fraction - resident_bytes
    return max(0, int(room // kv_bytes_per_sequence(model, num, load.context)))


def _largest_feasible(limit: int, ok: Callable[[int], bool]) -> int:
    """Largest b in [1, limit] with ok(b), given ok is monotone (true, then false); 0 if none."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def afd_candidates(model: MoeModel, gpu: Gpu, num: Numerics, load: Workload,
                   max_attn: int, max_ffn: int) -> Iterable[tuple[AfdPlan, Estimate]]:
    """For every shape (m, FFN layout, p), the largest micro-batch within memory and the SLO
    (throughput per GPU only grows with the micro-batch: weights are read once per pass)."""
    cap = max_sequences(model, gpu, num, load, attention_weight_bytes(model, num))
    ffn_room = gpu.hbm_bytes * load.mem_fraction
    layouts = [("node", g, r) for g in divisors(gpu.gpus_per_node)
               for r in range(1, max_ffn // g + 1)]
    layouts += [("gpu", g, 1) for g in divisors(model.num_experts) if g <= max_ffn]
    layouts += [("in-node", g, 1) for g in divisors(gpu.gpus_per_node) if g < gpu.gpus_per_node]
    for mode, g, r in layouts:
        if expert_weight_bytes(model, num, g) > ffn_room:
            continue
        top = gpu.gpus_per_node - g if mode == "in-node" else max_attn
        for m in range(r, top + 1, r):
            for p in (1, 2, 3, 4):
                def ok(b: int, m: int = m, p: int = p, g: int = g, r: int = r,
                       mode: str = mode) -> bool:
                    plan = AfdPlan(m, g, r, mode, p, b)
                    return estimate_afd(model, gpu, num, load, plan).tpot <= load.tpot_slo
                b = _largest_feasible(cap // p, ok)
                if b:
                    plan = AfdPlan(m, g, r, mode, p, b)
                    yield plan, estimate_afd(model, gpu, num, load, plan)


def colocated_candidates(model: MoeModel, gpu: Gpu, num: Numerics, load: Workload,
                         max_gpus: int) -> Iterable[tuple[ColocatedPlan, Estimate]]:
    for n in divisors(model.num_experts):
        if n > max_gpus:
            continue
        resident = attention_weight_bytes(model, num) + expert_weight_bytes(model, num, n)
        cap = max_sequences(model, gpu, num, load, resident)
        for p in (1, 2):
            def ok(b: int, n: int = n, p: int = p) -> bool:
                plan = ColocatedPlan(n, p, b)
                return estimate_colocated(model, gpu, num, load, plan).tpot <= load.tpot_slo
            b = _largest_feasible(cap // p, ok)
            if b:
                plan = ColocatedPlan(n, p, b)
                yield plan, estimate_colocated(model, gpu, num, load, plan)


def best(candidates: Iterable[tuple[Plan, Estimate]]) -> tuple[Plan, Estimate] | None:
    """Highest tokens/s per GPU; ties go to the smaller deployment (fewer GPUs)."""
    return max(candidates, key=lambda c: (round(c[1].tokens_per_s_per_gpu, 6), -c[0].num_gpus),
               default=None)


# -- the wire, at a named micro-batch ------------------------------------------------------------


@dataclass(frozen=True)
class WireRow:
    scheme: str
    out_bytes: float      # per layer, leaving one attention GPU for one micro-batch
    back_bytes: float     # per layer, arriving back at it
    need_gbps: float      # both directions' bytes within the per-layer comm budget, Gb/s


def wire_rows(model: MoeModel, num: Numerics, tokens: int, budget: float,
              ffn_gpus: int) -> list[WireRow]:
    """Bytes per layer of one micro-batch of ``tokens`` tokens, three ways of dispatching.

    budget: seconds one layer's A->F plus F->A may take (StepMesh's rule: comm both ways
    within one micro-batch's attention time, about TPOT / layers / micro-batches)."""
    out_tok, back_tok = dispatch_bytes_per_token(model, num), combine_bytes_per_token(model, num)
    schemes = [
        ("once per FFN node (recommended)", 1.0),
        (f"once per FFN GPU hit (M2N, {ffn_gpus} FFN GPUs)",
         distinct_owners(model.num_experts, model.top_k, ffn_gpus)),
        (f"once per expert (top-{model.top_k}, no dedupe)", float(model.top_k)),
    ]
    rows = []
    for name, copies in schemes:
        out, back = tokens * copies * out_tok, tokens * copies * back_tok
        rows.append(WireRow(name, out, back, (out + back) * 8 / budget / 1e9))
    return rows


# -- CLI -----------------------------------------------------------------------------------------


def _header(model: MoeModel, gpu: Gpu, num: Numerics, kv_dtype: str) -> list[str]:
    kv_tok = model.kv_bytes_per_token_layer(num.kv_bytes) * model.num_layers
    return [
        f"{model.name}: {model.total_params / 1e9:.1f}B params, "
        f"{model.active_params / 1e9:.1f}B active; KV {kv_tok / 1024:.0f} KiB/token ({kv_dtype}); "
        f"one expert {model.expert_params * num.weight_bytes / 2**20:.0f} MiB (fp8)",
        f"{gpu.name}: {gpu.flops_fp8 / 1e12:.0f} TFLOP/s fp8, {gpu.flops_bf16 / 1e12:.0f} bf16, "
        f"{gpu.hbm_bw / 1e12:.1f} TB/s, {gpu.hbm_bytes / 1e9:.0f} GB; "
        f"NIC {gpu.nic_bw * 8 / 1e9:.0f} Gb/s + {gpu.nic_latency * 1e6:g} us; "
        f"NVLink {gpu.nvlink_bw / 1e9:.0f} GB/s",
        f"Weights: {attention_weight_bytes(model, num) / 1e9:.1f} GB per attention-running GPU; "
        f"experts {expert_weight_bytes(model, num, 1) / 1e9:.1f} GB "
        f"({expert_weight_bytes(model, num, gpu.gpus_per_node) / 1e9:.1f} GB per GPU of an "
        f"{gpu.gpus_per_node}-GPU FFN node)",
    ]


def _wire(model: MoeModel, gpu: Gpu, num: Numerics, args: argparse.Namespace
          ) -> tuple[list[str], dict[str, object]]:
    budget = args.tpot_ms / 1e3 / model.num_layers / args.wire_micro_batches
    rows = wire_rows(model, num, args.wire_tokens, budget, args.wire_ffn_gpus)
    nic_gbps = gpu.nic_bw * 8 / 1e9
    lines = [
        f"Wire per layer, {args.wire_tokens}-token micro-batch, both directions in "
        f"{budget * 1e6:.0f} us ({args.tpot_ms:g} ms / {model.num_layers} layers / "
        f"{args.wire_micro_batches} micro-batches):",
        f"  {'dispatch':<44} {'A->F':>9} {'F->A':>9} {'needs':>9}",
    ]
    for r in rows:
        verdict = "fits" if r.need_gbps <= nic_gbps else "exceeds"
        out, back = r.out_bytes / 2**20, r.back_bytes / 2**20
        lines.append(f"  {r.scheme:<44} {out:>5.2f} MiB {back:>5.2f} MiB "
                     f"{r.need_gbps:>5.0f} Gb/s ({verdict} {nic_gbps:g}G)")
    return lines, {"tokens": args.wire_tokens, "budget_s": budget,
                   "rows": [asdict(r) for r in rows]}


def _split(e: Estimate) -> str:
    return " / ".join(f"{t * 1e6:.0f}" for t in (e.t_attn, e.t_send, e.t_ffn, e.t_back))


def _compare(model: MoeModel, gpu: Gpu, num: Numerics, args: argparse.Namespace
             ) -> tuple[list[str], list[dict[str, object]]]:
    col_lines = [f"Colocated, experts split over N GPUs that also run attention, "
                 f"TPOT <= {args.tpot_ms:g} ms:",
                 f"  {'context':>7}  {'plan':<22} {'tok/s/GPU':>9} {'TPOT':>8}  bound"]
    afd_lines = [f"AFD (m attention GPUs : n FFN GPUs), TPOT <= {args.tpot_ms:g} ms:",
                 f"  {'context':>7}  {'plan':<27} {'tok/s/GPU':>9} {'TPOT':>8}  "
                 f"{'bound':<15} {'vs colocated':>12}"]
    split_lines = ["Per layer and micro-batch, us: attention / A->F / experts / F->A",
                   f"  {'context':>7}  {'colocated':<24} AFD"]
    results: list[dict[str, object]] = []
    for context in args.contexts:
        load = Workload(context=context, tpot_slo=args.tpot_ms / 1e3,
                        expert_imbalance=args.imbalance)
        col = best(colocated_candidates(model, gpu, num, load, args.max_ep))
        afd = best(afd_candidates(model, gpu, num, load, args.max_attn, args.max_ffn))
        if col is None or afd is None:
            col_lines.append(f"  {context:>7}  no feasible plan")
            continue
        (cp, ce), (ap, ae) = col, afd
        ratio = ae.tokens_per_s_per_gpu / ce.tokens_per_s_per_gpu
        col_plan = f"EP{cp.ep_gpus} p={cp.micro_batches} B={ce.batch_per_gpu}"
        afd_plan = (f"{ap.attn_gpus}A:{ap.ffn_gpus * ap.instances}F {ap.mode} "
                    f"p={ap.micro_batches} B={ae.batch_per_gpu}")
        col_lines.append(f"  {context:>7}  {col_plan:<22} {ce.tokens_per_s_per_gpu:>9.0f} "
                         f"{ce.tpot * 1e3:>5.1f} ms  {ce.bottleneck}")
        afd_lines.append(f"  {context:>7}  {afd_plan:<27} {ae.tokens_per_s_per_gpu:>9.0f} "
                         f"{ae.tpot * 1e3:>5.1f} ms  {ae.bottleneck:<15} {ratio:>11.2f}x")
        split_lines.append(f"  {context:>7}  {_split(ce):<24} {_split(ae)}")
        results.append({"context": context, "tpot_slo_s": load.tpot_slo,
                        "colocated": {"plan": asdict(cp), "estimate": asdict(ce)},
                        "afd": {"plan": asdict(ap), "estimate": asdict(ae)},
                        "afd_over_colocated": ratio})
    ratios = " ".join(f"{r['afd_over_colocated']:.2f}x" for r in results)
    summary = (f"AFD/colocated tok/s per GPU at contexts "
               f"{'/'.join(str(r['context']) for r in results)}: {ratios}")
    return [*col_lines, "", *afd_lines, "", *split_lines, "", summary], results


def run(args: argparse.Namespace) -> tuple[list[str], dict[str, object]]:
    """The printed lines and the JSON report for ``args``."""
    model = QWEN3_235B
    gpu = replace(H200, nic_bw=args.nic_gbps * 1e9 / 8, nic_latency=args.nic_latency_us * 1e-6)
    num = Numerics(kv_bytes={"bf16": 2.0, "fp8": 1.0}[args.kv_dtype])
    wire_lines, wire = _wire(model, gpu, num, args)
    compare_lines, results = _compare(model, gpu, num, args)
    lines = [*_header(model, gpu, num, args.kv_dtype), "", *wire_lines, "", *compare_lines]
    report: dict[str, object] = {"model": asdict(model), "gpu": asdict(gpu),
                                 "numerics": asdict(num), "wire": wire, "results": results}
    return lines, report


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384],
                    help="mean KV length per decoding sequence (one row each)")
    ap.add_argument("--tpot-ms", type=float, default=50.0, help="TPOT SLO in milliseconds")
    ap.add_argument("--max-attn", type=int, default=128, help="most attention GPUs in AFD")
    ap.add_argument("--max-ffn", type=int, default=32, help="most FFN GPUs in AFD")
    ap.add_argument("--max-ep", type=int, default=64, help="largest colocated EP group")
    ap.add_argument("--wire-tokens", type=int, default=256,
                    help="micro-batch size (tokens) of the wire table")
    ap.add_argument("--wire-micro-batches", type=int, default=3,
                    help="micro-batches in flight for the wire table's comm budget")
    ap.add_argument("--wire-ffn-gpus", type=int, default=8,
                    help="FFN GPUs a token may be sent to in the wire table's M2N row")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16",
                    help="KV cache dtype (capacity and attention bytes)")
    ap.add_argument("--nic-gbps", type=float, default=400.0, help="NIC line rate per GPU")
    ap.add_argument("--nic-latency-us", type=float, default=10.0,
                    help="one-way cost of one transfer over the NIC, software included")
    ap.add_argument("--imbalance", type=float, default=1.0,
                    help="hottest FFN GPU's expert load over the mean (1 = uniform routing)")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    lines, report = run(args)
    if not args.json:
        print("\n".join(lines))
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
