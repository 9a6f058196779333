"""Mid-stream failover: a decode engine failed after part of the answer went to the client.

The answer goes on from where the client is, on another decode engine:

    1. the tokens sent so far are split: all but the last join the prompt (their KV is
       computed again), the last is the decode's first token, as a prefill's would be
    2. a prefill engine computes that KV (its own sampled token is dropped) and the blocks go
       to the new decode as after any prefill; without a healthy prefill engine (colocated, or
       none left) the decode engine computes them itself
    3. the decode replays the tokens sent (``prior_output``): its text, stop strings,
       penalties and grammar go on exactly after them, so the client's stream has no
       duplicated or missing token or byte, and a greedy answer is the one it would have been
       (a seeded sampler starts afresh: another, equally likely continuation)

Only when no other decode engine is healthy, or ``max_retries`` failovers were spent, does the
stream end with the failure (``stream_interrupted`` over HTTP). The final usage counts the
failovers (``Usage.failovers``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pdserve.errors import StatusError
from pdserve.proto.v1 import common_pb2
from services.router import metrics
from services.router.flow import Flow, Interrupted, Resume
from services.router.instances import Instance, InstancePool
from services.router.phases import run_prefill
from services.router.policy import RoutingPolicy

log = logging.getLogger(__name__)


def resume_point(flow: Flow) -> Resume:
    """Where the answer stands: prompt + tokens sent, and what is left of max_tokens."""
    sent = flow.sent_ids
    prior = len(sent) - 1
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(flow.prepared.sampling)
    sampling.max_tokens = flow.prepared.sampling.max_tokens - prior
    sampling.ClearField("prompt_logprobs")  # the client has them already
    return Resume(prompt_ids=[*flow.prepared.prompt_ids, *sent[:-1]], first_token_id=sent[-1],
                  prior_output=prior, sampling=sampling)


async def fail_over(flow: Flow, policy: RoutingPolicy, pool: InstancePool, broken: Interrupted,
                    prefills: Sequence[Instance], decodes: Sequence[Instance]) -> None:
    """Make ``flow`` ready to decode the rest of its answer on another engine than
    ``broken.failed``; raise ``broken`` (told why) when there is none or failovers ran out."""
    assert flow.query is not None
    others = [d for d in decodes if d is not broken.failed and d.is_healthy]
    if not others or not flow.sent_ids:
        raise Interrupted(f"{broken.message}; no other decode instance is left to go on",
                          broken.failed) from broken
    if flow.num_failovers >= flow.max_retries:
        raise Interrupted(f"{broken.message}; {flow.num_failovers} failovers already",
                          broken.failed) from broken
    flow.num_failovers += 1
    flow.resume = resume_point(flow)
    metrics.RETRIES.labels("failover").inc()
    log.warning("decode failed mid-stream: failing over", extra={"fields": {
        "request_id": flow.prepared.meta.request_id, "failed": broken.failed.instance_id,
        "tokens_sent": flow.num_tokens_sent, "failover": flow.num_failovers}})
    healthy = [p for p in prefills if p.is_healthy]
    if healthy:
        try:
            await run_prefill(flow, policy, pool, healthy, others)
        except StatusError as exc:  # no prefill could: the decode engine computes the KV
            log.warning("failover prefill failed", extra={"fields": {"error": exc.message}})
        else:
            assert flow.prefill_response is not None
            flow.prefill_response.first_token_id = flow.resume.first_token_id
            return
    choice = policy.choose(flow.query, [], others)
    if choice is None:
        raise Interrupted(f"{broken.message}; no other decode instance takes it",
                          broken.failed) from broken
    flow.choice, flow.prefill_response = choice, None
