"""Tool-call parsing (``pdserve.tool_calls``) and the router's tool plan
(``services.router.tools``): each family's format whole and split at every character, what is
not a call stays content, forced calls' schemas, and the request checks that name their field.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.errors import BadRequest
from pdserve.models.loader import builtin_tokenizer
from pdserve.proto.v1 import router_pb2
from pdserve.tokenizer import Tokenizer
from pdserve.tool_calls import (
    CallDelta,
    HermesParser,
    Llama3JsonParser,
    NamedParser,
    Parsed,
    RequiredParser,
    ToolParser,
    ToolSpec,
    detect_parser,
    forced_output,
)
from services.router.model import ModelSpec
from services.router.requests import RouterLimits, prepare

NAMES = {"get_weather", "noop"}
TOOLS = [ToolSpec("get_weather", "", {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]}), ToolSpec("noop")]


def _run(parser: ToolParser, text: str, step: int) -> tuple[str, list[dict[str, str]]]:
    """Feed ``text`` in pieces of ``step`` characters; content and merged calls."""
    out = Parsed()
    for i in range(0, len(text), step):
        out.add(parser.feed(text[i:i + step]))
    out.add(parser.finish())
    calls: list[dict[str, str]] = []
    for d in out.calls:
        if d.index == len(calls):
            assert d.id.startswith("call_") and len(d.id) == 29 and d.name
            calls.append({"name": d.name, "arguments": ""})
        calls[d.index]["arguments"] += d.arguments
    return out.content, calls


HERMES = ('I will check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
          '</tool_call>\n<tool_call>{"name": "noop", "arguments": {}}</tool_call>')


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_hermes_calls_and_content_at_any_split(step: int) -> None:
    content, calls = _run(HermesParser(NAMES), HERMES, step)
    assert content == "I will check.\n"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Zürich"}), ("noop", {})]


def test_hermes_keeps_what_is_not_a_call_as_content() -> None:
    text = "a < b and <tool_call>not json</tool_call> and <tool_call>{\"name\": \"other\"}"
    content, calls = _run(HermesParser(NAMES), text, 3)
    assert calls == []
    assert content == "a < b and <tool_call>not json</tool_call> and <tool_call>{\"name\": " \
                      "\"other\"}</tool_call>"
    # A block the model left open at EOS still parses.
    assert _run(HermesParser(NAMES), '<tool_call>{"name": "noop"}', 4)[1] == [
        {"name": "noop", "arguments": "{}"}]


def test_parallel_off_keeps_the_first_call() -> None:
    assert [c["name"] for c in _run(HermesParser(NAMES, parallel=False), HERMES, 5)[1]] == [
        "get_weather"]


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_llama3_json_calls(step: int) -> None:
    text = ' {"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "noop", ' \
           '"parameters": {}}'
    content, calls = _run(Llama3JsonParser(NAMES), text, step)
    assert content == ""
    assert [c["name"] for c in calls] == ["get_weather", "noop"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo"}
    assert _run(Llama3JsonParser(NAMES), "Oslo is {cold}.", step) == ("Oslo is {cold}.", [])
    assert _run(Llama3JsonParser(NAMES), '{"a": 1}', step) == ('{"a": 1}', [])


def test_named_and_required_parsers_stream_calls() -> None:
    content, calls = _run(NamedParser("get_weather"), '{"city":"Rome"}', 2)
    assert content == "" and calls == [{"name": "get_weather", "arguments": '{"city":"Rome"}'}]
    parser = RequiredParser()
    first = parser.feed('[{"name":"noop","parameters":{}},{"name":"get_wea')
    assert [d.name for d in first.calls] == ["noop"]  # sent once its object is complete
    rest = parser.feed('ther","parameters":{"city":"X"}}]').add(parser.finish())
    assert rest.calls[0] == CallDelta(1, rest.calls[0].id, "get_weather", '{"city": "X"}')
    cut = RequiredParser()
    assert _run(cut, '[{"name":"noop","param', 3) == ('[{"name":"noop","param', [])


def test_forced_schemas_accept_calls_and_refuse_others() -> None:
    named = json.loads(str(forced_output(TOOLS, "get_weather", True).value))
    jsonschema.validate({"city": "Oslo"}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({}, named)
    required = json.loads(str(forced_output(TOOLS, None, False).value))
    jsonschema.validate([{"name": "noop", "parameters": {}}], required)
    for bad in ([], [{"name": "noop", "parameters": {}}] * 2,
                [{"name": "get_weather", "parameters": {}}], [{"name": "x", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)


def test_the_parser_follows_the_chat_template() -> None:
    assert detect_parser("... <tool_call> ...") == "hermes"
    assert detect_parser('<|python_tag|>{"name": ...') == "llama3_json"
    assert detect_parser("plain {{ messages }}") == "hermes"


def chat_model(template: str) -> ModelSpec:
    """The built-in vocabulary with ``template`` as its chat template."""
    tok = Tokenizer(builtin_tokenizer().backend, eos_token_ids=(1,), chat_template=template)
    return ModelSpec("tiny", "fp", 4096, tok)


def _chat(**fields: object) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(**fields)  # type: ignore[arg-type]
    req.chat.messages.add(role="user", content="Weather in Oslo?")
    return req


TOOL = router_pb2.Tool(name="get_weather", parameters=json.dumps(TOOLS[0].parameters))
LIMITS = RouterLimits(max_prompt_tokens=4096, max_tokens=64)


def test_forced_calls_set_the_grammar_and_tools_reach_the_template() -> None:
    model = chat_model("TOOLS={{ tools | tojson }}|{{ messages[-1].content }}")
    auto = prepare(_chat(tools=[TOOL]), model, LIMITS)
    assert auto.tools is not None and auto.tools.mode == "auto"
    assert not auto.sampling.HasField("structured")
    named = prepare(_chat(tools=[TOOL], tool_choice=router_pb2.ToolChoice(
        function="get_weather")), model, LIMITS)
    assert json.loads(named.sampling.structured.json_schema) == TOOLS[0].parameters
    required = prepare(_chat(tools=[TOOL], tool_choice=router_pb2.ToolChoice(
        mode="required")), model, LIMITS)
    assert json.loads(required.sampling.structured.json_schema)["type"] == "array"
    text = model.tokenizer.decode(auto.prompt_ids)  # type: ignore[union-attr]
    assert text.startswith('TOOLS=[{"type": "function", "function": {"name": "get_weather"')


@pytest.mark.parametrize(("fields", "message"), [
    ({"tool_choice": router_pb2.ToolChoice(mode="required")},
     "tool_choice: a required or named call needs tools"),
    ({"tools": [TOOL], "tool_choice": router_pb2.ToolChoice(mode="sometimes")},
     "tool_choice.mode: must be one of auto, none, required, got 'sometimes'"),
    ({"tools": [TOOL], "tool_choice": router_pb2.ToolChoice(function="nope")},
     "tool_choice.function: 'nope' is not one of the tools"),
    ({"tools": [router_pb2.Tool(name="bad name")]}, "tools[0].name: must be 1-64 of"),
    ({"tools": [TOOL, TOOL]}, "tools[1].name: 'get_weather' is defined twice"),
    ({"tools": [router_pb2.Tool(name="f", parameters="[1")]}, "tools[0].parameters: not valid"),
    ({"tools": [router_pb2.Tool(name="f", parameters="[1]")]},
     "tools[0].parameters: must be a JSON Schema object"),
])
def test_bad_tool_requests_name_their_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(BadRequest) as err:
        prepare(_chat(**fields), chat_model("{{ messages[0].content }}"), LIMITS)
    assert err.value.message.startswith(message)


def test_tools_need_a_chat_and_a_forced_call_excludes_a_structure() -> None:
    model = chat_model("{{ messages[0].content }}")
    with pytest.raises(BadRequest, match=r"^tools: only chat requests"):
        prepare(router_pb2.GenerateRequest(prompt="x", tools=[TOOL]), model, LIMITS)
    req = _chat(tools=[TOOL], tool_choice=router_pb2.ToolChoice(mode="required"))
    req.sampling.structured.regex = "a+"
    with pytest.raises(BadRequest, match=r"^tool_choice: a required or named tool call cannot"):
        prepare(req, model, LIMITS)
