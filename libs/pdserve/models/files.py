"""What a model's files say without loading its weights (no torch): the built-in models'
tokenizer, a checkpoint's weight files, its weights' version and its fingerprint. The router
reads these; the loader builds on them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import xxhash

from pdserve.models import builtin_vocab as btok
from pdserve.tokenizer import Tokenizer

INDEX_FILE = "model.safetensors.index.json"
_CHUNK = 16 * 2**20


def builtin_tokenizer() -> Tokenizer:
    """The built-in models' tokenizer (same as the one ``save_builtin`` writes)."""
    import tokenizers

    cfg = btok.tokenizer_config()
    return Tokenizer(
        tokenizers.Tokenizer.from_str(btok.tokenizer_json()), bos_token=btok.BOS,
        eos_token=btok.EOS, eos_token_ids=(1,), chat_template=str(cfg["chat_template"]),
    )


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files (from the shard index when there is one)."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"shard {file.name} listed in {INDEX_FILE} is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights found in {path}")
    return files


def weights_version(files: list[Path]) -> str:
    """The weights' version: xxh3-128 of the weight files' bytes, in name order. Two
    checkpoints of one architecture differ in nothing else (config, names and sizes alike),
    so only the content tells a retrained or reloaded checkpoint apart. xxh3 reads at memory
    speed (~30 ms for SmolLM2-135M's 270 MB from the page cache)."""
    h = xxhash.xxh3_128()
    for file in sorted(files, key=lambda f: f.name):
        with file.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def fingerprint(config_text: str, files: list[Path], version: str | None = None) -> str:
    """sha256 of config.json's text, the sorted weight file names and sizes and the weights'
    version (``weights_version``, computed when not given): blocks computed by one checkpoint
    never serve another, even of the same architecture (hot reload)."""
    h = hashlib.sha256(config_text.encode())
    for file in sorted(files, key=lambda f: f.name):
        h.update(f"\n{file.name}:{file.stat().st_size}".encode())
    h.update(f"\nweights:{version or weights_version(files)}".encode())
    return h.hexdigest()
