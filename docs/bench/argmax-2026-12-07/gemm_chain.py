import sys, time, tempfile, torch
from pdserve_bench.gemm_ceiling import gemm_step_seconds, decode_gemms
from pdserve.engine.config import EngineArgs
from pdserve.engine.engine import Engine
from pdserve.models import save_builtin
torch.set_num_threads(1)
dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"; dt = getattr(torch, dtype)
tmp = tempfile.mkdtemp(); save_builtin("bench-50m", tmp)
engine = Engine.from_model(tmp, EngineArgs(dtype=dtype, max_num_seqs=32, num_blocks=512, packed_weights=True))
model = engine.runner.model; n = 32
mods = decode_gemms(model)
inputs = [torch.randn(n, m.weight.shape[1]).to(dt) for m in mods]
head_in = torch.randn(n, model.config.hidden_size).to(dt)
def best(f, iters=15):
    b = 1e9
    for i in range(iters + 2):
        t = time.perf_counter(); f(); t = time.perf_counter() - t
        if i >= 2: b = min(b, t)
    return b * 1e3
@torch.inference_mode()
def ceiling():
    for m, x in zip(mods, inputs): m(x)
    model.compute_logits(head_in)
@torch.inference_mode()
def fresh_inputs():  # same as ceiling but each input a fresh copy
    for m, x in zip(mods, inputs): m(x.clone())
    model.compute_logits(head_in.clone())
@torch.inference_mode()
def chained():
    h = head_in
    for layer in model.layers:
        a = layer.self_attn
        qkv = a.qkv_proj(h)
        h = a.o_proj(qkv[:, :512].contiguous())
        gu = layer.mlp.gate_up_proj(h)
        h = layer.mlp.down_proj(gu[:, :2816].contiguous())
    model.compute_logits(h)
@torch.inference_mode()
def chained_real_inputs():  # chained order but ceiling's inputs (no data dependency)
    i = 0
    for layer in model.layers:
        a = layer.self_attn
        a.qkv_proj(inputs[i]); a.o_proj(inputs[i+1]); layer.mlp.gate_up_proj(inputs[i+2]); layer.mlp.down_proj(inputs[i+3]); i += 4
    model.compute_logits(head_in)
for r in range(3):
    print(dtype, "ceiling %.2f fresh %.2f chained %.2f ordered %.2f" % (best(ceiling), best(fresh_inputs), best(chained), best(chained_real_inputs)))
