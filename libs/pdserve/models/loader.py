"""load_model: a built-in name or a local Hugging Face directory -> LoadedModel."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from pdserve.models import builtin
from pdserve.models.base import CausalLM
from pdserve.models.config import ModelConfig, parse_hf_config, resolve_dtype
from pdserve.models.decoder import DecoderLM
from pdserve.models.files import builtin_tokenizer, fingerprint, weight_files, weights_version
from pdserve.models.packed import column_major_pays, pack
from pdserve.tokenizer import Tokenizer

_PROGRESS_MIN_BYTES = 100 * 2**20


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    version: str = ""  # the weights' version (files.weights_version; a built-in's name@seed)


def load_model(
    source: str, dtype: str = "auto", device: str | torch.device = "cpu",
    packed_weights: bool = True, float32_gemm: str = "mkl",
) -> LoadedModel:
    """``source``: a built-in (``tiny``, ``tiny-moe``, ``bench-50m``, optionally ``@<seed>``)
    or a local Hugging Face directory. ``dtype``: auto | float32 | bfloat16 | float16.
    ``packed_weights``: on CPU, pre-pack the GEMM weights (``packed.py``: faster decode, more
    weight memory); False keeps only the plain weights. ``float32_gemm``: which library's
    packed GEMM serves float32 weights (``packed.FLOAT32_GEMMS``)."""
    parsed = builtin.parse_builtin(source)
    if parsed is not None:
        return _load_builtin(*parsed, dtype=dtype, device=torch.device(device),
                             packed=packed_weights, float32_gemm=float32_gemm)
    path = Path(source)
    if path.is_dir():
        return _load_dir(path, dtype=dtype, device=torch.device(device), packed=packed_weights,
                         float32_gemm=float32_gemm)
    if path.exists():
        raise ValueError(f"model source {source!r} is a file; give a model directory")
    if "/" in source or source.startswith("."):
        raise FileNotFoundError(f"model directory {source!r} does not exist")
    raise ValueError(
        f"unknown model {source!r}: not a built-in ({', '.join(builtin.BUILTIN_MODELS)}) "
        "and no such directory"
    )


def _build(config: ModelConfig, device: torch.device,
           weights: Iterable[tuple[str, torch.Tensor]], packed: bool = True,
           float32_gemm: str = "mkl") -> CausalLM:
    # Meta first, so no memory is touched until the real weights arrive.
    with torch.device("meta"):
        model = DecoderLM(config)
    model = model.to(config.dtype).to_empty(device=device)
    with torch.no_grad():
        model.load_weights(weights)
        if device.type == "cpu":
            _pack_linears(model, packed, float32_gemm)
    return model.eval()


def _pack_linears(model: torch.nn.Module, packed: bool, float32_gemm: str = "mkl") -> None:
    """Pre-pack every ``Linear`` weight (and the LM head) for the CPU GEMM (``packed.py``),
    freeing the plain weight where the packed GEMM never reads it (bfloat16): the parameter
    becomes a meta tensor of the same shape, so reading its values fails loudly.

    Where nothing is packed (``packed`` False, or no packed GEMM applies), store the weight
    ``[out, in]`` column-major instead (same values, same shape, same memory) where that pays
    (``column_major_pays``): ``x @ W^T`` with ``W^T`` contiguous ran 1.3-1.9x faster for the
    8-64-row batches of continuous decoding with torch's plain oneDNN/MKL GEMMs on AVX-512.
    """
    from pdserve.models.layers import Linear

    for module in model.modules():
        if isinstance(module, Linear):
            module.packed = pack(module.weight.data, float32_gemm) if packed else None
            if module.packed is None:
                if column_major_pays(module.weight.dtype):
                    module.weight.data = module.weight.data.t().contiguous().t()
            elif module.packed.release_plain:
                module.weight = _meta_like(module.weight)
    if isinstance(model, DecoderLM) and packed:
        model.lm_head_packed = pack(
            model.embed_tokens.data if model.lm_head is None else model.lm_head.data,
            float32_gemm)
        head = model.lm_head_packed
        if model.lm_head is not None and head is not None and head.release_plain:
            model.lm_head = _meta_like(model.lm_head)


def _meta_like(param: torch.nn.Parameter) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                              requires_grad=False)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights in memory: the parameters that hold data plus every
    packed copy (``packed.py``)."""
    from pdserve.models.layers import Linear

    total = sum(p.numel() * p.element_size() for p in model.parameters()
                if p.device.type != "meta")
    packs = [m.packed for m in model.modules() if isinstance(m, Linear)]
    packs.append(getattr(model, "lm_head_packed", None))
    return total + sum(p.nbytes for p in packs if p is not None)


def _load_builtin(name: str, seed: int, dtype: str, device: torch.device,
                  packed: bool, float32_gemm: str = "mkl") -> LoadedModel:
    cfg = builtin.hf_config(name)
    tokenizer = builtin_tokenizer()
    config = parse_hf_config(
        cfg, dtype=resolve_dtype(dtype, cfg, device), eos_token_ids=tokenizer.eos_token_ids,
        fingerprint=builtin.fingerprint(name, seed),
    )
    model = _build(config, device, builtin.iter_weights(name, seed), packed, float32_gemm)
    return LoadedModel(model=model, config=config, tokenizer=tokenizer,
                       version=config.fingerprint)


def _iter_files(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    total = sum(f.stat().st_size for f in files)
    show = total > _PROGRESS_MIN_BYTES or len(files) > 1
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights",
              file=sys.stderr, disable=not show) as bar:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    tensor = f.get_tensor(name)
                    yield name, tensor
                    bar.update(tensor.numel() * tensor.element_size())


def _load_dir(path: Path, dtype: str, device: torch.device, packed: bool,
              float32_gemm: str = "mkl") -> LoadedModel:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"config.json not found in {path}")
    config_text = config_file.read_text(encoding="utf-8")
    cfg = json.loads(config_text)
    files = weight_files(path)
    tokenizer = Tokenizer.from_dir(path)
    eos = tokenizer.eos_token_ids
    if not eos and cfg.get("eos_token_id") is not None:
        raw = cfg["eos_token_id"]
        eos = (raw,) if isinstance(raw, int) else tuple(raw)
    version = weights_version(files)
    config = parse_hf_config(
        cfg, dtype=resolve_dtype(dtype, cfg, device), eos_token_ids=tuple(eos),
        fingerprint=fingerprint(config_text, files, version),
    )
    model = _build(config, device, _iter_files(files), packed, float32_gemm)
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, version=version)
