"""Issue 19 end to end: ``pdserve reload`` on a real ``pdserve up`` stack (2 prefill + 2
decode engines, kvds, router, gateway, Redis) while clients keep generating. No request fails,
and every answer is exactly the transformers greedy reference of the version its usage names
(a prefill of one version decoded by the other would match neither)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdserve import auth
from pdserve.models import files
from pdserve.proto.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.e2e.stack import ROOT, UpStack, child_env, wait_until
from tests.engine.checkpoints import hf_greedy, save_llama

NEW_TOKENS = 10
PROMPTS = [[(7 * i + k) % 400 + 2 for i in range(n)] for k, n in ((0, 20), (3, 35), (5, 9))]
NUM_CLIENTS = 3


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """version -> (checkpoint dir, its greedy tokens per prompt)."""
    out = {}
    for name, seed in (("a", 11), ("b", 12)):
        path = tmp_path_factory.mktemp(name)
        hf = save_llama(path, seed)
        version = files.weights_version(files.weight_files(path))
        out[version] = (path, [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS])
    return out


@pytest.fixture(scope="module")
def stack(versions: dict[str, tuple[Path, Any]]) -> Iterator[UpStack]:
    first = next(iter(versions.values()))[0]
    up = UpStack(["--model", str(first), "--prefill", "2", "--decode", "2",
                  "--no-restart"]).start()
    yield up
    up.stop()


class Load:
    """Clients generating in a loop through the router until stopped."""

    def __init__(self, stack: UpStack) -> None:
        self.stack = stack
        self.results: list[tuple[int, list[int], str, float]] = []  # prompt, tokens, version
        self.errors: list[str] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(k,), daemon=True)
                        for k in range(NUM_CLIENTS)]

    def _client(self, k: int) -> None:
        with self.stack.channel(self.stack.router, auth.CLIENT) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            i = k
            while not self.stopping.is_set():
                try:
                    self.results.append(generate(stub, i % len(PROMPTS)))
                except grpc.RpcError as exc:
                    self.errors.append(f"prompt {i % len(PROMPTS)}: {exc.code().name}: "
                                       f"{exc.details()}")
                i += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=120)


def generate(stub: router_pb2_grpc.RouterStub, i: int) -> tuple[int, list[int], str, float]:
    req = router_pb2.GenerateRequest(
        prompt_token_ids=common_pb2.TokenIds(ids=PROMPTS[i]),
        sampling=common_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                           ignore_eos=True))
    tokens: list[int] = []
    version = ""
    for msg in stub.Generate(req, timeout=120):
        tokens += msg.token_ids
        if msg.HasField("usage"):
            version = msg.usage.model_version
    return i, tokens, version, time.monotonic()


def test_rolling_reload_under_load(stack: UpStack, versions: dict[str, tuple[Path, Any]],
                                   ) -> None:
    (old, (_, _)), (new, (new_dir, _)) = versions.items()
    with Load(stack) as load:
        while len(load.results) < 6 and not load.errors:
            time.sleep(0.1)
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "reload", "--model", str(new_dir),
             "--router", stack.router, "--secrets", stack.secrets_dir],
            cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
        finished = time.monotonic()
        time.sleep(2.0)  # requests after the reload too
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(f"-> {new}") == 4, proc.stdout  # every engine, one at a time
    assert not load.errors, load.errors[:5]
    seen = {version for _, _, version, _ in load.results}
    assert seen == {old, new}, seen
    for i, tokens, version, _ in load.results:
        assert tokens == versions[version][1][i], f"prompt {i} on {version} mixes versions"
    before = [v for _, _, v, t in load.results if t < started]
    after = [v for _, _, v, t in load.results if t > finished + 0.5]
    assert set(before) == {old} and after and set(after) == {new}


def test_reload_errors_name_the_cause(stack: UpStack, tmp_path: Path) -> None:
    def reload(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pdserve.cli", "reload", *args],
                              cwd=ROOT, env=child_env(), capture_output=True, text=True,
                              timeout=120)

    bad = reload("--model", str(tmp_path / "nothing"), "--router", stack.router,
                 "--secrets", stack.secrets_dir)
    assert bad.returncode == 1
    assert "pdserve reload: error: p0: INVALID_ARGUMENT: model: cannot load" in \
        bad.stderr, bad.stderr
    anonymous = reload("--model", str(tmp_path), "--router", stack.router)
    assert anonymous.returncode == 1
    assert "UNAUTHENTICATED" in anonymous.stderr, anonymous.stderr

    def all_healthy() -> bool:  # the failed one went back into rotation on the old weights
        with stack.channel(stack.router, auth.CLIENT) as channel:
            state = router_pb2_grpc.RouterStub(channel).ClusterState(
                router_pb2.ClusterStateRequest(), timeout=10)
        return len(state.instances) == 4 and all(i.healthy for i in state.instances)

    wait_until(all_healthy, timeout=30)
