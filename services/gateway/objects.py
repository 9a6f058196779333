"""The nested objects of OpenAI's request bodies: tools, tool calls, ``tool_choice``, and
``response_format`` (pydantic models with their translation to the router's messages)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.proto.v1 import router_pb2


class FieldError(ValueError):
    """A model-level check that names its field (pydantic would otherwise report loc=())."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's structured outputs."""

    model_config = ConfigDict(extra="ignore")
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError("response_format.json_schema", "is required with type json_schema")
        return self


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = ""  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """An assistant turn's call (``messages[].tool_calls[]``)."""

    model_config = ConfigDict(extra="ignore")
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall

    def to_proto(self) -> router_pb2.ToolCall:
        return router_pb2.ToolCall(id=self.id, name=self.function.name,
                                   arguments=self.function.arguments)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """``tools[]``: a function the model may call."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def to_proto(self) -> router_pb2.Tool:
        f = self.function
        return router_pb2.Tool(
            name=f.name, description=f.description or "",
            parameters=json.dumps(f.parameters) if f.parameters is not None else "",
            strict=bool(f.strict))


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: NamedFunction
