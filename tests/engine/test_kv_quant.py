"""Quantized KV caches (fp8 e4m3, int8; per-token per-head scales): the round trip's error
bounds, paged attention over a quantized cache against float64 dense attention, wire blocks,
engines with a quantized cache (greedy agreement, prefill -> wire -> decode), and bad values."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention import get_backend
from pdserve.attention.base import AttentionMetadata
from pdserve.attention.kv_quant import QUANTS, kv_quant
from pdserve.engine.config import EngineArgs
from pdserve.engine.engine import Engine
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.request import Logprob
from pdserve.errors import BadRequest
from pdserve.hashing import hash_blocks
from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams
from services.engine.config import EngineServiceConfig
from services.engine.convert import check_block_refs
from tests.engine.helpers import GREEDY, make_engine, random_prompts, run_all
from tests.engine.test_attention import HD, HEADS, KVH, PAGE, PAGES, _dense
from tests.engine.test_disagg import _prefill

# Teacher-forced greedy agreement with the float32 cache on the tiny built-in model (measured:
# fp8 0.94, int8 0.975), and the largest logprob change (measured: 0.031, 0.0072).
MIN_AGREEMENT = {"fp8": 0.9, "int8": 0.95}
MAX_LOGPROB_DIFF = {"fp8": 0.1, "int8": 0.025}
# Largest deviation of attention output over a quantized cache from float64 dense attention
# on N(0, 1) keys/values (fp8: 3 mantissa bits, 2^-4 relative; int8: amax/254 per element).
ATTN_TOL = {"fp8": 0.1, "int8": 0.02}


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_round_trip_within_the_format_bound(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    # Heads spanning five orders of magnitude: a per-head scale keeps each one's precision.
    x = torch.randn(64, 4, 64, generator=g) * torch.logspace(-3, 2, 64)[:, None, None]
    quant = QUANTS[name]
    values, scales = quant.quantize(x)
    assert values.dtype == quant.storage and scales.shape == (64, 4)
    err = (quant.dequantize(values, scales, torch.float32) - x).abs()
    # fp8: 3 mantissa bits, half a step is 2^-4 relative, subnormals 2^-9 apart (times the
    # scale); int8: round to nearest of 127 steps of amax / 127.
    fp8_bound = x.abs() / 16 + scales[..., None] * 2**-9
    bound = fp8_bound if name == "fp8" else scales[..., None] / 2
    assert bool((err <= bound * (1 + 1e-5) + 1e-12).all())
    relative = err.amax(-1) / x.abs().amax(-1)
    assert float(relative.max()) < (0.07 if name == "fp8" else 0.0045)


def test_all_zero_heads_and_unit_scales() -> None:
    quant = QUANTS["fp8"]
    values, scales = quant.quantize(torch.zeros(3, 2, 8))
    assert bool((quant.dequantize(values, scales, torch.float32) == 0).all())
    values, scales = quant.quantize(torch.tensor([[1000.0, -0.5]]), unit=True)
    assert scales.tolist() == [1.0]  # FlashInfer's reading: cast as is, saturating at 448
    assert quant.dequantize(values, scales, torch.float32).tolist() == [[448.0, -0.5]]


def _quantized_step(name: str, cached: list[int], new: list[int], seed: int) -> float:
    """One torch-backend step over a quantized cache vs dense float64 attention on the
    unquantized K/V; returns the largest deviation."""
    quant = QUANTS[name]
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(2, PAGES, PAGE, KVH, HD, torch.float32, "cpu", quant)
    perm = torch.randperm(PAGES, generator=g).tolist()
    tables, slots, full, qs, ks, vs = [], [], [], [], [], []
    for c, n in zip(cached, new, strict=True):
        pages, perm = perm[:-(-(c + n) // PAGE)], perm[-(-(c + n) // PAGE):]
        tables.append(pages)
        k_all, v_all = torch.randn(2, c + n, KVH, HD, generator=g)
        for pos in range(c):  # the cached prefix, written as the engine would have
            for layer in range(2):
                for i, x in enumerate((k_all[pos], v_all[pos])):
                    vals, sc = quant.quantize(x)
                    cache.data[layer, pages[pos // PAGE], i, pos % PAGE] = vals
                    assert cache.scales is not None
                    cache.scales[layer, pages[pos // PAGE], i, pos % PAGE] = sc
        slots += [pages[p // PAGE] * PAGE + p % PAGE for p in range(c, c + n)]
        full.append((k_all, v_all))
        qs.append(torch.randn(n, HEADS, HD, generator=g))
        ks.append(k_all[c:])
        vs.append(v_all[c:])
    md = AttentionMetadata(
        qo_indptr=torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32),
        page_table=tables, kv_lens=torch.tensor([c + n for c, n in zip(cached, new,
                                                                         strict=True)]),
        slot_mapping=torch.tensor(slots), is_decode_only=all(n == 1 for n in new))
    backend = get_backend("torch", cache.layers, kv_scales=cache.layer_scales)
    backend.prepare(md)
    worst = 0.0
    for layer in range(2):
        out = backend.forward(layer, torch.cat(qs), torch.cat(ks), torch.cat(vs))
        ref = torch.cat([_dense(q, k, v, c) for q, (k, v), c in zip(qs, full, cached,
                                                                     strict=True)])
        worst = max(worst, float((out.double() - ref).abs().max()))
    return worst


@pytest.mark.parametrize("name", ["fp8", "int8"])
@pytest.mark.parametrize(("cached", "new"), [([0], [7]), ([0, 5, 9], [6, 3, 1]),
                                             ([3, 8, 12, 1], [1, 1, 1, 1])])
def test_attention_over_quantized_cache_is_close_to_float(name: str, cached: list[int],
                                                          new: list[int]) -> None:
    worst = _quantized_step(name, cached, new, seed=sum(cached) + 7 * sum(new))
    assert 0 < worst < ATTN_TOL[name]  # > 0: the cache really is quantized


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_wire_blocks_carry_values_and_scales(name: str) -> None:
    quant = QUANTS[name]
    a = PagedKVCache(3, 6, 4, 2, 8, torch.bfloat16, "cpu", quant)
    g = torch.Generator().manual_seed(1)
    vals, scales = quant.quantize(torch.randn(3, 6, 2, 4, 2, 8, generator=g))
    a.data.view(torch.uint8).copy_(vals.view(torch.uint8))
    assert a.scales is not None
    a.scales.copy_(scales)
    # 1 byte per value plus a float32 scale per token and head, vs 2 bytes per value in bf16.
    assert a.block_shape == (3 * 2 * 4 * 2 * (8 + 4),) and a.block_dtype == torch.uint8
    assert PagedKVCache.bytes_per_block(3, 4, 2, 8, torch.bfloat16, quant) == a.block_shape[0]
    out = torch.empty(2, *a.block_shape, dtype=torch.uint8)
    a.export_pages([4, 1], out)
    b = PagedKVCache(3, 6, 4, 2, 8, torch.bfloat16, "cpu", quant)
    b.import_pages([0, 5], out)
    assert torch.equal(b.data[:, [0, 5]].view(torch.uint8), a.data[:, [4, 1]].view(torch.uint8))
    assert b.scales is not None and torch.equal(b.scales[:, [0, 5]], a.scales[:, [4, 1]])
    if name != "fp8":
        return  # only FlashInfer's fp8 cache keeps unit scales
    unit = PagedKVCache(3, 6, 4, 2, 8, torch.bfloat16, "cpu", quant, unit_scales=True)
    unit.import_pages([2, 3], out)  # FlashInfer's cache: re-quantized to scale 1
    assert unit.scales is not None and bool((unit.scales == 1).all())
    deq = quant.dequantize(unit.data[:, 2], unit.scales[:, 2], torch.float32)
    want = quant.dequantize(a.data[:, 4], a.scales[:, 4], torch.float32)
    torch.testing.assert_close(deq, want, atol=2e-2, rtol=0.13)


def _scores(eng: Engine, prompts: list[list[int]]) -> tuple[list[int], list[float]]:
    """Teacher-forced: the greedy (top-1) choice and the logprob of the true next token at
    every prompt position, all prompts in one list."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    for i, p in enumerate(prompts):
        eng.add_request(f"s{i}", p, params)
    got: dict[str, list[Logprob]] = {}
    while eng.has_unfinished():
        got.update({o.request_id: o.prompt_logprobs for o in eng.step() if o.prompt_logprobs})
    scored = [lp for i in range(len(prompts)) for lp in got[f"s{i}"]]
    return [lp.top[0][0] for lp in scored], [lp.logprob for lp in scored]


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_engine_greedy_agrees_with_the_float_cache(name: str) -> None:
    """The tiny built-in has random weights (nearly flat next-token distributions, the worst
    case for argmax stability): teacher-forced greedy choices over 364 positions agree at
    least MIN_AGREEMENT with the float32 cache's, and logprobs stay within MAX_LOGPROB_DIFF."""
    prompts = random_prompts([120, 97, 150], seed=5)
    want_top, want_lp = _scores(make_engine(num_blocks=64), prompts)
    eng = make_engine(num_blocks=64, kv_cache_dtype=name, max_num_batched_tokens=32)
    got_top, got_lp = _scores(eng, prompts)
    eng.check_integrity()
    agreement = sum(a == b for a, b in zip(want_top, got_top, strict=True)) / len(want_top)
    assert agreement >= MIN_AGREEMENT[name], agreement
    diff = max(abs(a - b) for a, b in zip(want_lp, got_lp, strict=True))
    assert 0 < diff < MAX_LOGPROB_DIFF[name]
    assert eng.kv_dtype == QUANTS[name].name and eng.fingerprint.endswith(
        f"|kv={QUANTS[name].name}|NHD")
    tokens = run_all(eng, prompts[:1])[0][0]  # and it decodes
    assert len(tokens) == GREEDY.max_tokens


