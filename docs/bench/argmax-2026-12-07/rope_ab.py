import sys, time, torch
from pdserve_bench.engine import _prompts
from pdserve.engine.config import EngineArgs
from pdserve.engine.engine import Engine
from pdserve.models.kernels import Kernels
from pdserve.sampling_params import SamplingParams
torch.set_num_threads(1)
path = sys.argv[1]
n = 32
engine = Engine.from_model(path, EngineArgs(dtype="bfloat16", max_num_seqs=n, num_blocks=n * 20 + 16,
                                            max_num_batched_tokens=4096, native_kernels="auto"))
kern = engine.runner.model.layers[0].self_attn.kernels
native_rope = type(kern).rope_qk
params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
for i, p in enumerate(_prompts(n, 128, engine.config.vocab_size)):
    engine.add_request(f"x{i}", p, params)
engine.step(); engine.step()
res = {"native": [], "torch": []}
for rnd in range(8):
    for side in (("native", "torch") if rnd % 2 == 0 else ("torch", "native")):
        type(kern).rope_qk = native_rope if side == "native" else Kernels.rope_qk
        c = time.process_time()
        for _ in range(5): engine.step()
        res[side].append((time.process_time() - c) / 5 * 1e3)
type(kern).rope_qk = native_rope
for k, v in res.items():
    v = sorted(v); print(path[-9:], k, "CPU ms/step min %.2f median %.2f" % (v[0], v[len(v)//2]))
