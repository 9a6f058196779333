"""``pdserve bench wirecodec``: would a lossless codec pay on the kvd->kvd link?

Real KV blocks (SmolLM2-135M, or ``--model``, prefilling the held-out text with its KV in
bfloat16 and in float32, exported in the wire layout) are compressed and decompressed on one
core by each codec: lz4 (frame, fastest level), zstd level 1 and -1 (``zstandard``), each also
after a byte shuffle (high and low bytes of every element grouped: the exponent bytes are the
compressible part of floats). A transfer that compresses, sends and decompresses in a pipeline
runs at ``raw / max(compress, wire, decompress)`` time; the table shows that rate next to the
raw link rate for each ``--link-gbs`` (GB/s; the kvd->kvd path on one host measures 2-9 GB/s,
docs/benchmarks.md). A codec pays only where its effective rate exceeds the link's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from pdserve.engine.config import EngineArgs
from pdserve.engine.engine import Engine
from pdserve.models import load_model
from pdserve.sampling_params import SamplingParams
from pdserve_bench.heldout import TEXT
from pdserve_bench.kvquant import default_model

Codec = tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]


@dataclass(frozen=True)
class Result:
    kv_dtype: str
    codec: str
    ratio: float
    compress_gbs: float
    decompress_gbs: float
    effective_gbs: dict[str, float]  # link GB/s -> end-to-end GB/s of raw KV with this codec


def codecs() -> dict[str, Codec]:
    """The codecs installed (lz4, zstandard: the bench extra); none always."""
    out: dict[str, Codec] = {"none": (bytes, bytes)}
    try:
        import lz4.frame as lz4f

        out["lz4"] = (lambda b: lz4f.compress(b, compression_level=0), lz4f.decompress)
    except ImportError:
        pass
    try:
        import zstandard

        for level in (1, -1):
            c = zstandard.ZstdCompressor(level=level)
            out[f"zstd{level}"] = (c.compress, zstandard.ZstdDecompressor().decompress)
    except ImportError:
        pass
    return out


def shuffled(codec: Codec, itemsize: int) -> Codec:
    compress, decompress = codec

    def enc(raw: bytes) -> bytes:
        arr = np.frombuffer(raw, np.uint8).reshape(-1, itemsize)
        return compress(arr.T.tobytes())

    def dec(blob: bytes) -> bytes:
        arr = np.frombuffer(decompress(blob), np.uint8).reshape(itemsize, -1)
        return arr.T.tobytes()

    return enc, dec


def kv_blocks(model: str, dtype: str) -> bytes:
    """The wire bytes of every full block of the held-out text's KV, ``dtype`` weights/KV."""
    engine = Engine(load_model(model, dtype=dtype), EngineArgs(num_blocks=128))
    assert engine.tokenizer is not None
    ids = list(engine.tokenizer.encode(TEXT))
    engine.add_request("t", ids, SamplingParams(max_tokens=1, temperature=0.0), hold=True)
    final = None
    while engine.has_unfinished():
        final = next((o for o in engine.step() if o.finished), final)
    assert final is not None and final.page_ids is not None
    out = torch.empty(len(final.page_ids), *engine.cache.block_shape, dtype=engine.cache.data.dtype)
    engine.export_blocks(final.page_ids, out)
    return out.view(torch.uint8).numpy().tobytes()


def _best(fn: Callable[[], bytes], repeats: int) -> tuple[float, bytes]:
    times, result = [], b""
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def measure(raw: bytes, kv_dtype: str, itemsize: int, links: list[float],
            repeats: int) -> list[Result]:
    out = []
    named = dict(codecs())
    named.update({f"shuffle+{k}": shuffled(v, itemsize) for k, v in codecs().items()
                  if k != "none"})
    for name, (enc, dec) in named.items():
        t_enc, blob = _best(lambda e=enc: e(raw), repeats)  # type: ignore[misc]
        t_dec, back = _best(lambda d=dec, b=blob: d(b), repeats)  # type: ignore[misc]
        if back != raw:
            raise AssertionError(f"{name}: round trip changed the bytes")
        if name == "none":
            t_enc = t_dec = 0.0
        gb = len(raw) / 1e9
        eff = {f"{link:g}": round(gb / max(t_enc, len(blob) / 1e9 / link, t_dec), 2)
               for link in links}
        out.append(Result(kv_dtype, name, round(len(raw) / len(blob), 3),
                          round(gb / t_enc, 2) if t_enc else 0.0,
                          round(gb / t_dec, 2) if t_dec else 0.0, eff))
    return out


def format_table(results: list[Result], links: list[float], nbytes: dict[str, int]) -> str:
    head = " ".join(f"{'@' + format(link, 'g') + 'GB/s':>9}" for link in links)
    lines = [f"{'kv':>9} {'codec':>14} {'ratio':>6} {'comp GB/s':>9} {'dec GB/s':>8} {head}"]
    for r in results:
        eff = " ".join(f"{r.effective_gbs[format(link, 'g')]:>9.2f}" for link in links)
        lines.append(f"{r.kv_dtype:>9} {r.codec:>14} {r.ratio:>6.3f} {r.compress_gbs:>9.2f} "
                     f"{r.decompress_gbs:>8.2f} {eff}")
    sizes = ", ".join(f"{k}: {v / 2**20:.1f} MiB" for k, v in nbytes.items())
    lines.append(f"(one core; KV of the held-out text: {sizes}; effective = raw GB/s end to "
                 "end, compress/send/decompress pipelined)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench wirecodec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--link-gbs", type=float, nargs="+", default=[2.0, 9.0],
                        help="link rates to compare against, GB/s")
    parser.add_argument("--repeats", type=int, default=3, help="best of N per codec")
    parser.add_argument("--json", action="store_true", help="JSON lines only")
    args = parser.parse_args(argv)
    if min(args.link_gbs) <= 0 or args.repeats < 1:
        parser.error("--link-gbs must be > 0 and --repeats >= 1")
    torch.set_num_threads(1)
    if len(codecs()) == 1:
        sys.stderr.write("pdserve bench wirecodec: neither lz4 nor zstandard is installed "
                         "(pip install lz4 zstandard); measuring 'none' only\n")
    results, sizes = [], {}
    for dtype, itemsize in (("bfloat16", 2), ("float32", 4)):
        raw = kv_blocks(args.model, dtype)
        sizes[dtype] = len(raw)
        results += measure(raw, dtype, itemsize, args.link_gbs, args.repeats)
    for r in results:
        print(json.dumps({"bench": "wirecodec", **asdict(r)}))
    if not args.json:
        print(format_table(results, args.link_gbs, sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
