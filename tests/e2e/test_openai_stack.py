"""Issue 6 end to end: the official ``openai`` client against ``pdserve up`` (real processes:
Redis, two kvds, a prefill and a decode engine, the router, the gateway), once with the
gateway calling the router over gRPC and once with the router embedded in it
(``pdserve up --embedded-router``, marked slow).

The faults (Redis stopped, the only decode instance killed) come last: they change the stack.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pdserve import LLM, SamplingParams
from tests.e2e.stack import ROOT, UpStack, wait_until

KEY = "sk-e2e-test"
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. " * 6]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say something about blocks and caches."}]
MAX_TOKENS = 12


# The embedded stack doubles this module's minutes: it runs with `make chaos`.
@pytest.fixture(scope="module", params=["grpc", pytest.param("embedded", marks=pytest.mark.slow)])
def stack(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpStack]:
    keys: Path = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"{KEY},team-a\n")
    # --max-wait 3: with the only decode dead (and not restarted), a request is held that long
    # for it to come back before its 503 (the default, 30 s, is for a supervisor's restart).
    up = UpStack(["--model", "tiny", "--prefill", "1", "--decode", "1", "--keys-file", str(keys),
                  "--no-restart", "--router-arg=--max-wait=3",
                  *(["--embedded-router"] if request.param == "embedded" else [])]).start()
    yield up
    up.stop()


@pytest.fixture(scope="module")
def client(stack: UpStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny")


def _greedy(llm: LLM, prompt: str | list[int]) -> tuple[str, int, int]:
    out = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
    return out.text, len(out.prompt_token_ids), len(out.token_ids)


def _chat_ids(llm: LLM) -> list[int]:
    text = llm.tokenizer.apply_chat_template(CHAT)
    return llm.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "multi-block"])
def test_completion_matches_offline_greedy(client: openai.OpenAI, llm: LLM, prompt: str) -> None:
    text, num_prompt, num_out = _greedy(llm, prompt)
    resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                     temperature=0)
    assert resp.choices[0].text == text
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (num_prompt, num_out)
    assert resp.usage.total_tokens == num_prompt + num_out


def test_streamed_completion_matches_and_reports_usage(client: openai.OpenAI, llm: LLM) -> None:
    text, num_prompt, num_out = _greedy(llm, PROMPTS[1])
    stream = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        pieces.extend(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    assert "".join(pieces) == text
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (
        num_prompt, num_out)


def test_chat_matches_offline_greedy_streamed_and_not(client: openai.OpenAI, llm: LLM) -> None:
    ids = _chat_ids(llm)
    text, num_prompt, num_out = _greedy(llm, ids)
    resp = client.chat.completions.create(model="tiny", messages=CHAT,  # type: ignore[arg-type]
                                          max_tokens=MAX_TOKENS, temperature=0)
    assert resp.choices[0].message.content == text
    assert resp.usage is not None and resp.usage.prompt_tokens == num_prompt
    assert resp.usage.completion_tokens == num_out
    stream = client.chat.completions.create(model="tiny", messages=CHAT,  # type: ignore[arg-type]
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text


def test_bad_parameter_is_400_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=-1)
    assert err.value.status_code == 400
    assert "temperature" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    assert "messages" in str(err.value)


def test_wrong_key_is_401(stack: UpStack) -> None:
    bad = openai.OpenAI(base_url=stack.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.completions.create(model="tiny", prompt="hi", max_tokens=4)
    assert err.value.status_code == 401


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    assert "no-such-model" in str(err.value)


def test_requests_survive_redis_going_away(stack: UpStack, client: openai.OpenAI,
                                           llm: LLM) -> None:
    os.kill(stack.children()["redis"], signal.SIGKILL)
    text, _, _ = _greedy(llm, PROMPTS[1])
    for _ in range(3):
        resp = client.completions.create(model="tiny", prompt=PROMPTS[1],
                                         max_tokens=MAX_TOKENS, temperature=0)
        assert resp.choices[0].text == text


def test_dead_decode_fails_fast_then_recovers_without_router_restart(
        stack: UpStack, client: openai.OpenAI) -> None:
    pid, router_pid = stack.children()["decode-0"], stack.children()["router"]
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    assert argv[argv.index("--port") + 1] == "0"  # it bound its own port, which it printed
    argv[argv.index("--port") + 1] = stack.addresses["decode-0"].rsplit(":", 1)[1]
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=0)
    assert err.value.status_code == 503
    assert "none came back within" in str(err.value)  # held --max-wait for it, then refused
    assert time.monotonic() - start < 10
    # Restart the same instance on the same address (the port it bound, now given); the
    # router must find it by itself.
    # Its environment as pdserve up gave it: the stack's credentials and Redis.
    restarted = subprocess.Popen(argv, cwd=ROOT, env=stack.role_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    try:
        assert restarted.stdout is not None and restarted.stderr is not None
        line = restarted.stdout.readline()
        assert "listening on" in line, restarted.stderr.read()[-3000:]
        resp = wait_until(lambda: client.completions.create(
            model="tiny", prompt="hi", max_tokens=4, temperature=0), timeout=30, interval=0.5)
        assert resp.choices[0].text is not None and resp.usage.completion_tokens >= 1
        assert stack.children()["router"] == router_pid
    finally:
        restarted.send_signal(signal.SIGTERM)
        restarted.wait(timeout=15)
