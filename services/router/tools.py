"""The router's side of tool calling: check a request's tools and tool_choice, force a call
with structured output when the choice requires one, and turn the answer's text into
``GenerateResponse.tool_calls`` as it streams (``pdserve.tool_calls`` does the parsing).

    plan(request, parser_kind) -> ToolPlan | None    tools, choice, parallel, parser kind
    ToolPlan.force(sampling)                          required / named: sampling.structured
    with_tool_calls(messages, plan)                   text -> content + call deltas
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.convert import structured_to_proto
from pdserve.errors import BadRequest
from pdserve.proto.v1 import common_pb2, router_pb2
from pdserve.tool_calls import ToolSpec, forced_output, make_parser, parse_tools

MODES = ("auto", "none", "required")


@dataclass(frozen=True)
class ToolPlan:
    tools: list[ToolSpec]
    mode: str  # auto | none | required (a named function: "function")
    function: str | None
    parallel: bool
    parser: str  # the model family's format (pdserve.tool_calls.PARSERS)

    def as_template(self) -> list[dict[str, object]]:
        return [t.as_template() for t in self.tools]

    def force(self, sampling: common_pb2.SamplingParams) -> None:
        """tool_choice required or named: the output follows the call's JSON Schema."""
        if self.function is None and self.mode != "required":
            return
        if sampling.HasField("structured"):
            raise BadRequest("tool_choice: a required or named tool call cannot be combined "
                             "with sampling.structured (response_format)")
        sampling.structured.CopyFrom(structured_to_proto(
            forced_output(self.tools, self.function, self.parallel)))


def plan(request: router_pb2.GenerateRequest, parser_kind: str) -> ToolPlan | None:
    """The request's tool plan (None without tools); BadRequest naming the field."""
    which = request.tool_choice.WhichOneof("choice") if request.HasField("tool_choice") else None
    if not request.tools:
        if which == "function" or (which == "mode" and request.tool_choice.mode == "required"):
            raise BadRequest("tool_choice: a required or named call needs tools")
        return None
    if request.WhichOneof("input") != "chat":
        raise BadRequest("tools: only chat requests (input chat) can call tools")
    tools = parse_tools([(t.name, t.description, t.parameters, t.strict)
                         for t in request.tools])
    mode, function = "auto", None
    if which == "mode":
        mode = request.tool_choice.mode or "auto"
        if mode not in MODES:
            raise BadRequest(f"tool_choice.mode: must be one of {', '.join(MODES)}, "
                             f"got {mode!r}")
    elif which == "function":
        function = request.tool_choice.function
        if function not in {t.name for t in tools}:
            raise BadRequest(f"tool_choice.function: {function!r} is not one of the tools")
        mode = "function"
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    return ToolPlan(tools, mode, function, parallel, parser_kind)


async def with_tool_calls(messages: AsyncIterator[router_pb2.GenerateResponse],
                          tool_plan: ToolPlan,
                          ) -> AsyncIterator[router_pb2.GenerateResponse]:
    """Each message's text split into content (``text``) and call deltas (``tool_calls``);
    held-back text (a tag not yet closed) goes out with a later message, the rest with the
    last."""
    parser = make_parser(tool_plan.parser, tool_plan.tools, tool_plan.mode, tool_plan.function,
                         tool_plan.parallel)
    if parser is None:
        async for message in messages:
            yield message
        return
    async for message in messages:
        parsed = parser.feed(message.text)
        if message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            parsed.add(parser.finish())
        message.text = parsed.content
        message.tool_calls.extend(
            router_pb2.ToolCallDelta(index=c.index, id=c.id, name=c.name, arguments=c.arguments)
            for c in parsed.calls)
        yield message