def test_quantized_prefill_export_import_decode_equals_single_engine() -> None:
    prompts = random_prompts([45, 70], seed=3)
    expected = run_all(make_engine(num_blocks=64, kv_cache_dtype="int8"), prompts)[0]
    a = make_engine(num_blocks=64, max_num_batched_tokens=32, kv_cache_dtype="int8")
    b = make_engine(num_blocks=64, kv_cache_dtype="int8")
    for i, (p, (final, _)) in enumerate(zip(prompts, _prefill(a, prompts), strict=True)):
        assert final.block_hashes is not None and final.page_ids is not None
        out = torch.empty(len(final.page_ids), *a.cache.block_shape, dtype=a.cache.block_dtype)
        a.export_blocks(final.page_ids, out)
        assert b.import_blocks(final.block_hashes, out) == len(final.block_hashes)
        params = SamplingParams(max_tokens=GREEDY.max_tokens - 1, temperature=0.0,
                                ignore_eos=True)
        first = final.new_token_ids[0]
        assert [first] + run_all(b, [p + [first]], params)[0][0] == expected[i]
    b.check_integrity()


def test_float_decode_refuses_quantized_blocks() -> None:
    """The fingerprint carries the KV dtype: an int8 prefill's block hashes are not this
    float32 engine's, so a decode refuses them (and a kvd Register/Transfer refuses the
    dtype itself: tests/kvd/test_kv_dtype.py)."""
    prompt = random_prompts([40], seed=9)[0]
    q, f = make_engine(num_blocks=16, kv_cache_dtype="int8"), make_engine(num_blocks=16)
    assert q.fingerprint != f.fingerprint
    from pdserve.proto.v1 import common_pb2

    refs = [common_pb2.BlockRef(hash=h) for h in hash_blocks(prompt, 16, q.fingerprint)]
    with pytest.raises(BadRequest, match=r"blocks\[0\].hash is not block 0 of this prompt "
                                         "on this model"):
        check_block_refs(refs, prompt, 16, f.fingerprint, "")
    with pytest.raises(ValueError, match="data must have shape"):
        f.cache.import_pages([0], torch.empty(1, *q.cache.block_shape, dtype=torch.uint8))


def test_bad_kv_cache_dtype_is_named() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8', "
                                         r"'int8'\), got 'fp4'"):
        EngineArgs(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM("tiny", kv_cache_dtype="float8")
    with pytest.raises(ValueError, match="got 'e5m2'"):
        kv_quant("e5m2")
    with pytest.raises(SystemExit) as exit_info:
        EngineServiceConfig.from_argv(["--kv-cache-dtype", "fp4"], environ={})
    assert exit_info.value.code == 2
    with pytest.raises(ValueError, match=r"--kv-cache-dtype: invalid value 'int4' "
                                         r"\(accepted: auto, fp8, int8\)"):
        EngineServiceConfig(kv_cache_dtype="int4")
    assert EngineServiceConfig(kv_cache_dtype="fp8").engine_args().kv_cache_dtype == "fp8"
