"""From an HTTP body to engine requests: JSON parsing into the strict pydantic models
(server/protocol.py), the model check, the chat template, prompts, and the engine's
validation. Each failure is an OpenAI-style `APIError`, or the engine's `InvalidParameter`,
which server/errors.py answers as a 400."""

from __future__ import annotations

from fastapi import Request
from pydantic import BaseModel, TypeAdapter, ValidationError

from engine.request import EngineRequest
from engine.sampling_params import InvalidParameter, SamplingParams
from server.errors import APIError, validation_error
from server.tool_calls import ToolUse
from server.tool_prompt import fallback_messages, native_messages, openai_tools, template_has_tools
from trainer.ledger_db import ClientPrompt


def is_json_media_type(content_type: str | None) -> bool:
    """Whether a Content-Type header names JSON (`…/json` or `…/…+json`, any parameters), as
    FastAPI's strict content type reads it; none given is no JSON."""
    if not content_type:
        return False
    subtype = content_type.split(";", 1)[0].strip().lower().partition("/")[2]
    return subtype == "json" or subtype.endswith("+json")


_LONE_SURROGATE = (" (a \\uD800-\\uDFFF escape is half a character: a high one then a low one make one;"
                   " either alone is no Unicode text, which I-JSON, RFC 7493, refuses too)")


async def parse_body(request: Request, model: type[BaseModel] | TypeAdapter):
    """The body, validated by `model` (or by a TypeAdapter of a tagged union of models).
    A body not sent as JSON — a form, plain text, or none named — is refused (415), as
    FastAPI refuses it (422): those are what a web page may send another origin without
    asking first, so reading them as JSON would let any page a user opens label, train or
    roll back."""
    raw = await request.body()
    if not raw.strip():
        raise APIError(400, "The request body is empty; send a JSON object.", code="invalid_json")
    content_type = request.headers.get("content-type")
    if not is_json_media_type(content_type):
        sent = f"not as {content_type!r}" if content_type else "and no Content-Type was given"
        raise APIError(415, f"The request body must be sent as JSON (Content-Type: application/json), {sent}.",
                       code="unsupported_media_type")
    tagged = isinstance(model, TypeAdapter)
    try:
        return model.validate_json(raw) if tagged else model.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            lone = "hex escape" in str(first.get("msg"))  # a \ud800 with no low surrogate after it
            raise APIError(400, f"We could not parse the JSON body of your request: {first.get('msg')}"
                           f"{_LONE_SURROGATE if lone else ''}.", code="invalid_json") from None
        # the body itself (a tagged union's location holds its tag); a field's object is the field's error
        if first.get("type") == "model_type" and len(first.get("loc", ())) <= (1 if tagged else 0):
            raise APIError(400, "The request body must be a JSON object.", code="invalid_json") from None
        raise validation_error(exc, tagged) from None


def check_model(served_names: tuple[str, ...], name: str) -> None:
    if name not in served_names:
        available = ", ".join(f"`{served}`" for served in served_names)
        raise APIError(404, f"The model `{name}` does not exist. Available: {available}.", "model",
                       "model_not_found")


def check_unsupported(body) -> None:
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true.", "stream_options")


def make_request(async_engine, request_id: str, prompt_ids: list[int], params: SamplingParams, train: bool,
                 prompt_param: str, client_prompt: object = None, matcher=None,
                 cache_salt: str | None = None) -> EngineRequest:
    """The engine's request, validated (once); `prompt_param` names the prompt's field,
    which the engine's errors call `prompt`; `client_prompt`: the prompt as the client
    wrote it, when a reward function will be shown it; `matcher`: its grammar's, which
    `AsyncEngine.check_grammar` compiled off the event loop; `cache_salt`: the request's."""
    try:
        return async_engine.make_request(request_id, prompt_ids, params, train, client_prompt, matcher, cache_salt)
    except InvalidParameter as exc:
        if exc.param in ("prompt", "messages"):
            exc.param = prompt_param
        raise


# what the server itself passes to the chat template; `chat_template_kwargs` may not set them
_TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                 "add_generation_prompt", "continue_final_message", "return_dict",
                                 "return_tensors", "padding", "truncation", "max_length"})


