"""Every user-caused error raises ValueError naming the field."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.cli import generate_main
from pdserve.engine.config import EngineArgs
from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams
from tests.engine.helpers import make_engine


@pytest.mark.parametrize(("kw", "field"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"logprobs": -1}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
])
def test_sampling_params_reject(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


@pytest.mark.parametrize(("kw", "field"), [
    ({"block_size": 0}, "block_size"),
    ({"num_blocks": 0}, "num_blocks"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
    ({"attention_backend": "cuda-magic"}, "attention_backend"),
    ({"dtype": "float64"}, "dtype"),
    ({"device": "nonsense"}, "device"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"device": "mps"}, "pdserve runs on cpu or cuda"),
])
def test_engine_args_reject(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineArgs(**kw)


def _no_cuda_message(device: str) -> str:
    if torch.version.cuda is None:
        return (f"device {device!r}: this torch ({torch.__version__}) is a CPU-only build; "
                "install a CUDA build of torch and the gpu extra")
    return (f"device {device!r}: no CUDA device is visible (check the driver and "
            "CUDA_VISIBLE_DEVICES)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_where_none_exists_is_one_clear_line(device: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError) as err:
        EngineArgs(device=device)
    assert str(err.value) == _no_cuda_message(device)
    assert generate_main(["--prompt", "hi", "--device", device]) == 2
    assert capsys.readouterr().err == f"error: {_no_cuda_message(device)}\n"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM.from_engine(make_engine(num_blocks=32, max_model_len=256))


@pytest.mark.parametrize(("prompt", "message"), [
    ("", "prompt must not be empty"),
    ([], "prompts must not be empty"),
    ([[]], "prompt must not be empty"),
    ([1, 2, 100000], r"vocab_size"),
    ([-1], r"vocab_size"),
    ([5] * 256, "max_model_len"),
    ([[1, 2], "a", 3.5], "prompt must be a string or a list of int"),
])
def test_generate_rejects_bad_prompts(llm: LLM, prompt, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.pool.num_used == 0


def test_request_that_cannot_fit_the_cache(llm: LLM) -> None:
    small = LLM.from_engine(make_engine(num_blocks=8))  # 128 tokens of KV
    with pytest.raises(ValueError, match="num_blocks=8"):
        small.generate([5] * 100, SamplingParams(max_tokens=50))
    # 32 blocks hold 512 tokens and max_model_len caps the request at 256: it fits, and
    # stops at the context limit.
    assert len(llm.generate([5] * 200, SamplingParams(max_tokens=100, temperature=0,
                                                      ignore_eos=True))[0].token_ids) == 56


def test_engine_level_errors(llm: LLM) -> None:
    engine = llm.engine
    with pytest.raises(ValueError, match="params must be SamplingParams"):
        engine.add_request("x", [1, 2], {"max_tokens": 3})  # type: ignore[arg-type]
    engine.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="request_id 'dup'"):
        engine.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="priority"):
        engine.add_request("p", [1, 2], SamplingParams(max_tokens=1), priority=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request("s", [1, 2], SamplingParams(max_tokens=1), cache_salt=None)  # type: ignore[arg-type]
    engine.abort("dup")
    engine.step()
    with pytest.raises(ValueError, match="params has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()])


def test_unknown_model_dtype_and_engine_arg() -> None:
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match="dtype"):
        LLM("tiny", dtype="int3")
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM("tiny", num_bloks=3)


def test_cli_generates_and_reports_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert generate_main(["--model", "tiny", "--prompt", "hello", "--max-tokens", "5",
                          "--verbose"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "finish_reason=length" in captured.err
    assert generate_main(["--model", "tiny", "--prompt", "hello", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert generate_main(["--model", "nope", "--prompt", "hello"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_sliding_window_caps_the_context() -> None:
    """Full attention matches a windowed model only up to its window: prompts beyond it are
    refused with the limit named, never silently answered differently from the reference."""
    import dataclasses

    from pdserve.engine.engine import Engine
    from pdserve.models import LoadedModel, load_model

    lm = load_model("tiny")
    windowed = LoadedModel(lm.model, dataclasses.replace(lm.config, sliding_window=64),
                           lm.tokenizer)
    engine = Engine(windowed, EngineArgs(num_blocks=16))
    assert engine.max_model_len == 64
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("r", list(range(1, 65)), SamplingParams(max_tokens=1))
    engine.add_request("ok", list(range(1, 60)), SamplingParams(max_tokens=2))
