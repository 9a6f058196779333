"""What one simulated engine step costs: the rows it computes, not decode time plus prompt time.

A step of the engine (``pdserve.engine``: chunked prefill under ``max_num_batched_tokens``)
runs its running decodes (one row each) and any prompt chunk (one row per token) through the
model as one flat batch, so its cost follows the number of rows ``T = decodes + prompt
tokens``:

    step_cost(b, P) = max(step_time(min(T, largest measured batch)), prefill_time(T))

    few rows    the decode curve (a 32-token prompt costs about a decode step of 32
                sequences, not 32 / prefill rate: the GEMMs of a few rows are no cheaper
                per call); capped at the largest measured batch, past which the fitted
                decode line (made for b <= 32) means nothing
    many rows   the prefill rate (the b decode rows ride in a chunk of hundreds of tokens
                almost for free)

The model it replaces added the two, ``step_time(b) + P / prefill rate``: too dear for a long
prompt with decodes (it charges the decodes' weight reads twice) and too cheap for a short
prompt alone. ``python -m pdserve_bench.sim.steps`` measures both sides on the engine;
docs/benchmarks.md has the numbers.
"""

from __future__ import annotations

from pdserve.controller.capacity import CapacityModel


def step_cost(model: CapacityModel, num_decodes: int, num_prompt_tokens: int) -> float:
    """Seconds of one step computing ``num_decodes`` decode rows and ``num_prompt_tokens``
    prompt rows at full speed."""
    if num_prompt_tokens == 0:
        return model.step_time(num_decodes)
    rows = num_decodes + num_prompt_tokens
    cap = int(model.decode_points[-1][0]) if model.decode_points else model.max_batch
    return max(model.step_time(min(rows, cap)), model.prefill_time(rows))
