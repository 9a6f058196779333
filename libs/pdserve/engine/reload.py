"""Hot reload: new weights of the same architecture into a running engine.

    prepare_weights(source, engine)   off the step loop (a worker thread): read the checkpoint,
                                      check it is the same architecture, pick its kernels
    swap_weights(engine, lm, policy)  on the engine thread, between two steps: the pause

The swap only moves references (or, under CUDA graphs, copies the new tensors into the
captured ones, device to device): the new model is fully built before the step loop stops.
The block fingerprint changes with the weights' version, so no block computed by the old
weights is ever found by a hash of the new ones (in this engine, in a kvd or through the
index); the engine's own cached blocks of the old version are dropped at the swap.

    policy     requests in flight at the swap
    FINISH     none: the caller stops admitting and waits until they finished on the old
               weights (the default: no answer ever mixes two versions)
    REPREFILL  running and queued ones are preempted and recomputed from their prompt and
               tokens so far on the new weights (no wait; an answer may straddle the swap)
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import TYPE_CHECKING, NamedTuple

import torch

from pdserve.engine.request import RequestStatus
from pdserve.errors import BadRequest
from pdserve.models.config import ModelConfig

if TYPE_CHECKING:
    from pdserve.engine.engine import Engine
    from pdserve.models import LoadedModel



class ReloadPolicy(enum.Enum):
    FINISH = "finish"
    REPREFILL = "reprefill"


class SwapResult(NamedTuple):
    previous_version: str
    swap_s: float
    num_reprefilled: int


def check_same_architecture(old: ModelConfig, new: ModelConfig, source: str) -> None:
    """Raise BadRequest naming the first differing config fields: the KV cache, the kernels
    and every block in flight are shaped for ``old``."""
    # Only these may differ between two versions of one architecture.
    a = dataclasses.replace(old, fingerprint="-", eos_token_ids=())
    b = dataclasses.replace(new, fingerprint="-", eos_token_ids=())
    if a == b:
        return
    diffs = [f"{f.name} {getattr(a, f.name)!r} -> {getattr(b, f.name)!r}"
             for f in dataclasses.fields(ModelConfig)
             if getattr(a, f.name) != getattr(b, f.name)]
    raise BadRequest(f"model: {source!r} has a different architecture than the one served "
                     f"({'; '.join(diffs[:3])}); LoadWeights swaps weights of the same "
                     "architecture only: start a new instance for another model")


def prepare_weights(source: str, engine: Engine) -> LoadedModel:
    """Load ``source`` on the engine's device and dtype and make it ready to run. Slow; call
    it off the engine thread. Raises BadRequest for a missing, unreadable or other model."""
    from pdserve.models import load_model

    if not source:
        raise BadRequest("model must not be empty: give a checkpoint directory")
    try:
        lm = load_model(source, dtype=engine.args.dtype, device=engine.device,
                        packed_weights=engine.args.packed_weights,
                        float32_gemm=engine.args.float32_gemm)
    except (OSError, ValueError, KeyError) as exc:  # missing files, bad config, wrong tensors
        raise BadRequest(f"model: cannot load {source!r}: {exc}") from exc
    check_same_architecture(engine.config, lm.config, source)
    lm.model.select_kernels(engine.max_model_len, engine.args.native_kernels)
    return lm


@torch.inference_mode()
def swap_weights(engine: Engine, lm: LoadedModel, policy: ReloadPolicy) -> SwapResult:
    """Serve ``lm`` from the next step on. Run on the engine thread, between steps."""
    start = time.perf_counter()
    sched = engine.scheduler
    if policy is ReloadPolicy.FINISH and (sched.running or sched.waiting):
        raise RuntimeError(f"swap_weights(FINISH): {len(sched.running)} running and "
                           f"{len(sched.waiting)} queued requests have not finished")
    num_reprefilled = _requeue_all(engine)
    runner = engine.runner
    old_model = runner.model
    if runner.graphs is not None:
        # The captured graphs read the old tensors' addresses: copy the values in.
        new = dict(lm.model.named_parameters())
        for name, param in runner.model.named_parameters():
            param.copy_(new[name])
    else:
        runner.model = lm.model
    old_fp, new_fp = engine.config.fingerprint, lm.config.fingerprint
    assert engine.fingerprint.startswith(old_fp), "kv fingerprint extends the model's"
    # Only the model part changes; the KV part (dtype, layout) stays.
    engine.fingerprint = new_fp + engine.fingerprint.removeprefix(old_fp)
    engine.kv.fingerprint = engine.fingerprint
    engine.config = lm.config
    engine.eos_token_ids = frozenset(lm.config.eos_token_ids)  # for requests added from now
    previous, engine.model_version = engine.model_version, lm.version or new_fp
    engine.kv.pool.reset_prefix_cache()  # unreferenced old-version blocks: never hit again
    del old_model  # its memory is freed here, inside the measured pause
    return SwapResult(previous, time.perf_counter() - start, num_reprefilled)


def _requeue_all(engine: Engine) -> int:
    """Preempt every running request (its pages freed, recomputed later) and forget every
    queued one's block hashes: they were computed under the old fingerprint."""
    sched = engine.scheduler
    running = list(sched.running)
    for req in running:
        sched.decode.remove(req)
        sched.decode.preempt(req)
        sched.waiting.push(req)
    for req in engine.requests.values():
        if req.status == RequestStatus.WAITING:  # held ones keep theirs: old-version pages
            req.block_hashes.clear()
    return len(running)
