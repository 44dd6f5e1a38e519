"""vLLM's `/tokenize` and `/detokenize`: the served model's tokenizer over HTTP.

`/tokenize` takes `prompt` (text, as `/v1/completions` tokenizes it) or `messages` (and
`tools`, rendered with the chat template as `/v1/chat/completions` does) and returns `tokens`,
`count` and `max_model_len`; `/detokenize` takes `tokens` and returns `prompt`;
`/tokenizer_info` gives the special tokens and the chat template (vLLM's, there behind a
flag; here always: /tokenize already serves the tokenizer). With the three,
lm-evaluation-harness tokenizes through the server (`tokenizer_backend=remote`, which its
default picked in lm_eval 0.4.13, the version tried), with no copy of the tokenizer on the
client's side.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from server.errors import APIError
from server.parsing import check_model, parse_body, render_chat
from server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest
from server.response_schemas import TokenizerInfo
from server.state import ServerState


def _tokenized(state: ServerState, body) -> dict:
    if isinstance(body, TokenizeChatRequest):
        tokens = render_chat(state.tokenizer, body, body.tool_use(), body.add_special_tokens)
    else:
        tokens = state.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
    result = {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}
    if body.return_token_strs:
        result["token_strs"] = state.tokenizer.convert_ids_to_tokens(tokens)
    return result


def tokens_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(request: Request):
        body = await parse_body(request, TokenizeRequest)
        if body.model is not None:
            check_model(state.model_names, body.model)
        # on a worker thread (the tokenizer lets go of the GIL): the route is open even with an
        # API key, as vLLM's, and a 4 MB prompt held the event loop 5 s (an outside pass)
        return await asyncio.to_thread(_tokenized, state, body)

    @router.post("/detokenize")
    async def detokenize(request: Request):
        body: DetokenizeRequest = await parse_body(request, DetokenizeRequest)
        if body.model is not None:
            check_model(state.model_names, body.model)
        vocab = state.engine.vocab_size  # the model's ids; those past the tokenizer's decode to ""
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token ids must be in [0, {vocab}); got {bad}.", "tokens", "invalid_value")
        return {"prompt": await asyncio.to_thread(state.tokenizer.decode, body.tokens)}

    @router.get("/tokenizer_info")
    async def tokenizer_info():
        tokenizer = state.tokenizer
        template = getattr(tokenizer, "chat_template", None)
        return TokenizerInfo(tokenizer_class=type(tokenizer).__name__, bos_token=tokenizer.bos_token,
                             eos_token=tokenizer.eos_token, pad_token=tokenizer.pad_token,
                             unk_token=tokenizer.unk_token, model_max_length=state.max_model_len,
                             chat_template=template if isinstance(template, str) else None)

    return router
