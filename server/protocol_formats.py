"""The request fields that shape a chat's output: `response_format`, vLLM's structured
outputs (`structured_outputs`, and the `guided_*` names before vLLM 0.12), `tools` and
`tool_choice`. Each constraint becomes an engine `Grammar` (engine/structured.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from engine.sampling_params import InvalidParameter
from engine.structured import Grammar, check_compiles, choice_grammar, json_schema_grammar, lark_grammar, regex_grammar
from server.protocol_fields import Strict, documented
from server.tool_calls import NAME_PATTERN


class FunctionDefinition(Strict):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema for the arguments
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(Strict):
    mode: Literal["auto", "required"]
    tools: documented(list[NamedToolChoice], minItems=1)


class AllowedToolsChoice(Strict):
    """OpenAI's `tool_choice` that lets the model call only some of `tools`, in `mode`."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


def functions(tools: list[Tool]) -> list[dict]:
    return [tool.function.model_dump(exclude_none=True) for tool in tools]


def check_parameters(tools: list[Tool]) -> None:
    """Each function's `parameters` is a JSON schema of an object (OpenAI's rule: arguments
    are a JSON object) that can be enforced: a forced call is decoded under it."""
    for i, tool in enumerate(tools):
        parameters, param = tool.function.parameters, f"tools[{i}].function.parameters"
        if parameters is None:
            continue
        kind = parameters.get("type", "object")
        if kind != "object":
            raise InvalidParameter(param, f"Invalid schema for function '{tool.function.name}': schema must be a "
                                   f"JSON Schema of 'type: \"object\"', got 'type: {json.dumps(kind)}'.")
        check_compiles(json_schema_grammar(parameters, param), f"Invalid schema for function '{tool.function.name}'")


class JsonSchemaFormat(Strict):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]  # OpenAI's rule, as for function names
    description: str | None = None
    # "schema" itself would shadow pydantic's BaseModel.schema
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """OpenAI's `response_format`: free text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def schema(self) -> dict | None:
        """The JSON schema a text answer must follow (None: any text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "object"}
        if self.json_schema is None:
            raise InvalidParameter("response_format", "response_format of type json_schema needs 'json_schema'")
        return self.json_schema.schema_

    def grammar(self) -> Grammar | None:
        schema = self.schema()
        return None if schema is None else json_schema_grammar(schema, kind=self.type)


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: exactly one of a JSON schema, a regex, a list of
    choices or a grammar (Lark, or llama.cpp's GBNF)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: documented(list[str], minItems=1) | None = None
    grammar: str | None = None

    def build(self, param: str = "structured_outputs") -> Grammar:
        given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if len(given) != 1:
            raise InvalidParameter(param, f"{param} takes exactly one of json, regex, choice and grammar")
        return build_grammar(given[0].rstrip("_"), getattr(self, given[0]), f"{param}.{given[0].rstrip('_')}")


def build_grammar(kind: str, spec, param: str) -> Grammar:
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except (ValueError, RecursionError) as exc:  # (nested past Python's recursion limit)
                raise InvalidParameter(param, f"{param} is not valid JSON: {exc}") from None
        if not isinstance(spec, dict):
            raise InvalidParameter(param, f"{param} must be a JSON schema (an object)")
        return json_schema_grammar(spec, param)
    if kind == "regex":
        return regex_grammar(spec, param)
    if kind == "choice":
        return choice_grammar(spec, param)
    return lark_grammar(spec, param)
