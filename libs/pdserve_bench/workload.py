"""Seeded serving workloads: who arrives when, with what prompt, asking for how many tokens.

A plan is a list of conversations. Conversations arrive as a Poisson process; a conversation
of ``chat``, ``rag`` or ``mixed`` has one turn, a ``multiturn`` one has several, and its next
turn is sent only after the previous answer finished (the client then appends that answer and
a new user message, so every turn's prompt starts with the whole previous prompt). For
multiturn the conversation rate is ``rate / mean turns``, so the offered request rate stays
``rate`` while the server keeps up. ``shifting`` changes its mix half-way (by request count, or
by time with a duration): prompt-heavy ``rag`` turns first, then answer-heavy ``chat`` turns —
the load a P:D controller should follow (issue 15).

Prompt text is drawn from a fixed word list with ``random.Random(seed)``: no dataset, same seed
-> same plan. Token counts are approximate (``tokens_per_word``) unless a tokenizer is given,
in which case each prompt is grown/trimmed a word at a time to the target (exact unless
no word fills the last gap).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

WORKLOADS = ("chat", "rag", "mixed", "multiturn", "shifting")

# Common short English words: each is a single token for most BPE vocabularies.
_WORD_TEXT = """
the of and to in is it you that he was for on are with as his they be at one have this from
or had by hot word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her
long make thing see him two has look more day could go come did number sound no most people my
over know water than call first who may down side been now find any new work part take get
place made live where after back little only round man year came show every good me give our
under name very through just form sentence great think say help low line differ turn cause much
mean before move right boy old too same tell does set three want air well also play small end
put home read hand port large spell add even land here must big high such follow act why ask
men change went light kind off need house picture try us again animal point mother world near
build self earth father head stand own page should country found answer school grow study still
learn plant cover food sun four between state keep eye never last let thought city tree cross
farm hard start might story saw far sea draw left late run while press close night real life few
north open seem together next white children begin got walk example ease paper group always
music those both mark often letter until mile river car feet care second book carry took
science eat room friend began idea fish mountain stop once base hear horse cut sure watch color
face wood main enough plain girl usual young ready above ever red list though feel talk bird
soon body dog family direct pose leave song measure door product black short numeral class wind
question happen complete ship area half rock order fire south problem piece told knew pass since
top whole king space heard best hour better true during hundred five remember step early hold
west ground interest reach fast verb sing listen six table travel less morning ten simple several
"""
WORDS = tuple(_WORD_TEXT.split())


def seeded_rng(seed: int, stream: str) -> random.Random:
    """An independent deterministic stream per purpose (``"rate0"``, ``"warmup"``...): a string
    seed goes through SHA-512 in ``random``, so nearby seeds give unrelated streams and prompts
    of different rates never share a prefix (which would turn into cache hits)."""
    return random.Random(f"pdserve-bench:{seed}:{stream}")


@dataclass(frozen=True)
class LengthRange:
    """Token count drawn uniformly from ``[lo, hi]``."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if self.lo < 1 or self.hi < self.lo:
            raise ValueError(f"length range must satisfy 1 <= lo <= hi, got [{self.lo}, {self.hi}]")

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    @property
    def mean(self) -> float:
        return (self.lo + self.hi) / 2


@dataclass(frozen=True)
class WorkloadSpec:
    """Length distributions of the named workloads (defaults sized for a ~50M model on CPU)."""

    name: str = "mixed"
    chat_input: LengthRange = LengthRange(32, 128)  # short in
    chat_output: LengthRange = LengthRange(64, 128)  # medium out
    rag_input: LengthRange = LengthRange(512, 1024)  # long in
    rag_output: LengthRange = LengthRange(8, 32)  # short out
    rag_fraction: float = 0.5  # share of rag requests in `mixed`
    turns: LengthRange = LengthRange(3, 6)  # turns per multiturn conversation
    first_turn_input: LengthRange = LengthRange(64, 256)
    turn_input: LengthRange = LengthRange(16, 64)  # each later user message
    turn_output: LengthRange = LengthRange(32, 64)

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.name!r}")
        if not 0.0 <= self.rag_fraction <= 1.0:
            raise ValueError(f"rag_fraction must be in [0, 1], got {self.rag_fraction}")

    @classmethod
    def from_mapping(cls, name: str, overrides: Mapping[str, Any]) -> WorkloadSpec:
        """From a TOML table: ``chat_input = [32, 128]``, ``rag_fraction = 0.3``..."""
        known = {f.name for f in fields(cls)} - {"name"}
        kwargs: dict[str, Any] = {}
        for key, value in overrides.items():
            if key not in known:
                raise ValueError(f"unknown workload field {key!r} (accepted: {sorted(known)})")
            if key == "rag_fraction":
                kwargs[key] = float(value)
            elif isinstance(value, list | tuple) and len(value) == 2:
                kwargs[key] = LengthRange(int(value[0]), int(value[1]))
            else:
                raise ValueError(f"workload field {key!r} must be [lo, hi], got {value!r}")
        return replace(cls(name=name), **kwargs)

    @property
    def mean_turns(self) -> float:
        return self.turns.mean if self.name == "multiturn" else 1.0


