"""An engine's measurement of its own capacity at start (``engine/calibrate.py``)."""

from __future__ import annotations

from pdserve.engine.calibrate import measure
from tests.engine.helpers import GREEDY, make_engine, random_prompts, run_all


def test_measure_gives_rates_and_leaves_a_fresh_engine() -> None:
    engine = make_engine(num_blocks=64, max_num_seqs=8)
    before = engine.stats()
    measured = measure(engine, prompt_len=48, batches=(1, 4, 16), steps=3)
    assert measured.prefill_tokens_per_s > 0
    # 16 sequences exceed max_num_seqs=8: left out, not measured wrongly
    assert [b for b, _ in measured.decode_steps] == [1, 4]
    assert all(s > 0 for _, s in measured.decode_steps)
    assert engine.stats() == before  # counters zeroed, nothing cached, nothing running
    assert not engine.has_unfinished()
    engine.check_integrity()
    # and it serves as a fresh engine does: same greedy tokens as one never measured
    prompts = random_prompts([20, 33])
    assert run_all(engine, prompts, GREEDY)[0] == run_all(make_engine(num_blocks=64), prompts,
                                                          GREEDY)[0]


def test_a_batch_the_cache_cannot_hold_is_left_out() -> None:
    engine = make_engine(num_blocks=6, max_num_seqs=64)  # 2 blocks per 16-token request
    assert [b for b, _ in measure(engine, prompt_len=32, batches=(1, 3, 4)).decode_steps] \
        == [1, 3]
