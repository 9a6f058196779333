"""Loader behaviour beyond parity: dtype resolution, progress output, devices."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.models import load_model
from pdserve.models.config import resolve_dtype


@pytest.mark.parametrize(("cfg", "requested", "expected"), [
    ({"dtype": "bfloat16"}, "auto", torch.bfloat16),
    ({"torch_dtype": "float16"}, "auto", torch.float16),  # the pre-v5 key
    ({}, "auto", torch.float32),
    ({"dtype": "bfloat16"}, "float32", torch.float32),
])
def test_resolve_dtype(cfg: dict, requested: str, expected: torch.dtype) -> None:
    assert resolve_dtype(requested, cfg) == expected


def _split_in_two_shards(directory: Path) -> None:
    weights = load_file(str(directory / "model.safetensors"))
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    weight_map: dict[str, str] = {}
    for file, part in halves.items():
        save_file({n: weights[n] for n in part}, str(directory / file))
        weight_map |= dict.fromkeys(part, file)
    (directory / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def test_progress_bar_only_for_sharded_or_large(
    tmp_path: Path, builtin_dirs: dict[str, Path], capfd: pytest.CaptureFixture[str]
) -> None:
    single = load_model(str(builtin_dirs["tiny"]))
    assert "loading weights" not in capfd.readouterr().err  # 13 MB, one file: quiet
    sharded = Path(shutil.copytree(builtin_dirs["tiny"], tmp_path / "sharded"))
    _split_in_two_shards(sharded)
    loaded = load_model(str(sharded))
    out = capfd.readouterr()
    assert "loading weights" in out.err and "loading weights" not in out.out
    for a, b in zip(single.model.parameters(), loaded.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_bfloat16_checkpoint_loads_as_bfloat16_on_auto(
    tmp_path: Path, builtin_dirs: dict[str, Path]
) -> None:
    directory = Path(shutil.copytree(builtin_dirs["tiny"], tmp_path / "bf16"))
    weights = load_file(str(directory / "model.safetensors"))
    save_file({n: t.to(torch.bfloat16) for n, t in weights.items()},
              str(directory / "model.safetensors"))
    cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    auto = load_model(str(directory))
    assert auto.config.dtype == torch.bfloat16
    upcast = load_model(str(directory), dtype="float32")
    expected = weights["model.embed_tokens.weight"].to(torch.bfloat16).float()
    assert torch.equal(dict(upcast.model.named_parameters())["embed_tokens"], expected)


def test_auto_dtype_is_bfloat16_on_cuda_for_float32_checkpoints() -> None:
    cfg = {"dtype": "float32"}
    assert resolve_dtype("auto", cfg, "cuda") == torch.bfloat16
    assert resolve_dtype("auto", cfg, "cpu") == torch.float32
    assert resolve_dtype("auto", {"dtype": "float16"}, "cuda:1") == torch.float16
    assert resolve_dtype("float32", cfg, "cuda") == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_cuda_matches_cpu(name: str) -> None:
    from .conftest import pdserve_logits

    cpu, gpu = load_model(name), load_model(name, dtype="float32", device="cuda")
    assert all(p.device.type == "cuda" for p in gpu.model.parameters())
    ids = torch.tensor(cpu.tokenizer.encode("The market opens near the bridge."))
    expected = pdserve_logits(cpu.model, ids)
    torch.testing.assert_close(pdserve_logits(gpu.model, ids.cuda()).cpu(), expected,
                               atol=1e-3, rtol=0)
