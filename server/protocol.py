"""OpenAI request bodies, validated strictly at the HTTP edge, and their conversion to
engine `SamplingParams`. Pydantic lives in server/ only: here, in the parts these bodies
are built from (server/protocol_fields.py, server/protocol_formats.py), in the bodies of
the server's own training routes (server/protocol_training.py), and in the response
models (server/response_schemas.py).

Strict: wrong types are rejected, not coerced ("5" is not a number), and unknown fields
are rejected with OpenAI's "Unrecognized request argument supplied" so that a typo like
`max_token` does not pass silently. Fields the OpenAI API defines but that do not change
generation here (user, metadata, store, service_tier, reasoning_effort, verbosity,
prediction, prompt_cache_key and _retention, safety_identifier, modalities of text,
stream_options.include_obfuscation) are accepted and
ignored; where OpenAI's schema lets a field be null, null takes its default, and a field
this server does not offer (audio, web search, the deprecated functions) is refused by
name unless it is null. vLLM's extra sampling fields (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, ...) are accepted under vLLM's names, and so are
its structured outputs (`structured_outputs`, and the `guided_*` fields vLLM had before
0.12) and its chat template controls (`add_generation_prompt`, `continue_final_message`,
`chat_template_kwargs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, TypeAdapter, model_validator

from engine.sampling_params import MAX_LOGPROBS, InvalidParameter, SamplingParams
from engine.structured import Grammar, check_compiles
from server.protocol_fields import (INTEGRAL, TEMPLATE_CONTROLS_SCHEMA, TOOL_CHOICE_TYPES, TOOLS_NEEDED_SCHEMA,
                                    ChatMessage, Int, LimitFrom0, LimitFrom1, LogitBias, Metadata, StreamOptions,
                                    Strict, TokenId, documented, drop_unasked, non_empty_alternatives)
from server.protocol_formats import (AllowedToolsChoice, NamedToolChoice, ResponseFormat, StructuredOutputs, Tool,
                                     build_grammar, check_parameters, functions)
from server.tool_calls import ToolUse


# fields of OpenAI's API (and vLLM's) that this server does not offer, and what to send instead
# (server/errors.py says it); null means not asked
NOT_OFFERED = {
    "functions": "it is deprecated in OpenAI's API; send 'tools'",
    "function_call": "it is deprecated in OpenAI's API; send 'tool_choice'",
    "audio": "this server answers in text only",
    "web_search_options": "this server does not search the web",
    "prompt_logprobs": "/v1/completions gives the prompt's log-probabilities with 'echo': true and 'logprobs'",
}


class _SamplingFields(Strict):
    """Fields shared by chat and text completions."""

    @model_validator(mode="before")
    @classmethod
    def _unasked(cls, data):
        return drop_unasked(data, NOT_OFFERED)

    @model_validator(mode="after")
    def _null_takes_the_default(self):
        for name in ("n", "stream", "logprobs", "echo", "max_tokens"):
            field = type(self).model_fields.get(name)
            if field is not None and getattr(self, name) is None:
                setattr(self, name, field.default)
        return self

    model: str
    n: Annotated[int, Field(ge=1, le=128), INTEGRAL] | None = 1
    # (the ranges engine/sampling_params.py checks, in the document too)
    temperature: documented(float, minimum=0, maximum=2) | None = None
    top_p: documented(float, exclusiveMinimum=0, maximum=1) | None = None
    stop: str | documented(list[documented(str, minLength=1)], maxItems=16) | None = None  # ("" is none)
    seed: documented(Int, minimum=-(2**63), maximum=2**63 - 1) | None = None
    presence_penalty: documented(float, minimum=-2, maximum=2) | None = None
    frequency_penalty: documented(float, minimum=-2, maximum=2) | None = None
    logit_bias: LogitBias | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: Metadata | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM's extra sampling parameters
    top_k: documented(Int, minimum=-1) | None = None  # (0 and -1: no top-k)
    min_p: documented(float, minimum=0, maximum=1) | None = None
    repetition_penalty: documented(float, exclusiveMinimum=0) | None = None
    min_tokens: LimitFrom0 = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's structured outputs, and their names before vLLM 0.12
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: documented(list[str], minItems=1) | None = None
    guided_grammar: str | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: as many as the served context holds)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, json_schema_extra={"not": {"const": 0}}), INTEGRAL] \
        | None = None
    # Hugging Face's generation names, which lm-evaluation-harness passes on from a task's
    # generation_kwargs: max_new_tokens limits the output beside the other limits (the
    # smallest applies); beam search is not offered, so num_beams is 1
    max_new_tokens: LimitFrom0 | None = None
    num_beams: Annotated[int, Field(json_schema_extra={"minimum": 1, "maximum": 1}), INTEGRAL] = 1
    # vLLM's: prompts with another salt share no prefix-cache blocks with this one (one
    # tenant cannot time another's cached prompts)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # alchemist: false keeps this request out of online training
    train: bool = True

    # the fewest output tokens a request may ask for (a completion scores its prompt with 0)
    MIN_OUTPUT_TOKENS: ClassVar[int] = 0

    def _output_limit(self, given: int | None, name: str) -> tuple[int | None, str]:
        """The output's limit and the field it came from (an error about it names that
        field): `given` (the request's field `name`, checked by the caller) and
        max_new_tokens, the smaller of those sent."""
        if self.max_new_tokens is None:
            return given, name
        if self.max_new_tokens < self.MIN_OUTPUT_TOKENS:
            raise InvalidParameter("max_new_tokens", f"max_new_tokens must be at least {self.MIN_OUTPUT_TOKENS}, "
                                   f"got {self.max_new_tokens}")
        if given is None or self.max_new_tokens < given:
            return self.max_new_tokens, "max_new_tokens"
        return given, name

    def prompt_tail(self, max_model_len: int, max_tokens: int | None) -> int | None:
        """How many of the prompt's last tokens to keep (`truncate_prompt_tokens`), or None:
        all. -1 keeps as many as the context holds beside the output (`max_tokens`, at least
        the one token a prompt is answered with, but none for a prompt only scored)."""
        if self.truncate_prompt_tokens is None:
            return None
        if self.truncate_prompt_tokens == 0:
            raise InvalidParameter("truncate_prompt_tokens", "truncate_prompt_tokens must be at least 1, or -1 "
                                   "for as many as the context holds")
        if self.truncate_prompt_tokens == -1:  # (a prompt only scored, max_tokens 0, may fill the context)
            return max(1, max_model_len - (0 if max_tokens == 0 else max(1, max_tokens or 0)))
        return self.truncate_prompt_tokens

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
                asked.append((f"guided_{kind}", lambda kind=kind, spec=spec: build_grammar(kind, spec,
                                                                                             f"guided_{kind}")))
        if len(asked) > 1:
            raise InvalidParameter(asked[1][0], f"{asked[0][0]} and {asked[1][0]} both constrain the output; "
                                   "send one")
        return asked[0][1]() if asked else None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                         defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """`defaults`: for the sampling fields the body leaves out (server/generation_config.py)."""
        if self.num_beams != 1:
            raise InvalidParameter("num_beams", f"beam search is not supported; num_beams must be 1, got "
                                   f"{self.num_beams}")
        optional = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):  # ("²" and "٣" are digits to str.isdigit)
                raise InvalidParameter("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
            bias[int(key)] = value
        return SamplingParams(
            n=self.n, logit_bias=bias, seed=self.seed, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            **{**(defaults or {}), **{k: v for k, v in optional.items() if v is not None}},
        )


class ChatCompletionRequest(_SamplingFields):
    model_config = ConfigDict(**Strict.model_config, json_schema_extra={**TEMPLATE_CONTROLS_SCHEMA,
                                                                         **TOOLS_NEEDED_SCHEMA})

    # an answer has at least one token (OpenAI's minimum)
    MIN_OUTPUT_TOKENS: ClassVar[int] = 1
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: LimitFrom1 | None = None
    max_completion_tokens: LimitFrom1 | None = None
    max_new_tokens: LimitFrom1 | None = None
    logprobs: bool | None = False
    top_logprobs: documented(Int, minimum=0, maximum=MAX_LOGPROBS) | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | None,
                           TOOL_CHOICE_TYPES] = None
    parallel_tool_calls: bool | None = None
    # OpenAI's, without effect on this model's generation
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    modalities: list[Literal["text"]] | None = None
    # vLLM's chat template controls: end with the assistant's turn opening, or go on with the
    # last message (an assistant's, left open; then no turn opens unless asked), and more
    # variables for the template
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def tool_use(self) -> ToolUse | None:
        """What this request allows of tools; None when it offers none (or `tool_choice` is "none")."""
        check_messages(self.messages)
        if not self.tools:
            for name in ("tool_choice", "parallel_tool_calls"):
                if getattr(self, name) not in (None, "none"):
                    raise InvalidParameter(name, f"{name} is only allowed when 'tools' are specified")
            return None
        names = [tool.function.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise InvalidParameter("tools", "tools must have distinct function names")
        check_parameters(self.tools)  # whatever tool_choice is, as OpenAI does
        choice = self.tool_choice or "auto"
        if choice == "none":
            return None
        named, offered = None, functions(self.tools)
        if isinstance(choice, NamedToolChoice):
            named = choice.function.name
            if named not in names:
                raise InvalidParameter("tool_choice", f"tool_choice names `{named}`, which is not in tools")
            choice = "named"
        elif isinstance(choice, AllowedToolsChoice):  # the model is shown, and calls, only those
            allowed = [tool.function.name for tool in choice.allowed_tools.tools]
            if not allowed:
                raise InvalidParameter("tool_choice.allowed_tools.tools", "tool_choice.allowed_tools must name at "
                                       "least one of tools")
            for i, name in enumerate(allowed):
                if name not in names:
                    raise InvalidParameter(f"tool_choice.allowed_tools.tools[{i}]",
                                           f"tool_choice.allowed_tools names `{name}`, which is not in tools")
            offered, choice = [f for f in offered if f["name"] in allowed], choice.allowed_tools.mode
        return ToolUse(offered, choice, named, self.parallel_tool_calls is not False)

    def sampling_params(self, tools: ToolUse | None = None, tool_call_token: int | None = None,
                        defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """`tools`: this request's `tool_use()`; `tool_call_token`: the id of `<tool_call>`
        where the tokenizer has it as one token; `defaults`: the model's sampling defaults."""
        # both limits are checked, each under its own name, before the one that applies is taken
        for name in ("max_completion_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < self.MIN_OUTPUT_TOKENS:
                raise InvalidParameter(name, f"{name} must be at least {self.MIN_OUTPUT_TOKENS}, got {value}")
        newer = self.max_completion_tokens is not None
        max_tokens, limit_name = self._output_limit(self.max_completion_tokens if newer else self.max_tokens,
                                                    "max_completion_tokens" if newer else "max_tokens")
        top = None
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidParameter("top_logprobs", f"top_logprobs must be between 0 and {MAX_LOGPROBS}, "
                                   f"got {self.top_logprobs}")
        if self.logprobs:
            top = self.top_logprobs or 0
        elif self.top_logprobs is not None:
            raise InvalidParameter("top_logprobs", "top_logprobs requires logprobs to be true")
        params = self._sampling_params(max_tokens, top, defaults=defaults)
        params.max_tokens_param = limit_name
        params.grammar = self._grammar(self.response_format)
        shaped_text = params.grammar is not None and params.grammar.param == "response_format"
        if tools is not None and tools.forced:
            if params.grammar is not None and not shaped_text:
                raise InvalidParameter(params.grammar.param, f"{params.grammar.param} cannot be combined with a "
                                       "tool_choice that forces a tool call")
            # the call is the whole answer: `response_format` shapes a text answer, as in a
            # later turn (OpenAI's Agents SDK sends both, then `auto`), so it is only checked
            if shaped_text:
                check_compiles(params.grammar)
            params.grammar = tools.grammar(tool_call_token)
            params.stop = []  # the grammar ends a forced call: a stop string ("\n") would cut its layout
        elif tools is not None and shaped_text:
            params.grammar = tools.grammar(tool_call_token, (self.response_format.schema(), params.grammar.kind))
        if tools is not None and tool_call_token is not None:
            params.skip_special_tokens = False  # the parser reads the <tool_call> tags
        return params


class CompletionRequest(_SamplingFields):
    prompt: Annotated[str | list[str] | list[TokenId] | list[list[TokenId]],
                      Field(json_schema_extra=non_empty_alternatives)]
    max_tokens: LimitFrom0 | None = 16
    # chat's newer name, which some clients (guidellm) send here too: as there, it wins over max_tokens
    max_completion_tokens: LimitFrom0 | None = None
    echo: bool | None = False
    logprobs: documented(Int, minimum=0, maximum=MAX_LOGPROBS) | None = None
    best_of: Int | None = None
    # insertion (fill-in-the-middle) is not offered: only an empty suffix, which is none
    suffix: Annotated[str, Field(json_schema_extra={"maxLength": 0})] | None = None

    def sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        # max_tokens' default (16) is no limit the client set: max_new_tokens alone replaces it
        sent = self.max_tokens if "max_tokens" in self.model_fields_set or self.max_new_tokens is None else None
        name = "max_tokens"
        if self.max_completion_tokens is not None:
            sent, name = self.max_completion_tokens, "max_completion_tokens"
        max_tokens, limit_name = self._output_limit(sent, name)
        params = self._sampling_params(max_tokens, self.logprobs, prompt_logprobs, defaults)
        params.max_tokens_param = limit_name
        params.grammar = self._grammar()
        return params


class _TokenizeFields(Strict):
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

    model_config = ConfigDict(**Strict.model_config, json_schema_extra=TEMPLATE_CONTROLS_SCHEMA)

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[Tool] | None = None
    # vLLM's: the tokenizer's special tokens (BOS) on top of what the chat template writes
    add_special_tokens: bool = False
    # as in /v1/chat/completions (vLLM's chat template controls)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def tool_use(self) -> ToolUse | None:
        check_messages(self.messages)
        check_parameters(self.tools or [])
        return ToolUse(functions(self.tools)) if self.tools else None


def check_messages(messages: list[ChatMessage]) -> None:
    """What the schema says across a message's fields (its `allOf`), which pydantic does not check."""
    for i, message in enumerate(messages):
        if message.role == "tool" and message.tool_call_id is None:
            raise InvalidParameter(f"messages[{i}].tool_call_id", f"Missing required parameter: 'messages[{i}]"
                                   ".tool_call_id' (a message with role 'tool' needs it).", "missing_required_parameter")
        if message.content is None and message.role != "assistant":  # (an assistant's may be its tool calls)
            raise InvalidParameter(f"messages[{i}].content", f"Missing required parameter: 'messages[{i}]"
                                   f".content' (a message with role '{message.role}' needs content).",
                                   "missing_required_parameter")


def _tokenize_kind(value) -> str:
    return "chat" if isinstance(value, dict) and "messages" in value else "prompt"


# a body with `messages` is a chat request, any other a prompt request (vLLM's two shapes)
TokenizeRequest = TypeAdapter(Annotated[Union[Annotated[TokenizePromptRequest, Tag("prompt")],
                                              Annotated[TokenizeChatRequest, Tag("chat")]],
                                        Discriminator(_tokenize_kind)])


class DetokenizeRequest(Strict):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[TokenId]
