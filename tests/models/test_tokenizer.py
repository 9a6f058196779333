"""Tokenizer: round trips, BOS/EOS rules, chat templates, streaming detokenization."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers

from pdserve.models import builtin_tokenizer
from pdserve.tokenizer import Tokenizer

TOK = builtin_tokenizer()
TEXTS = ["Hello, world!", "The river starts as a thin line.", "naïve café — 你好, мир 🙂",
         "  spaces\tand\nnewlines  ", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(text: str) -> None:
    ids = TOK.encode(text)
    assert ids[0] == TOK.bos_token_id == 0
    assert TOK.decode(ids) == text
    assert TOK.encode(text, add_special_tokens=False) == ids[1:]


def test_merges_make_common_words_short() -> None:
    assert len(TOK.encode(" the river", add_special_tokens=False)) == 2
    assert TOK.vocab_size == 512 and TOK.eos_token_ids == (1,)


@pytest.mark.parametrize("text", TEXTS)
def test_transformers_reads_the_saved_tokenizer_the_same(
    text: str, builtin_dirs: dict[str, Path]
) -> None:
    reference = transformers.AutoTokenizer.from_pretrained(builtin_dirs["tiny"])
    assert reference(text)["input_ids"] == TOK.encode(text)
    messages = [{"role": "user", "content": text}]
    assert reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) \
        == TOK.apply_chat_template(messages)


def test_chat_template_renders() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert TOK.apply_chat_template(messages) == (
        "<s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n")
    assert not TOK.apply_chat_template(messages, add_generation_prompt=False).endswith(
        "<|assistant|>\n")
    ids = TOK.encode(TOK.apply_chat_template(messages), add_special_tokens=False)
    assert ids[:2] == [0, TOK.token_to_id("<|system|>")]  # specials stay single tokens


def test_chat_template_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="unknown role robot"):
        TOK.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(TOK.backend).apply_chat_template([{"role": "user", "content": "x"}])


def _tokenizer_dir(tmp_path: Path, builtin_dirs: dict[str, Path], config: dict[str, object],
                   generation: dict[str, object] | None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copy(builtin_dirs["tiny"] / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_eos_from_generation_config_list_or_tokenizer_config(
    tmp_path: Path, builtin_dirs: dict[str, Path]
) -> None:
    both = _tokenizer_dir(tmp_path / "a", builtin_dirs, {"eos_token": "</s>"},
                          {"eos_token_id": [1, 4]})
    assert Tokenizer.from_dir(both).eos_token_ids == (1, 4)
    only_config = _tokenizer_dir(tmp_path / "b", builtin_dirs,
                                 {"eos_token": {"content": "<|user|>"}}, None)
    assert Tokenizer.from_dir(only_config).eos_token_ids == (3,)


def test_add_bos_token_from_tokenizer_config_wins(
    tmp_path: Path, builtin_dirs: dict[str, Path]
) -> None:
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False,
           "add_eos_token": True}
    tok = Tokenizer.from_dir(_tokenizer_dir(tmp_path, builtin_dirs, cfg, None))
    plain = TOK.encode("hi", add_special_tokens=False)
    assert tok.encode("hi") == [*plain, 1]


def test_chat_template_jinja_file_is_used(tmp_path: Path, builtin_dirs: dict[str, Path]) -> None:
    directory = _tokenizer_dir(tmp_path, builtin_dirs, {"bos_token": "<s>"}, None)
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert Tokenizer.from_dir(directory).apply_chat_template(
        [{"role": "user", "content": "a"}]) == "[a]"
