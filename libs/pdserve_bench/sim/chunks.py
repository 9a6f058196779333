"""The measured inter-token latency is per streamed chunk, not per token: ``--validate`` groups
the simulated tokens into the chunks the real stream sent. (Runs whose stream carried the
per-chunk token count, ``continuous_usage = true`` through a gateway since 2026-12-06, have one
gap per token: ``chunk_sizes`` then gives one token per chunk, and the grouping is the identity.)

The engine streams text: a token whose bytes do not yet make printable text (a piece of a
UTF-8 character) adds none, and the bench client counts one token per chunk with text when
the stream carries no per-chunk token count (``pdserve_bench/stats.py`` spreads a chunk's gap
over its tokens only when it knows them), so a measured gap may span several tokens' steps.
Which tokens merge is a property of the answer's text, not of the serving arrangement: in the
validation run every request has the same number of chunks in all three stacks. bench-50m
(random weights) merges often: 24% of the decode tokens, and runs of ~50 tokens (a 1 s gap)
in a few answers, which is what sets the measured ITL tail.

A run file has each request's token count and chunk gaps, not the tokens per chunk, so
``chunk_sizes`` rebuilds them: the total is exact (tokens − 1 over len(gaps) chunks), and a
chunk's share is its gap's share of the request's decode time (largest remainder, at least
one each). So the sizes are read from the measured timing: with chunking, the simulated ITL
tail is not an independent prediction (its error is the per-token speed inside the held
chunks); ``--per-token-gaps`` gives the independent one. A chunk arrives with its last
token.
"""

from __future__ import annotations

import math


def chunk_sizes(itls: list[float], num_tokens: int) -> list[int]:
    """Tokens per chunk after the first token, for ``num_tokens`` decode tokens that arrived
    in ``len(itls)`` chunks with these gaps: in proportion to each gap (the request's tokens
    take about the same time each), at least one, summing to ``num_tokens``."""
    if not itls:
        return []
    if num_tokens <= len(itls) or sum(itls) <= 0:
        return [1] * len(itls)
    shares = [num_tokens * g / sum(itls) for g in itls]
    sizes = [max(1, math.floor(x)) for x in shares]
    by_remainder = sorted(range(len(itls)), key=lambda i: shares[i] - sizes[i], reverse=True)
    left = num_tokens - sum(sizes)
    for i in by_remainder[:max(left, 0)]:  # short: the largest remainders get one more
        sizes[i] += 1
    for i in reversed(by_remainder):  # over (gaps shorter than a token's time): trim
        if left >= 0:
            break
        if sizes[i] > 1:
            sizes[i] -= 1
            left += 1
    return sizes


def chunk_gaps(token_times: list[float], sizes: list[int]) -> list[float]:
    """The gaps between chunk arrivals: ``token_times`` (the first token's first) grouped by
    ``sizes``; a chunk the simulation did not reach (it ended first) is left out."""
    gaps, last, end = [], token_times[0], 0
    for k in sizes:
        end += k
        if end >= len(token_times):
            break
        gaps.append(token_times[end] - last)
        last = token_times[end]
    return gaps
