"""Where transformers' bfloat16 decode step goes: SmolLM2-135M-Instruct (built by
../shared/models/make_smollm2.sh into /work/models/smollm2), 32 sequences of 128 tokens,
5 decode steps under torch.profiler, one thread.
Run: .venv/bin/python docs/bench/native-kernels-2026-12-06-epyc/hf_profile.py [MODEL_DIR]
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM


def main() -> None:
    torch.set_num_threads(1)
    path = sys.argv[1] if len(sys.argv) > 1 else "/work/models/smollm2"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 40000, (32, 128))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        for step in range(6):  # one step unprofiled, then five
            past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            if step == 1:
                prof = profile(activities=[ProfilerActivity.CPU])
                prof.__enter__()
            out = model(nxt, past_key_values=past, use_cache=True)
        prof.__exit__(None, None, None)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


if __name__ == "__main__":
    main()
