"""``pdserve bench detok``: what turning tokens into streamed text costs per token, against the
output's length, side by side in one run.

    incremental   pdserve's per-request detokenizer (tokenizers' DecodeStream, stop strings
                  searched in a bounded window)
    re-decode     decoding the whole output again after every token to look for a stop
                  string (what the engine did before), for comparison

Each is timed on the same tokens (a real text's, repeated to length), with one stop string
that never matches, best of ``--repeats``; the result is microseconds per token at each
length. Flat means linear in the output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

from pdserve.engine.detokenizer import Detokenizer
from pdserve.tokenizer import Tokenizer

TEXT = ("Streaming text costs little when each token is decoded once: the quick brown fox "
        "jumps over the lazy dog, 你好, and a star 🌟 for good measure. ")
STOP = ("a stop string that never appears",)


def _incremental(tok: Tokenizer, ids: list[int]) -> None:
    detok = Detokenizer(tok, STOP)
    for t in ids:
        detok.append(t)
        detok.take()
    detok.finish()


def _redecode(tok: Tokenizer, ids: list[int]) -> None:
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        if any(s in text for s in STOP):
            break


def _us_per_token(fn: Callable[[Tokenizer, list[int]], None], tok: Tokenizer,
                  ids: list[int], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(tok, ids)
        best = min(best, time.perf_counter() - start)
    return best / len(ids) * 1e6


def bench(tok: Tokenizer, lengths: list[int], repeats: int) -> list[dict[str, float]]:
    base = tok.encode(TEXT, add_special_tokens=False)
    rows = []
    for n in lengths:
        ids = (base * (n // len(base) + 1))[:n]
        rows.append({"num_tokens": n,
                     "incremental_us_per_token": _us_per_token(_incremental, tok, ids, repeats),
                     "redecode_us_per_token": _us_per_token(_redecode, tok, ids, repeats)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench detok", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny",
                        help="whose tokenizer: a built-in name or a Hugging Face directory")
    parser.add_argument("--lengths", type=int, nargs="+", default=[100, 4000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if min(args.lengths) < 1 or args.repeats < 1:
        parser.error("--lengths and --repeats must be >= 1")
    from pdserve.models import builtin, loader

    tok = (loader.builtin_tokenizer() if builtin.parse_builtin(args.model) is not None
           else Tokenizer.from_dir(args.model))
    rows = bench(tok, args.lengths, args.repeats)
    if args.json:
        for row in rows:
            print(json.dumps({"model": args.model, **row}))
        return 0
    print(f"tokenizer of {args.model} ({tok.vocab_size} tokens), best of {args.repeats}")
    print(f"{'tokens':>8}{'incremental us/token':>24}{'re-decode us/token':>22}")
    for row in rows:
        print(f"{row['num_tokens']:>8}{row['incremental_us_per_token']:>24.2f}"
              f"{row['redecode_us_per_token']:>22.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
