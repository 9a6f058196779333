"""Issue 11 end to end: the same text offline, colocated and disaggregated (real ``pdserve up``
stacks, the official ``openai`` client), when the first token is an incomplete UTF-8 sequence
and when a stop string begins in the first token; a second chat turn reuses the first answer's
blocks, and nothing stays pinned."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.proto.v1 import engine_pb2, engine_pb2_grpc, kvd_pb2, kvd_pb2_grpc
from tests.e2e.stack import UpStack, wait_until

MAX_TOKENS = 12
BLOCK = 16
WORDS = "is was as the of and to in it you that he for on are with his they be at one"
CANDIDATES = [f"{word} {i}" for i, word in enumerate(WORDS.split())]


@pytest.fixture(scope="module")
def stacks() -> Iterator[dict[str, UpStack]]:
    """A disaggregated (1 prefill + 1 decode) and a colocated stack, started side by side."""
    ups = {"disaggregated": UpStack(["--model", "tiny", "--prefill", "1", "--decode", "1",
                                     "--no-restart"]),
           "colocated": UpStack(["--model", "tiny", "--colocated", "--decode", "1",
                                 "--no-restart"])}
    errors: list[BaseException] = []

    def start(up: UpStack) -> None:
        try:
            up.start()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(up,)) for up in ups.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        if errors:
            raise errors[0]
        yield ups
    finally:
        for up in ups.values():
            up.stop()


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny")


def _client(up: UpStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.base_url, api_key="none", max_retries=0, timeout=60)


def _complete(up: UpStack, prompt: str, stream: bool, **extra: object) -> tuple[str, str]:
    client = _client(up)
    if not stream:
        resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0, **extra)  # type: ignore[call-overload]
        return resp.choices[0].text, resp.choices[0].finish_reason
    pieces, reason = [], ""
    for chunk in client.completions.create(model="tiny", prompt=prompt, stream=True,
                                           max_tokens=MAX_TOKENS, temperature=0,
                                           **extra):  # type: ignore[call-overload]
        for choice in chunk.choices:
            pieces.append(choice.text)
            reason = choice.finish_reason or reason
    return "".join(pieces), reason


def _split_first_token_prompt(llm: LLM) -> str:
    """A prompt whose first greedy token is an incomplete UTF-8 sequence on its own."""
    tok = llm.tokenizer
    assert tok is not None
    for prompt in CANDIDATES:
        first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]
        try:
            tok.token_bytes(first.token_ids[0]).decode()
        except UnicodeDecodeError:
            return prompt
    raise AssertionError("no candidate prompt starts its answer with a split character")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_split_first_character_is_not_lost(stacks: dict[str, UpStack], llm: LLM,
                                             stream: bool) -> None:
    prompt = _split_first_token_prompt(llm)
    want = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
    for up in stacks.values():
        assert _complete(up, prompt, stream) == (want.text, want.finish_reason)


def test_logprobs_carry_each_tokens_own_text_and_bytes(stacks: dict[str, UpStack],
                                                        llm: LLM) -> None:
    prompt = _split_first_token_prompt(llm)
    for up in stacks.values():
        resp = _client(up).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=4,
            temperature=0, logprobs=True, top_logprobs=2)
        content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content is not None and len(content) == 4
        raw = b"".join(bytes(e.bytes or []) for e in content)
        assert raw.decode(errors="replace") == resp.choices[0].message.content
        for e in content:
            assert e.token == bytes(e.bytes or []).decode(errors="replace")
            assert all(not t.token.startswith("token_id:") for t in e.top_logprobs)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_spanning_the_first_token_stops_decode(
        stacks: dict[str, UpStack], llm: LLM, stream: bool) -> None:
    tok = llm.tokenizer
    assert tok is not None
    prompt = "The quick brown fox"
    ids = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0].token_ids
    first, second = tok.decode(ids[:1]), tok.decode(ids[:2])[len(tok.decode(ids[:1])):]
    assert first and second, (first, second)
    stop = first[-1] + second[0]  # begins in the first token, ends in the second
    want = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                 stop=[stop]))[0]
    assert want.finish_reason == "stop" and len(want.token_ids) == 2
    for up in stacks.values():
        assert _complete(up, prompt, stream, stop=[stop]) == (want.text, "stop")


def _pinned(up: UpStack) -> dict[str, int]:
    """Pinned kvd slots and used engine blocks of every process of the stack."""
    out = {}
    for name, address in up.addresses.items():
        with up.channel(address) as channel:
            if name.startswith("kvd"):
                stats = kvd_pb2_grpc.KvdStub(channel).Stats(kvd_pb2.KvdStatsRequest(),
                                                            timeout=5)
                out[name] = stats.slots_pinned
            elif name.startswith(("prefill", "decode")):
                stats = engine_pb2_grpc.EngineStub(channel).Stats(
                    engine_pb2.EngineStatsRequest(), timeout=5)
                out[name] = stats.kv_blocks_used
    return out


def test_a_second_turn_reuses_the_first_answer(stacks: dict[str, UpStack], llm: LLM) -> None:
    up = stacks["disaggregated"]
    tok = llm.tokenizer
    assert tok is not None
    client = _client(up)
    turn1 = [{"role": "user", "content": "Tell me about caches and blocks in a long answer."}]
    first = client.chat.completions.create(model="tiny", messages=turn1,  # type: ignore[arg-type]
                                           max_tokens=40, temperature=0)
    answer = first.choices[0].message.content or ""
    assert first.usage is not None
    turn2 = [*turn1, {"role": "assistant", "content": answer},
             {"role": "user", "content": "And then?"}]
    ids1 = tok.encode(tok.apply_chat_template(turn1), add_special_tokens=False)
    ids2 = tok.encode(tok.apply_chat_template(turn2), add_special_tokens=False)
    answer_ids = llm.generate([ids1], SamplingParams(max_tokens=40, temperature=0))[0].token_ids
    assert first.usage.prompt_tokens == len(ids1)
    assert first.usage.completion_tokens == len(answer_ids)
    # The oracle: turn 1's prompt + answer tokens in full blocks, as far as turn 2's prompt
    # repeats them (the answer's last token has no KV; the block of turn 2's last prompt
    # token is always computed).
    had = [*ids1, *answer_ids][:-1]
    same = next((i for i, (a, b) in enumerate(zip(ids2, had, strict=False)) if a != b),
                min(len(ids2), len(had)))
    oracle = min(same, len(ids2) - 1) // BLOCK * BLOCK
    assert oracle > len(ids1) // BLOCK * BLOCK  # the answer's blocks are part of it
    # No pause: a decode stream ends only once its answer's blocks are in the kvd.
    second = client.chat.completions.create(model="tiny", messages=turn2,  # type: ignore[arg-type]
                                            max_tokens=8, temperature=0)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == oracle
    wait_until(lambda: not any(_pinned(up).values()), timeout=10)
