"""cProfile (thread CPU clock) over 20 decode steps of bench-50m at 32 sequences, one torch
thread, native kernels on auto: where a step goes. Run: .venv/bin/python
docs/bench/native-kernels-2026-12-06-xeon/step_cprofile.py float32|bfloat16
"""
import cProfile
import pstats
import sys
import tempfile
import time

import torch

from pdserve.engine.config import EngineArgs
from pdserve.engine.engine import Engine
from pdserve.models import save_builtin
from pdserve.sampling_params import SamplingParams

torch.set_num_threads(1)
dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
with tempfile.TemporaryDirectory() as tmp:
    save_builtin("bench-50m", tmp)
    engine = Engine.from_model(tmp, EngineArgs(dtype=dtype, max_num_seqs=32,
        num_blocks=32 * (10 + 4) + 16, max_num_batched_tokens=2048, packed_weights=True,
        native_kernels="auto"))
g = torch.Generator().manual_seed(32)
prompts = torch.randint(2, engine.config.vocab_size, (32, 128), generator=g).tolist()
params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
for i, p in enumerate(prompts):
    engine.add_request(f"r{i}", p, params)
for _ in range(6):
    engine.step()
pr = cProfile.Profile(time.thread_time)
pr.enable()
for _ in range(20):
    engine.step()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