@dataclass(frozen=True)
class Turn:
    """One request: the new user text and how many tokens to ask for."""

    kind: str  # "chat" | "rag" | "turn"
    text: str
    input_tokens: int  # target token count of `text` (exact with a tokenizer)
    max_tokens: int


@dataclass(frozen=True)
class Conversation:
    index: int
    arrival_s: float  # offset from the start of the run
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Plan:
    workload: str
    rate: float
    seed: int
    conversations: tuple[Conversation, ...]

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)


CountTokens = Callable[[str], int]


class PromptMaker:
    """Random word prompts of a target token count."""

    def __init__(self, count_tokens: CountTokens | None = None, tokens_per_word: float = 1.0):
        if tokens_per_word <= 0:
            raise ValueError(f"tokens_per_word must be > 0, got {tokens_per_word}")
        self.count_tokens = count_tokens
        self.tokens_per_word = tokens_per_word

    def make(self, rng: random.Random, num_tokens: int) -> str:
        num_words = max(1, round(num_tokens / self.tokens_per_word))
        words = [rng.choice(WORDS) for _ in range(num_words)]
        if self.count_tokens is None:
            return " ".join(words)
        # Words are ~1 token, so the first guess is close and these loops run a few steps.
        count = self.count_tokens
        while count(" ".join(words)) < num_tokens:
            words.append(rng.choice(WORDS))
        while len(words) > 1 and count(" ".join(words)) > num_tokens:
            words.pop()
        if count(" ".join(words)) < num_tokens:  # close the gap with a word of the right size
            for word in rng.sample(WORDS, 32):
                if count(" ".join([*words, word])) == num_tokens:
                    words.append(word)
                    break
        return " ".join(words)


def _turns(spec: WorkloadSpec, rng: random.Random, maker: PromptMaker,
           late: bool = False) -> list[Turn]:
    def turn(kind: str, inp: LengthRange, out: LengthRange) -> Turn:
        n = inp.draw(rng)
        return Turn(kind, maker.make(rng, n), n, out.draw(rng))

    if spec.name == "chat" or (spec.name == "mixed" and rng.random() >= spec.rag_fraction) or (
            spec.name == "shifting" and late):
        return [turn("chat", spec.chat_input, spec.chat_output)]
    if spec.name in ("rag", "mixed", "shifting"):
        return [turn("rag", spec.rag_input, spec.rag_output)]
    num_turns = spec.turns.draw(rng)
    first = turn("turn", spec.first_turn_input, spec.turn_output)
    return [first] + [turn("turn", spec.turn_input, spec.turn_output)
                      for _ in range(num_turns - 1)]


def make_plan(
    spec: WorkloadSpec,
    rate: float,
    seed: int,
    *,
    num_requests: int | None = None,
    duration_s: float | None = None,
    stream: str = "run",
    maker: PromptMaker | None = None,
) -> Plan:
    """Conversations until ``num_requests`` turns exist (the last conversation is cut short) or
    the next arrival falls after ``duration_s``. ``rate`` is requests/s; ``inf`` sends all at 0."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if (num_requests is None) == (duration_s is None):
        raise ValueError("give exactly one of num_requests and duration_s")
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if duration_s is not None and duration_s <= 0:
        raise ValueError(f"duration must be > 0 s, got {duration_s}")
    rng = seeded_rng(seed, stream)
    maker = maker or PromptMaker()
    conv_rate = rate / spec.mean_turns
    conversations: list[Conversation] = []
    t, total = 0.0, 0
    while True:
        if conversations and not math.isinf(conv_rate):
            t += rng.expovariate(conv_rate)
        if duration_s is not None and t > duration_s:
            break
        late = (total >= num_requests / 2 if num_requests is not None
                else duration_s is not None and t >= duration_s / 2)
        turns = _turns(spec, rng, maker, late)
        if num_requests is not None:
            turns = turns[: num_requests - total]
        conversations.append(Conversation(len(conversations), t, tuple(turns)))
        total += len(turns)
        if num_requests is not None and total >= num_requests:
            break
    return Plan(spec.name, rate, seed, tuple(conversations))


def chat_messages(history: list[dict[str, str]], turn: Turn) -> list[dict[str, str]]:
    """The messages of a turn: everything said so far, then the new user text."""
    return [*history, {"role": "user", "content": turn.text}]


def completion_prompt(messages: list[dict[str, str]]) -> str:
    """The same conversation as one completion prompt (``/v1/completions``): plain text joined
    so that turn k's prompt is a string prefix of turn k+1's."""
    return "\n\n".join(m["content"] for m in messages)
