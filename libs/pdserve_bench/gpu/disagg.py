"""Part d: one disaggregated request on one GPU, each service its own process.

    kvd A ◄─shm─ prefill (cuda) ══ push over UCX ══► kvd B ─shm─► decode (cuda)

The prefill and decode engines share the GPU (a memory share each), load the same checkpoint
directory, and move the KV blocks through their node's kvd, staged through the kvd pools
registered as pinned memory. The reference: a colocated engine in this process on the same
weights and device; the tokens must be identical (the prompt is whole blocks, so decode's
first step computes only the first token, as colocated decoding does).
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import torch

from pdserve.proto.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from pdserve.sampling_params import SamplingParams
from pdserve_bench.gpu import shapes

READY = re.compile(r"pdserve (\w+) listening on (\S+):(\d+)")
PROMPT_LEN, NEW_TOKENS = 64, 16


class Service:
    """``python -m services.<name> --port 0 ...``, up once it prints its ready line."""

    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.tail: list[str] = []
        cmd = [sys.executable, "-m", f"services.{name}", "--host", "127.0.0.1", "--port", "0",
               *args]
        self.popen = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
        self.port = 0

    def wait_ready(self, timeout: float) -> None:
        assert self.popen.stdout is not None and self.popen.stderr is not None
        threading.Thread(target=self._keep_tail, daemon=True).start()
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(self.popen.stdout.readline()),  # type: ignore[union-attr]
                                  daemon=True)
        reader.start()
        reader.join(timeout)
        match = READY.search(lines[0]) if lines else None
        if match is None:
            time.sleep(0.5)
            raise RuntimeError(f"{self.name} did not start (exit {self.popen.poll()}): "
                               + " | ".join(self.tail[-8:]))
        self.port = int(match.group(3))

    def _keep_tail(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self.tail = [*self.tail[-30:], line.rstrip()]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()


def reference(model_dir: Path, device: torch.device, prompt: list[int]) -> list[int]:
    """Greedy tokens of a colocated engine in this process (same weights, same device)."""
    from pdserve.engine.config import EngineArgs
    from pdserve.engine.engine import Engine

    eng = Engine.from_model(str(model_dir), EngineArgs(
        device=str(device), dtype="bfloat16", num_blocks=64, max_num_seqs=8))
    eng.add_request("ref", prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                  ignore_eos=True))
    tokens: list[int] = []
    while eng.has_unfinished():
        for out in eng.step():
            tokens += out.new_token_ids
    return tokens


async def one_request(prefill: str, decode: str, kvd_b: common_pb2.KvdEndpoint,
                      prompt: list[int]) -> tuple[list[int], dict[str, Any]]:
    sampling = common_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                         ignore_eos=True)
    async with grpc.aio.insecure_channel(prefill) as pch, \
            grpc.aio.insecure_channel(decode) as dch:
        t0 = time.perf_counter()
        first = await engine_pb2_grpc.PrefillStub(pch).Prefill(engine_pb2.PrefillRequest(
            meta=common_pb2.RequestMeta(request_id="d0"), prompt_token_ids=prompt,
            sampling=sampling, destination=kvd_b), timeout=120)
        t1 = time.perf_counter()
        req = engine_pb2.DecodeRequest(meta=common_pb2.RequestMeta(request_id="d0"),
                                       prompt_token_ids=prompt, sampling=sampling,
                                       first_token_id=first.first_token_id)
        req.blocks.extend(first.blocks)
        req.source.CopyFrom(first.source)
        tokens = [first.first_token_id]
        async for chunk in engine_pb2_grpc.DecodeStub(dch).Decode(req, timeout=120):
            tokens += list(chunk.token_ids)
        t2 = time.perf_counter()
    return tokens, {"blocks": len(first.blocks), "prefill_ms": (t1 - t0) * 1e3,
                    "decode_ms": (t2 - t1) * 1e3}


def check(name: str, device: torch.device, workdir: Path, root: Path) -> dict[str, Any]:
    hf = shapes.hf_model(name, device)
    vocab = hf.config.vocab_size
    model_dir = shapes.save_dir(hf, workdir / f"{name}-bf16", torch.bfloat16)
    del hf
    torch.cuda.empty_cache() if device.type == "cuda" else None
    prompt = shapes.prompts(1, PROMPT_LEN, vocab, seed=7)[0]
    expect = reference(model_dir, device, prompt)
    env = {**os.environ, "PYTHONPATH": f"{root}:{root / 'libs'}:{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1", "UCXPY_PROGRESS_MODE": "blocking"}
    engine_flags = ["--model", str(model_dir), "--dtype", "bfloat16", "--device", str(device),
                    "--max-num-seqs", "8", "--gpu-memory-utilization", "0.2"]
    procs = [Service("kvd", ["--node-id", "node-a", "--capacity-mib", "256"], env),
             Service("kvd", ["--node-id", "node-b", "--capacity-mib", "256"], env)]
    try:
        for p in procs:
            p.wait_ready(60)
        kvd_a, kvd_b = procs
        procs += [Service("prefill", ["--kvd", kvd_a.address, *engine_flags], env),
                  Service("decode", ["--kvd", kvd_b.address, *engine_flags], env)]
        for p in procs[2:]:
            p.wait_ready(240)
        dest = common_pb2.KvdEndpoint(node_id="node-b", address=kvd_b.address)
        tokens, timing = asyncio.run(one_request(procs[2].address, procs[3].address, dest,
                                                 prompt))
    finally:
        for p in procs:
            p.stop()
    return {"model": name, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS,
            "transport": "UCX between the kvds (ucxx from the bundle)", **timing,
            "tokens": tokens, "reference": expect, "ok": tokens == expect}
