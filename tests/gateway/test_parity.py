"""The two front doors at parity (``services/gateway/parity.py``): every OpenAI request field
the gateway accepts has a router counterpart or a stated reason, every router field is reachable
from one of them or has a reason, and for the same request the gateway and ``pdserve.client``
build the same ``GenerateRequest``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from google.protobuf.descriptor import Descriptor

from pdserve.client.request import META_FIELDS, SAMPLING_FIELDS, GenerateParams, build_request
from pdserve.proto.v1 import router_pb2
from services.gateway.parity import COUNTERPARTS, NO_COUNTERPART, ROUTER_ONLY
from services.gateway.schema import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
    TextPart,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "grpc.md"


def gateway_fields() -> set[str]:
    names = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    names |= {f"messages[].{n}" for n in ChatMessage.model_fields}
    names |= {f"messages[].content[].{n}" for n in TextPart.model_fields}
    return names | {f"stream_options.{n}" for n in StreamOptions.model_fields}


def router_fields(desc: Descriptor = router_pb2.GenerateRequest.DESCRIPTOR,
                  prefix: str = "") -> set[str]:
    """Every leaf field path of GenerateRequest (``chat.messages[].role``, ``sampling.seed``)."""
    out = set()
    for f in desc.fields:
        path = prefix + f.name + ("[]" if f.is_repeated else "")
        if f.message_type is None or f.message_type.name == "TokenIds":
            out.add(path.removesuffix("[]") if f.message_type is None else prefix + f.name)
        else:
            out |= router_fields(f.message_type, path + ".")
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
    paths = {p for p in named if not p.endswith("chat.messages")}  # the list itself
    assert paths <= leaves, f"not router fields: {paths - leaves}"
    assert leaves <= named, f"router fields with neither: {leaves - named}"


def test_the_client_speaks_every_router_sampling_and_meta_field() -> None:
    assert set(GenerateParams.__annotations__) == SAMPLING_FIELDS | META_FIELDS
    assert {p.split(".", 1)[1] for p in router_fields()
            if p.startswith(("sampling.", "meta."))} == SAMPLING_FIELDS | META_FIELDS


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
