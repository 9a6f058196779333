"""The per-request detokenizer: streamed pieces equal ``decode`` of all ids, also when the
stream is split between a "prefill" and a "decode" detokenizer at any point; stop strings are
found wherever they fall and nothing they cut is ever released; each token's own bytes."""

from __future__ import annotations

import functools
import lzma
import time
from pathlib import Path

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.detokenizer import Detokenizer
from pdserve.models.loader import builtin_tokenizer
from pdserve.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parents[1] / "data"


@functools.cache
def real() -> Tokenizer:
    """SmolLM2-135M-Instruct's byte-level BPE (49,152 tokens; see tests/data/README.md)."""
    with lzma.open(DATA / "smollm2-tokenizer.json.xz") as f:
        return Tokenizer(tokenizers.Tokenizer.from_str(f.read().decode()))


TOKENIZERS = {"builtin": builtin_tokenizer, "smollm2": real}


def stream(tok: Tokenizer, ids: list[int], split: int, stop: tuple[str, ...] = (),
           include_stop: bool = False) -> tuple[str, bool]:
    """Text of ``ids`` as the services make it: a prefill detokenizer takes the first
    ``split`` tokens (0 = colocated), a decode one replays them and goes on."""
    first = Detokenizer(tok, stop, include_stop)
    sent = []
    for t in ids[:split]:
        first.append(t)
        sent.append(first.take())
    if first.stopped or split == len(ids):
        return "".join(sent) + first.finish(), first.stopped
    rest = Detokenizer(tok, stop, include_stop, replay=ids[:split])
    for t in ids[split:]:
        rest.append(t)
        sent.append(rest.take())
        if rest.stopped:
            break
    return "".join(sent) + rest.finish(), rest.stopped


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_pieces_concatenate_to_decode_of_all_ids_at_any_split(name: str,
                                                              data: st.DataObject) -> None:
    """Random ids include lone UTF-8 continuation bytes, split characters and specials."""
    tok = TOKENIZERS[name]()
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=40))
    split = data.draw(st.integers(0, len(ids)))
    assert stream(tok, ids, split) == (tok.decode(ids), False)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=40), data=st.data())
def test_text_round_trips_at_any_split(name: str, text: str, data: st.DataObject) -> None:
    tok = TOKENIZERS[name]()
    ids = tok.encode(text, add_special_tokens=False)
    split = data.draw(st.integers(0, len(ids)))
    assert stream(tok, ids, split)[0] == tok.decode(ids)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_stop_string_is_found_wherever_it_falls(name: str, data: st.DataObject) -> None:
    tok = TOKENIZERS[name]()
    before = data.draw(st.text(max_size=20))
    stop = data.draw(st.text(min_size=1, max_size=6))
    after = data.draw(st.text(max_size=10))
    include = data.draw(st.booleans())
    ids = tok.encode(before + stop + after, add_special_tokens=False)
    full = tok.decode(ids)
    split = data.draw(st.integers(0, len(ids)))
    text, stopped = stream(tok, ids, split, (stop,), include)
    at = full.find(stop)
    if at < 0:  # tokenization changed the text (e.g. normalized): no match to find
        assert (text, stopped) == (full, False)
    else:
        assert stopped
        assert text == full[: at + len(stop) if include else at]


def test_nothing_a_stop_string_cuts_is_released() -> None:
    tok = builtin_tokenizer()
    ids = tok.encode("hello world, this is the end of it", add_special_tokens=False)
    detok = Detokenizer(tok, stop=("the end",))
    sent = ""
    for t in ids:
        detok.append(t)
        sent += detok.take()
        assert "hello world, this is ".startswith(sent)  # never past the cut
        if detok.stopped:
            break
    assert detok.stopped and sent + detok.finish() == "hello world, this is "


def test_a_character_split_across_tokens_is_never_released_half() -> None:
    tok = real()
    ids = tok.encode("🌟🌟 你好", add_special_tokens=False)
    assert len(ids) > 6  # each character is several tokens here
    detok = Detokenizer(tok)
    pieces = []
    for t in ids:
        detok.append(t)
        pieces.append(detok.take())
    assert "".join(pieces) + detok.finish() == "🌟🌟 你好"
    assert "" in pieces and all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_stray_bytes_are_released_within_five_tokens(name: str) -> None:
    """A random model's output can run lone UTF-8 continuation bytes for many tokens; such a
    sequence never completes, so after four more tokens its U+FFFD and the text after it are
    released, not held to the end of the answer (the gateway sent such an answer's last 67
    tokens in one chunk, 1.8 s late)."""
    tok = TOKENIZERS[name]()
    stray = [next(i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd")]  # a byte
    ids = tok.encode("ok ", add_special_tokens=False) + stray * 12 + \
        tok.encode(" then more text follows here", add_special_tokens=False)
    detok = Detokenizer(tok)
    pieces, open_for = [], 0
    for t in ids:
        detok.append(t)
        pieces.append(detok.take())
        open_for = 0 if pieces[-1] else open_for + 1
        assert open_for <= 5
    assert "".join(pieces) + detok.finish() == tok.decode(ids)


def test_a_stop_string_that_begins_in_the_first_token_stops_the_decode() -> None:
    """The prefill's first token holds back what may begin a stop string; the decode engine,
    replaying that token, finds the match with the next one."""
    tok = builtin_tokenizer()
    ids = tok.encode("ab cd", add_special_tokens=False)
    first_text = tok.decode(ids[:1])
    stop = first_text + tok.decode(ids[1:2])
    text, stopped = stream(tok, ids, 1, (stop,))
    assert stopped and text == ""


def test_cost_per_token_is_flat_in_the_output_length() -> None:
    """Linear, not quadratic: 4,000 tokens cost per token what 100 cost (within noise).

    A quadratic detokenizer pays 40x per token at 4,000 against 100, so 8x still separates the
    two; the thread's CPU time (not wall time) keeps a loaded machine's descheduling out."""
    tok = real()
    words = tok.encode(" the quick brown fox jumps over the lazy dog" * 500,
                       add_special_tokens=False)

    def per_token(n: int) -> float:
        best = float("inf")
        for _ in range(5):
            detok = Detokenizer(tok, stop=("never appears",))
            start = time.thread_time()
            for t in words[:n]:
                detok.append(t)
                detok.take()
            detok.finish()
            best = min(best, (time.thread_time() - start) / n)
        return best

    short, long = per_token(100), per_token(4000)
    assert long < 8 * short, (short, long)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_token_bytes_are_exact(name: str) -> None:
    tok = TOKENIZERS[name]()
    text = "héllo 🌟 world, 你好"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    split = [i for i in ids if tok.token_bytes(i) and "\ufffd" in tok.token_text(i)]
    assert split  # some token holds a fragment of a character: its text shows U+FFFD
