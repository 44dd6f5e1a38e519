"""OpenAI request bodies, validated strictly at the HTTP edge, and their conversion to
engine `SamplingParams`. Pydantic lives here and in server/response_schemas.py only.

Strict: wrong types are rejected, not coerced ("5" is not a number), and unknown fields
are rejected with OpenAI's "Unrecognized request argument supplied" so that a typo like
`max_token` does not pass silently. Fields the OpenAI API defines but that do not change
generation here (user, metadata, store, service_tier) are accepted and ignored.
vLLM's extra sampling fields (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, ...) are accepted under vLLM's names, and so are its structured outputs
(`structured_outputs`, and the `guided_*` fields vLLM had before 0.12).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, TypeAdapter

from engine.sampling_params import MAX_LOGPROBS, InvalidParameter, SamplingParams
from engine.structured import Grammar, choice_grammar, json_schema_grammar, lark_grammar, regex_grammar
from server.tool_calls import NAME_PATTERN, ToolUse
from trainer.feedback import FeedbackLabel


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _integral(value):
    """22.0 is the integer 22 in JSON (and in JSON Schema's `integer`); 22.5 stays a float, and is refused."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# an integer field: strict (no "5", no true), but a JSON number with no fraction is accepted;
# with bounds, INTEGRAL goes after the Field so that the schema keeps minimum/maximum
INTEGRAL = BeforeValidator(_integral)
Int = Annotated[int, INTEGRAL]
# a token id: the served vocabulary's size bounds it in the OpenAPI document (server/openapi.py)
# and in the engine's checks
TokenId = Annotated[int, Field(ge=0, json_schema_extra={"x-token-id": True}), INTEGRAL]


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object, as text


class MessageToolCall(_Strict):
    """A tool call of an earlier assistant turn, as the API returned it."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    # streamed tool calls carry their position; clients (litellm) pass it back with the message
    index: Int | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    refusal: str | None = None
    # what the SDK sends back when a returned message is appended as is; not used here
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    def template_dict(self) -> dict:
        """This turn as a chat template reads it (OpenAI's developer role is a system turn)."""
        entry: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            entry["name"] = self.name
        if self.tool_calls:
            entry["tool_calls"] = [call.model_dump(exclude={"index"}) for call in self.tool_calls]
        if self.tool_call_id is not None:
            entry["tool_call_id"] = self.tool_call_id
        return entry

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema for the arguments
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


def _functions(tools: list[Tool]) -> list[dict]:
    return [tool.function.model_dump(exclude_none=True) for tool in tools]


class JsonSchemaFormat(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    # "schema" itself would shadow pydantic's BaseModel.schema
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: free text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def grammar(self) -> Grammar | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return json_schema_grammar({"type": "object"}, kind="json_object")
        if self.json_schema is None:
            raise InvalidParameter("response_format", "response_format of type json_schema needs 'json_schema'")
        return json_schema_grammar(self.json_schema.schema_)


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one of a JSON schema, a regex, a list of
    choices or a grammar (Lark, or llama.cpp's GBNF)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def build(self, param: str = "structured_outputs") -> Grammar:
        given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if len(given) != 1:
            raise InvalidParameter(param, f"{param} takes exactly one of json, regex, choice and grammar")
        return _build_grammar(given[0].rstrip("_"), getattr(self, given[0]), f"{param}.{given[0].rstrip('_')}")


def _build_grammar(kind: str, spec, param: str) -> Grammar:
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as exc:
                raise InvalidParameter(param, f"{param} is not valid JSON: {exc}") from None
        if not isinstance(spec, dict):
            raise InvalidParameter(param, f"{param} must be a JSON schema (an object)")
        return json_schema_grammar(spec, param)
    if kind == "regex":
        return regex_grammar(spec, param)
    if kind == "choice":
        return choice_grammar(spec, param)
    return lark_grammar(spec, param)


class _SamplingFields(_Strict):
    """Fields shared by chat and text completions."""

    model: str
    n: Annotated[int, Field(ge=1, le=128), INTEGRAL] = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM's extra sampling parameters
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's structured outputs, and their names before vLLM 0.12
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # alchemist: false keeps this request out of online training
    train: bool = True

    def _grammar(self, response_format: ResponseFormat | None = None) -> Grammar | None:
        """The one constraint on the output this request asks for, if any."""
        asked = []
        if response_format is not None and response_format.type != "text":
            asked.append(("response_format", response_format.grammar))
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", self.structured_outputs.build))
        for kind in ("json", "regex", "choice", "grammar"):
            spec = getattr(self, f"guided_{kind}")
            if spec is not None:
                asked.append((f"guided_{kind}", lambda kind=kind, spec=spec: _build_grammar(kind, spec,
                                                                                             f"guided_{kind}")))
        if len(asked) > 1:
            raise InvalidParameter(asked[1][0], f"{asked[0][0]} and {asked[1][0]} both constrain the output; "
                                   "send one")
        return asked[0][1]() if asked else None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        optional = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise InvalidParameter("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
            bias[int(key)] = value
        return SamplingParams(
            n=self.n, logit_bias=bias, seed=self.seed, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            **{k: v for k, v in optional.items() if v is not None},
        )


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_use(self) -> ToolUse | None:
        """What this request allows of tools; None when it offers none (or `tool_choice` is "none")."""
        for message in self.messages:
            if message.role == "tool" and message.tool_call_id is None:
                raise InvalidParameter("messages", "a message with role 'tool' needs 'tool_call_id'")
        if not self.tools:
            for name in ("tool_choice", "parallel_tool_calls"):
                if getattr(self, name) not in (None, "none"):
                    raise InvalidParameter(name, f"{name} is only allowed when 'tools' are specified")
            return None
        names = [tool.function.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise InvalidParameter("tools", "tools must have distinct function names")
        choice = self.tool_choice or "auto"
        if choice == "none":
            return None
        named = None
        if isinstance(choice, NamedToolChoice):
            named = choice.function.name
            if named not in names:
                raise InvalidParameter("tool_choice", f"tool_choice names `{named}`, which is not in tools")
            choice = "named"
        return ToolUse(_functions(self.tools), choice, named, self.parallel_tool_calls is not False)

    def sampling_params(self, tool_call_token: int | None = None) -> SamplingParams:
        """`tool_call_token`: the id of `<tool_call>` where the tokenizer has it as one token."""
        # both limits are checked, each under its own name, before the one that applies is taken
        for name in ("max_completion_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise InvalidParameter(name, f"{name} must be at least 0, got {value}")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        top = None
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidParameter("top_logprobs", f"top_logprobs must be between 0 and {MAX_LOGPROBS}, "
                                   f"got {self.top_logprobs}")
        if self.logprobs:
            top = self.top_logprobs or 0
        elif self.top_logprobs is not None:
            raise InvalidParameter("top_logprobs", "top_logprobs requires logprobs to be true")
        params = self._sampling_params(max_tokens, top)
        params.grammar = self._grammar(self.response_format)
        tool_use = self.tool_use()
        if tool_use is not None and tool_use.forced:
            if params.grammar is not None:
                raise InvalidParameter(params.grammar.param, f"{params.grammar.param} cannot be combined with a "
                                       "tool_choice that forces a tool call")
            params.grammar = tool_use.grammar(tool_call_token)
        if tool_use is not None and tool_call_token is not None:
            params.skip_special_tokens = False  # the parser reads the <tool_call> tags
        return params


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int | None = 16
    echo: bool = False
    logprobs: Int | None = None
    best_of: Int | None = None
    suffix: str | None = None

    def sampling_params(self) -> SamplingParams:
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        params = self._sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)
        params.grammar = self._grammar()
        return params


class FeedbackRequest(_Strict):
    """POST /v1/feedback: a label for a served completion — a preference (DPO: response
    texts, or two of its choices by index) or one reward per choice (GRPO)."""

    id: Annotated[str, Field(min_length=1)]
    chosen: Annotated[str, Field(min_length=1)] | None = None
    rejected: Annotated[str, Field(min_length=1)] | None = None
    choice_index: Annotated[int, Field(ge=0), INTEGRAL] = 0
    chosen_index: Annotated[int, Field(ge=0), INTEGRAL] | None = None
    rejected_index: Annotated[int, Field(ge=0), INTEGRAL] | None = None
    rewards: Annotated[list[float], Field(min_length=1)] | None = None

    def label(self) -> FeedbackLabel:
        return FeedbackLabel(self.id, self.chosen, self.rejected, self.choice_index, self.chosen_index,
                             self.rejected_index, self.rewards)


class RollbackRequest(_Strict):
    """POST /v1/adapters/rollback: make a saved adapter version the live one."""

    version: Annotated[int, Field(ge=0), INTEGRAL]


class _TokenizeFields(_Strict):
    model: str | None = None
    return_token_strs: bool = False


class TokenizePromptRequest(_TokenizeFields):
    """POST /tokenize (vLLM's) with a prompt, tokenized as /v1/completions tokenizes it."""

    prompt: str
    # add the tokenizer's special tokens (BOS)
    add_special_tokens: bool = True


class TokenizeChatRequest(_TokenizeFields):
    """POST /tokenize (vLLM's) with chat messages (and tools), rendered as
    /v1/chat/completions renders them."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[Tool] | None = None
    # end with the assistant's turn opening
    add_generation_prompt: bool = True

    def tool_use(self) -> ToolUse | None:
        return ToolUse(_functions(self.tools)) if self.tools else None


def _tokenize_kind(value) -> str:
    return "chat" if isinstance(value, dict) and "messages" in value else "prompt"


# a body with `messages` is a chat request, any other a prompt request (vLLM's two shapes)
TokenizeRequest = TypeAdapter(Annotated[Union[Annotated[TokenizePromptRequest, Tag("prompt")],
                                              Annotated[TokenizeChatRequest, Tag("chat")]],
                                        Discriminator(_tokenize_kind)])


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[TokenId]
