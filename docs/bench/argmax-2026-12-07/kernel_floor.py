"""Kernel-only decode step floor vs GEMM ceiling vs engine step, one process, bench-50m.

floor_ms: the step's GEMMs chained as in a forward (each on the last one's output), the native
decode attention on K/V of the step's size (32 sequences, 129-159 keys, one K/V per layer), the
native add+RMSNorm and SiLU-and-mul, the LM head and argmax; no RoPE, no cache stores, no
scheduling, no Python engine. gemms_in_loop_ms: the same without attention and elementwise.
Run from the repository root: .venv/bin/python docs/bench/argmax-2026-12-07/kernel_floor.py bfloat16
"""
import sys, time, tempfile, json, torch
from pdserve_bench.engine import _prompts, run_pdserve
from pdserve_bench.gemm_ceiling import gemm_step_seconds, decode_gemms
from pdserve.engine.config import EngineArgs
from pdserve.engine.engine import Engine
from pdserve.models import save_builtin
torch.set_num_threads(1)
dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
dt = getattr(torch, dtype)
tmp = tempfile.mkdtemp(); save_builtin("bench-50m", tmp)
n = 32; ctx = 160
engine = Engine.from_model(tmp, EngineArgs(dtype=dtype, max_num_seqs=n, num_blocks=n*(ctx//16+4)+16,
    max_num_batched_tokens=2048, packed_weights=True, native_kernels="auto"))
model = engine.runner.model; cfg = model.config
native = engine.runner.backend.native
kern = model.layers[0].mlp.kernels
H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
G = H // KVH
g = torch.Generator().manual_seed(0)
lens = torch.randint(129, 160, (n,), generator=g, dtype=torch.int64)
cap = 192
kvs = [torch.randn(2, n, cap, KVH * D, generator=g).to(dt) for _ in model.layers]
x0 = torch.randn(n, cfg.hidden_size, generator=g).to(dt)

@torch.inference_mode()
def floor_step(attn=True, elem=True):
    h = x0; res = x0
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        if elem: h, res = layer.input_layernorm.add_forward(h, res)
        qkv = a.qkv_proj(h)
        if attn:
            q = qkv[:, :H*D].reshape(n, KVH, G, D).contiguous()
            o = native(q, kvs[i], lens, D ** -0.5).reshape(n, H * D)
        else:
            o = qkv[:, :H*D].contiguous()
        h = a.o_proj(o)
        if elem: h, res = layer.post_attention_layernorm.add_forward(h, res)
        gu = layer.mlp.gate_up_proj(h)
        m = kern.silu_and_mul(gu) if elem else gu[:, :gu.shape[1]//2].contiguous()
        h = layer.mlp.down_proj(m)
    return model.compute_logits(h).argmax(-1)

def best(fn, iters=10, clock=time.perf_counter):
    b = 1e9
    for i in range(iters + 2):
        t = clock(); fn(); t = clock() - t
        if i >= 2: b = min(b, t)
    return b

prompts = _prompts(n, 128, cfg.vocab_size)
run_pdserve(engine, _prompts(2, 16, cfg.vocab_size), 4)
rows = []
for rep in range(3):
    pre, dec, cpu = run_pdserve(engine, prompts, 32)
    step = dec / 31
    ceil = gemm_step_seconds(model, n)
    fl = best(floor_step)
    fl_noattn = best(lambda: floor_step(attn=False))
    rows.append(dict(step_ms=step*1e3, ceiling_ms=ceil*1e3, floor_ms=fl*1e3, gemms_in_loop_ms=fl_noattn*1e3))
    print(json.dumps({k: round(v, 2) for k, v in rows[-1].items()}))
r = {k: min(x[k] for x in rows) for k in rows[0]}
print(dtype, "best:", {k: round(v, 2) for k, v in r.items()},
      "ceiling/floor %.0f%%" % (100*r['ceiling_ms']/r['floor_ms']),
      "ceiling/step %.0f%%" % (100*r['ceiling_ms']/r['step_ms']))
