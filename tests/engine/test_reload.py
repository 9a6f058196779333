"""Hot reload in the engine: two random checkpoints of one architecture (built with
transformers), tokens before and after the swap against each one's transformers greedy
reference; the fingerprint follows the weights; bad reloads refused with their messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.config import EngineArgs
from pdserve.engine.engine import Engine
from pdserve.engine.reload import ReloadPolicy, prepare_weights, swap_weights
from pdserve.errors import BadRequest
from pdserve.hashing import hash_blocks
from pdserve.sampling_params import SamplingParams
from tests.engine.checkpoints import hf_greedy, save_llama

NEW_TOKENS = 12
PROMPTS = [[5, 17, 99, 3, 250, 8, 41, 77, 12, 60, 33, 2, 9, 140, 71, 18, 26, 90, 4],
           [300, 7, 7, 12, 55]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("reload")
    out = {}
    for name, seed, extra in (("a", 1, {}), ("b", 2, {}), ("wide", 3, {"hidden_size": 96})):
        (root / name).mkdir()
        out[name] = (root / name, save_llama(root / name, seed, **extra))
    return out


def run(engine: Engine, prompts: list[list[int]], tag: str) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, params)
    tokens: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    engine.check_integrity()
    return [tokens[f"{tag}{i}"] for i in range(len(prompts))]


def new_engine(path: Path) -> Engine:
    return Engine.from_model(str(path), EngineArgs(dtype="float32", num_blocks=64))


def test_tokens_before_and_after_a_reload_match_each_checkpoint(ckpts) -> None:
    (path_a, hf_a), (path_b, hf_b) = ckpts["a"], ckpts["b"]
    engine = new_engine(path_a)
    version_a, fp_a = engine.model_version, engine.fingerprint
    assert run(engine, PROMPTS, "a") == [hf_greedy(hf_a, p, NEW_TOKENS) for p in PROMPTS]
    lm = prepare_weights(str(path_b), engine)
    result = swap_weights(engine, lm, ReloadPolicy.FINISH)
    assert result.previous_version == version_a
    assert engine.model_version != version_a and engine.fingerprint != fp_a
    assert engine.kv.pool.num_cached == 0  # version a's cached blocks are gone
    expected_b = [hf_greedy(hf_b, p, NEW_TOKENS) for p in PROMPTS]
    # The test can tell the versions apart.
    assert expected_b != [hf_greedy(hf_a, p, NEW_TOKENS) for p in PROMPTS]
    assert run(engine, PROMPTS, "b") == expected_b
    # The same prompt hashes to other blocks under the new version.
    prompt = PROMPTS[0]
    assert hash_blocks(prompt, 16, fp_a) != hash_blocks(prompt, 16, engine.fingerprint)


def test_a_reloaded_engine_equals_one_started_on_the_checkpoint(ckpts) -> None:
    engine = new_engine(ckpts["a"][0])
    swap_weights(engine, prepare_weights(str(ckpts["b"][0]), engine), ReloadPolicy.FINISH)
    fresh = new_engine(ckpts["b"][0])
    assert (engine.model_version, engine.fingerprint) == (fresh.model_version, fresh.fingerprint)


def test_reprefill_recomputes_running_requests_on_the_new_weights(ckpts) -> None:
    (path_a, hf_a), (path_b, hf_b) = ckpts["a"], ckpts["b"]
    engine = new_engine(path_a)
    prompt = PROMPTS[0]
    engine.add_request("r", prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                   ignore_eos=True))
    tokens: list[int] = []
    while len(tokens) < 4:
        for out in engine.step():
            tokens += out.new_token_ids
    lm = prepare_weights(str(path_b), engine)
    assert swap_weights(engine, lm, ReloadPolicy.REPREFILL).num_reprefilled == 1
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    engine.check_integrity()
    assert tokens[:4] == hf_greedy(hf_a, prompt, 4)
    assert tokens[4:] == hf_greedy(hf_b, prompt + tokens[:4], NEW_TOKENS - 4)


def test_finish_policy_refuses_to_swap_under_running_requests(ckpts) -> None:
    engine = new_engine(ckpts["a"][0])
    engine.add_request("r", PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()
    lm = prepare_weights(str(ckpts["b"][0]), engine)
    with pytest.raises(RuntimeError, match="1 running and 0 queued requests have not finished"):
        swap_weights(engine, lm, ReloadPolicy.FINISH)


def test_a_different_architecture_is_refused_naming_the_field(ckpts) -> None:
    engine = new_engine(ckpts["a"][0])
    with pytest.raises(BadRequest, match=r"different architecture .*hidden_size 64 -> 96"):
        prepare_weights(str(ckpts["wide"][0]), engine)


def test_missing_or_empty_model_is_refused(ckpts, tmp_path: Path) -> None:
    engine = new_engine(ckpts["a"][0])
    with pytest.raises(BadRequest, match="model: cannot load '/no/such/dir'.*does not exist"):
        prepare_weights("/no/such/dir", engine)
    with pytest.raises(BadRequest, match="config.json not found"):
        prepare_weights(str(tmp_path), engine)
    with pytest.raises(BadRequest, match="model must not be empty"):
        prepare_weights("", engine)


def test_weights_version_follows_the_content(ckpts, tmp_path: Path) -> None:
    from pdserve.models import files

    a, b = ckpts["a"][0], ckpts["b"][0]
    text = (a / "config.json").read_text()
    assert text == (b / "config.json").read_text()  # same config, names and sizes
    fa, fb = files.weight_files(a), files.weight_files(b)
    assert [f.stat().st_size for f in fa] == [f.stat().st_size for f in fb]
    assert files.weights_version(fa) != files.weights_version(fb)
    assert files.fingerprint(text, fa) != files.fingerprint(text, fb)


class _NoGraphFits:
    """Stands in for captured CUDA graphs (CPU has none): no batch fits, so every step runs
    eager, on the very parameter tensors a graph would have captured."""

    def run(self, *args: object) -> None:
        return None


def test_under_cuda_graphs_the_new_weights_are_copied_into_the_captured_tensors(
        ckpts) -> None:
    (path_a, _), (path_b, hf_b) = ckpts["a"], ckpts["b"]
    engine = new_engine(path_a)
    engine.runner.graphs = _NoGraphFits()  # type: ignore[assignment]
    model = engine.runner.model
    captured = {n: p.data_ptr() for n, p in model.named_parameters()}
    swap_weights(engine, prepare_weights(str(path_b), engine), ReloadPolicy.FINISH)
    assert engine.runner.model is model  # same module, same storage, new values
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == captured
    assert run(engine, PROMPTS, "b") == [hf_greedy(hf_b, p, NEW_TOKENS) for p in PROMPTS]
