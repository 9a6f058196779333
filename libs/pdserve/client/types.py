"""What the client returns: streamed chunks, a whole completion, models (frozen dataclasses
built from the router's messages; ``cluster_state()`` returns the proto as is)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.proto.v1 import common_pb2, router_pb2

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",  # EOS, a stop token or a stop string
    common_pb2.FINISH_REASON_LENGTH: "length",  # max_tokens or the context length
    common_pb2.FINISH_REASON_ABORT: "abort",  # aborted on the server
}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from cached KV blocks


@dataclass(frozen=True)
class Placement:
    """Where the router ran the request (sent before the first token)."""

    prefill_instance: str  # empty on a colocated engine
    decode_instance: str
    cached_blocks: int
    prompt_tokens: int


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    token: str = ""  # the token's own text (U+FFFD for an incomplete UTF-8 fragment)
    token_bytes: bytes = b""


@dataclass(frozen=True)
class PositionLogprobs:
    """The sampled token's logprob and the top alternatives at one generated position."""

    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a tool call: the first piece of a call has its id and name; arguments come
    in pieces to concatenate per index."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class Chunk:
    """New tokens and text; the last chunk carries ``finish_reason`` and ``usage``."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[PositionLogprobs, ...] = ()
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    usage: Usage | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True)
class Model:
    id: str
    max_context: int
    block_size: int
    root: str = ""  # what the model was loaded from (several ids may share it)


@dataclass
class Completion:
    """A whole generation (``stream.collect()``)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    placement: Placement | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    prompt_text: str = ""  # with echo
    # With prompt_logprobs: one per prompt token; the first (nothing scores it) has logprob 0.
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)

    def add(self, msg: router_pb2.GenerateResponse) -> Chunk | None:
        """Account for one router message; the chunk it is, or None for the placement-only
        first message."""
        if msg.HasField("placement"):
            p = msg.placement
            self.placement = Placement(p.prefill_instance, p.decode_instance, p.cached_blocks,
                                       p.prompt_tokens)
        finish = FINISH_REASONS.get(msg.finish_reason)
        usage = None
        if msg.HasField("usage"):
            u = msg.usage
            usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
        self.prompt_text += msg.prompt_text
        self.prompt_logprobs += [_logprobs(lp) for lp in msg.prompt_logprobs]
        calls = tuple(ToolCallDelta(d.index, d.id, d.name, d.arguments) for d in msg.tool_calls)
        for d in calls:
            if d.index >= len(self.tool_calls):
                self.tool_calls.append(ToolCall(d.id, d.name, ""))
            self.tool_calls[d.index].arguments += d.arguments
        if not (msg.token_ids or msg.text or calls) and finish is None and usage is None:
            return None
        logprobs = tuple(_logprobs(lp) for lp in msg.logprobs)
        self.text += msg.text
        self.token_ids += msg.token_ids
        self.logprobs += logprobs
        self.finish_reason = finish or self.finish_reason
        self.usage = usage or self.usage
        return Chunk(tuple(msg.token_ids), msg.text, logprobs, finish, usage, calls)


def _logprobs(lp: common_pb2.PositionLogprobs) -> PositionLogprobs:
    return PositionLogprobs(_token(lp.sampled), tuple(_token(t) for t in lp.top))


def _token(t: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(t.token_id, t.logprob, t.token, t.token_bytes)


def models_from(reply: router_pb2.ListModelsResponse) -> list[Model]:
    return [Model(m.id, m.max_context, m.block_size, m.root) for m in reply.models]