def render_chat(tokenizer, body, tools: ToolUse | None = None, add_special_tokens: bool = False) -> list[int]:
    """The prompt's token ids: the messages (and the tools offered) through the chat
    template, or through the fallback tool prompt (server/tool_prompt.py) where the
    template has no tool section; with the body's template controls (vLLM's)."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise APIError(400, "This model has no chat template; use /v1/completions.", "messages")
    continue_final_message = body.continue_final_message
    add_generation_prompt = opens_a_turn(body)
    if add_generation_prompt and continue_final_message:
        raise APIError(400, "continue_final_message goes on with the last message; it cannot be combined with "
                       "add_generation_prompt, which opens a new one (send add_generation_prompt: false)",
                       "continue_final_message")
    if continue_final_message and body.messages[-1].role != "assistant":
        raise APIError(400, "continue_final_message goes on with the last message, which must be the assistant's",
                       "continue_final_message")
    extra = dict(body.chat_template_kwargs or {})
    reserved = sorted(_TEMPLATE_ARGUMENTS & set(extra))
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {reserved[0]!r}: the request's own fields do",
                       "chat_template_kwargs")
    messages, offered = template_input(template, body.messages, tools)
    if offered:
        extra["tools"] = offered
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             continue_final_message=continue_final_message, **extra)
    except Exception as exc:  # noqa: BLE001 - template errors (e.g. role order) are the user's to fix
        raise APIError(400, f"The chat template rejected the messages: {exc}", "messages") from None
    # `add_special_tokens`: the tokenizer's on top of the template's (vLLM's /tokenize may ask for them)
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def opens_a_turn(body) -> bool:
    """Whether the chat template is asked to open the assistant's turn after the messages
    (`add_generation_prompt`): going on with the last message opens none unless the body
    asks for both (which `render_chat` refuses)."""
    return body.add_generation_prompt and (not body.continue_final_message
                                           or "add_generation_prompt" in body.model_fields_set)


def template_input(template: str, messages: list, tools: ToolUse | None) -> tuple[list[dict], list[dict] | None]:
    """The messages a chat template is given, and the tools it renders itself (OpenAI's
    format; None where the fallback tool prompt puts them inside the messages)."""
    given = [message.template_dict() for message in messages]
    functions = tools.functions if tools is not None else None
    if template_has_tools(template):
        return native_messages(given), openai_tools(functions) if functions else None
    return fallback_messages(given, functions), None


def ledger_prompt(tokenizer, body, tools: ToolUse | None) -> ClientPrompt:
    """What the ledger keeps of a chat request's prompt: the client's messages (a reward
    function is shown those), and the tools offered where the chat template renders them
    itself — or the messages the template was given, where those are not the client's
    (content parts joined, the developer role as system, tool calls and the fallback tool
    prompt rendered), so that TRL renders from the export the prompt that was served; and
    whether the template opened the assistant's turn (TRL opens it after any prompt that
    does not end with the assistant's message). A group scored again after a restart shows
    its reward function the ledger's messages."""
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    given, offered = template_input(getattr(tokenizer, "chat_template", None), body.messages, tools)
    return ClientPrompt(messages, offered, None if given == messages else given, body.chat_template_kwargs or None,
                        opens_a_turn(body))


def completion_prompts(tokenizer, prompt, vocab_size: int, tail: int | None = None) -> list[tuple[list[int], str]]:
    """(token ids, text) per prompt of a /v1/completions body, its ids in the model's
    vocabulary; with `tail`, each prompt's last `tail` tokens only (vLLM's
    truncate_prompt_tokens), the text theirs."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty.", "prompt", "invalid_value")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    result = []
    for i, p in enumerate(prompt):
        param = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        if not p:  # also a text that a tokenizer adding BOS would make one token: the schema says minLength 1
            raise APIError(400, f"{param} must not be empty.", param, "invalid_value")
        if isinstance(p, str):
            result.append((tokenizer(p)["input_ids"], p))
        else:
            if any(not 0 <= t < vocab_size for t in p):  # before decoding: an id past 32 bits overflows it
                raise APIError(400, f"{param}'s token ids must be in [0, {vocab_size}).", param, "invalid_value")
            result.append((list(p), tokenizer.decode(p)))
    if tail is not None:
        result = [(ids[-tail:], tokenizer.decode(ids[-tail:])) if len(ids) > tail else (ids, text)
                  for ids, text in result]
    return result
