"""The two front doors at parity (``services/gateway/parity.py``): every OpenAI request field
the gateway accepts has a router counterpart or a stated reason, every router field is reachable
from one of them or has a reason, and for the same request the gateway and ``pdserve.client``
build the same ``GenerateRequest``."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.descriptor import Descriptor
from pydantic import BaseModel

from pdserve.client.request import (
    META_FIELDS,
    REQUEST_FIELDS,
    SAMPLING_FIELDS,
    GenerateParams,
    build_request,
)
from pdserve.proto.v1 import router_pb2
from services.gateway.parity import COUNTERPARTS, NO_COUNTERPART, ROUTER_ONLY
from services.gateway.schema import ChatCompletionRequest, CompletionRequest

DOC = Path(__file__).resolve().parents[2] / "docs" / "grpc.md"


def _models_in(annotation: Any) -> list[tuple[type[BaseModel], bool]]:
    """The pydantic models an annotation holds, each with whether it sits in a list."""
    if typing.get_origin(annotation) is list:
        return [(m, True) for m, _ in _models_in(typing.get_args(annotation)[0])]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, False)]
    return [found for arg in typing.get_args(annotation) for found in _models_in(arg)]


def _fields_of(model: type[BaseModel], prefix: str = "") -> set[str]:
    out = set()
    for name, info in model.model_fields.items():
        name = info.alias or name
        out.add(prefix + name)
        for sub, listed in _models_in(info.annotation):
            out |= _fields_of(sub, prefix + name + ("[]." if listed else "."))
    return out


def gateway_fields() -> set[str]:
    """Every field path of the gateway's request bodies, nested models included
    (``messages[].tool_calls[].function.name``)."""
    return _fields_of(CompletionRequest) | _fields_of(ChatCompletionRequest)


def router_fields(desc: Descriptor = router_pb2.GenerateRequest.DESCRIPTOR,
                  prefix: str = "", leaves: bool = True) -> set[str]:
    """Every leaf field path of GenerateRequest (``chat.messages[].role``, ``sampling.seed``);
    with ``leaves`` False, the paths of message fields too (``tools``, ``sampling.structured``).
    """
    out = set()
    for f in desc.fields:
        path = prefix + f.name + ("[]" if f.is_repeated else "")
        if f.message_type is None or f.message_type.name == "TokenIds":
            out.add(path.removesuffix("[]") if f.message_type is None else prefix + f.name)
        else:
            if not leaves:
                out.add(prefix + f.name)
            out |= router_fields(f.message_type, path + ".", leaves)
    return out


def _counterpart_paths() -> set[str]:
    return {p.strip() for value in COUNTERPARTS.values() for p in value.split("|")}


def test_every_gateway_field_has_a_counterpart_or_a_reason() -> None:
    fields = gateway_fields()
    missing = fields - COUNTERPARTS.keys() - NO_COUNTERPART.keys()
    assert not missing, f"add these gateway fields to services/gateway/parity.py: {missing}"
    assert not (COUNTERPARTS.keys() & NO_COUNTERPART.keys())
    stale = (COUNTERPARTS.keys() | NO_COUNTERPART.keys()) - fields
    assert not stale, f"not gateway fields (any more): {stale}"
    assert all(reason.strip() for reason in [*NO_COUNTERPART.values(), *ROUTER_ONLY.values()])


def test_every_router_field_is_reachable_or_has_a_reason() -> None:
    leaves = router_fields()
    named = _counterpart_paths() | ROUTER_ONLY.keys()
    every = router_fields(leaves=False)
    assert named <= every, f"not router fields: {named - every}"
    assert leaves <= named, f"router fields with neither: {leaves - named}"


def test_the_client_speaks_every_router_sampling_and_meta_field() -> None:
    assert set(GenerateParams.__annotations__) == SAMPLING_FIELDS | META_FIELDS | REQUEST_FIELDS
    assert {p.split(".", 1)[1].split(".")[0].removesuffix("[]") for p in router_fields()
            if p.startswith(("sampling.", "meta."))} == SAMPLING_FIELDS | META_FIELDS
    top = {f.name for f in router_pb2.GenerateRequest.DESCRIPTOR.fields}
    assert top - {"model", "prompt", "prompt_token_ids", "chat", "sampling",
                                    "meta"} == REQUEST_FIELDS


def _client_params(body: dict[str, Any]) -> dict[str, Any]:
    """The client's keyword arguments for the gateway body's mapped fields."""
    params = {}
    for name, value in body.items():
        path = COUNTERPARTS.get(name, "")
        if path.startswith(("sampling.", "meta.")):
            params[path.split(".", 1)[1]] = value
    return params


SAMPLED = {"temperature": 0.5, "top_p": 0.9, "top_k": 3, "min_p": 0.1, "seed": 11,
           "stop": ["a", "b"], "stop_token_ids": [5, 6], "ignore_eos": True, "priority": 2,
           "user": "team-u"}


@pytest.mark.parametrize("body", [
    {"model": "tiny", "prompt": "Hello", "max_tokens": 7, "logprobs": 2, **SAMPLED},
    {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 5, **SAMPLED},
])
def test_completion_bodies_become_the_clients_requests(body: dict[str, Any]) -> None:
    req = CompletionRequest.model_validate(body)
    [gateway] = req.router_requests(req.model, req.inputs(), req.completion_limit,
                                    req.num_logprobs, "rid", req.user or "", "")
    params = {**_client_params(body), "request_id": "rid-0"}
    assert build_request("tiny", prompt=body["prompt"], params=params) == gateway


def test_chat_bodies_become_the_clients_requests() -> None:
    messages = [{"role": "developer", "content": "Be terse."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                             {"type": "text", "text": "there"}]}]
    body = {"model": "tiny", "messages": messages, "max_completion_tokens": 9,
            "logprobs": True, "top_logprobs": 3, **SAMPLED}
    req = ChatCompletionRequest.model_validate(body)
    [gateway] = req.router_requests(req.model, req.inputs(), req.completion_limit,
                                    req.num_logprobs, "rid", req.user or "", "")
    params = {**_client_params(body), "max_tokens": 9, "logprobs": 3, "request_id": "rid-0"}
    assert build_request("tiny", messages=messages, params=params) == gateway


def test_docs_list_every_gateway_field() -> None:
    doc = DOC.read_text()
    missing = [f for f in sorted(gateway_fields()) if f"`{f}`" not in doc]
    assert not missing, f"docs/grpc.md's parity table lacks {missing}"


PROCESSING = {"presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2}


def test_new_sampling_fields_and_echo_become_the_clients_requests() -> None:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 7, "logprobs": 2, "echo": True,
            "logit_bias": {"5": 1.5, "7": -100}, "guided_regex": "[a-z]+", **PROCESSING}
    req = CompletionRequest.model_validate(body)
    [gateway] = req.router_requests(req.model, req.inputs(), req.completion_limit,
                                    req.num_logprobs, "rid", "", "")
    params = {**PROCESSING, "max_tokens": 7, "logprobs": 2, "prompt_logprobs": 2, "echo": True,
              "logit_bias": {5: 1.5, 7: -100.0}, "structured": {"regex": "[a-z]+"},
              "request_id": "rid-0"}
    assert build_request("tiny", prompt="Hello", params=params) == gateway


def test_tools_and_structured_chat_become_the_clients_requests() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "name": "weather", "content": "9C"}]
    documents = [{"title": "a", "text": "b"}]
    body = {"model": "tiny", "messages": messages, "documents": documents,
            "tools": [{"type": "function", "function": {
                "name": "weather", "description": "d", "parameters": schema, "strict": True}}],
            "tool_choice": {"type": "function", "function": {"name": "weather"}},
            "parallel_tool_calls": False,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                       "schema": schema}}}
    req = ChatCompletionRequest.model_validate(body)
    [gateway] = req.router_requests(req.model, req.inputs(), req.completion_limit,
                                    req.num_logprobs, "rid", "", "")
    params = {"tools": [{"name": "weather", "description": "d", "parameters": schema,
                         "strict": True}],
              "tool_choice": {"function": "weather"}, "parallel_tool_calls": False,
              "structured": {"json_schema": json.dumps(schema)}, "request_id": "rid-0"}
    assert build_request("tiny", messages=messages, params=params,
                         documents=documents) == gateway
    modes = ChatCompletionRequest.model_validate({**body, "tool_choice": "required"})
    assert modes.request_fields()["tool_choice"] == router_pb2.ToolChoice(mode="required")
