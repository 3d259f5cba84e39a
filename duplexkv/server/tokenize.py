"""`POST /tokenize` and `POST /detokenize` on a worker, in vLLM's request and response shapes.

    /tokenize     {prompt, add_special_tokens=true}                       (a completion prompt)
                  {messages, add_generation_prompt=true, add_special_tokens=false, tools,
                   chat_template_kwargs, documents}                      (a chat, rendered)
                  [+ model, return_token_strs]
               -> {count, max_model_len, tokens, token_strs}
    /detokenize   {tokens, model?} -> {prompt}    (special tokens kept, as HF's decode by default)
    /v1/messages/count_tokens   Anthropic's: a Messages request without max_tokens
                  -> {input_tokens}               (its prompt, rendered as /v1/messages renders it)

Validation is the generation endpoints' (same messages, same chat template arguments, same 400s
naming the field); the work runs on the worker's prepare threads, never on the event loop. The
count is not capped at the context length (a client may ask how far over it a prompt is); the
body size limit bounds the work.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi import FastAPI
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from duplexkv.engine.llm_engine import LLMEngine
from duplexkv.http.body import parse_json, read_body
from duplexkv.http.chat_options import ChatOptions, parse_chat_options
from duplexkv.http import messages
from duplexkv.http.errors import APIError, bad_request, model_not_found
from duplexkv.http.openai import parse_messages
from duplexkv.server.serving import OpenAIServing


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_options: ChatOptions = field(default_factory=ChatOptions)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"`{name}` must be a boolean", name)
    return v


def _check_model(body: dict, served: tuple[str, ...]) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("`model` must be a string", "model")
    if model is not None and model not in served:
        raise model_not_found(model)


def parse_tokenize(body: dict, served: tuple[str, ...]) -> TokenizeRequest:
    _check_model(body, served)
    if _bool(body, "continue_final_message", False):
        raise bad_request("`continue_final_message` is not supported by this server",
                          "continue_final_message")
    if body.get("chat_template") is not None:
        raise bad_request("`chat_template` is not supported by this server: a chat template "
                          "from the request is not accepted", "chat_template")
    strs = _bool(body, "return_token_strs", False)
    if body.get("messages") is not None:
        return TokenizeRequest(
            messages=parse_messages(body["messages"]),
            add_special_tokens=_bool(body, "add_special_tokens", False),
            add_generation_prompt=_bool(body, "add_generation_prompt", True),
            return_token_strs=strs, chat_options=parse_chat_options(body, generate=False))
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("`prompt` (a string) or `messages` is required", "prompt")
    return TokenizeRequest(prompt=prompt, return_token_strs=strs,
                           add_special_tokens=_bool(body, "add_special_tokens", True))


def tokenize(engine: LLMEngine, req: TokenizeRequest) -> dict:
    tok = engine.tokenizer
    text = req.prompt
    if req.messages is not None:
        try:
            text = tok.apply_chat_template(req.messages, req.add_generation_prompt,
                                           **req.chat_options.render_kwargs())
        except Exception as e:  # a template that cannot render these messages
            raise bad_request(f"could not apply the chat template: {e}", "messages") from None
    assert text is not None
    ids = tok.encode(text, add_special_tokens=req.add_special_tokens)
    out: dict = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                 "token_strs": None}
    if req.return_token_strs:
        out["token_strs"] = [tok.id_to_token(i) or "" for i in ids]
    return out


def detokenize(engine: LLMEngine, body: dict, served: tuple[str, ...]) -> dict:
    _check_model(body, served)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in ids):
        raise bad_request("`tokens` must be a list of token ids", "tokens")
    vocab = engine.model_config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": engine.tokenizer.decode(ids, skip_special_tokens=False)}


def add_routes(app: FastAPI, serving: OpenAIServing) -> None:
    engine = serving.aeng.engine
    # every name the worker answers to (several with --served-model-name), else its one name
    served = tuple(getattr(serving, "names", None) or (serving.model,))

    async def run(request: Request, work) -> Response:
        try:
            raw = await read_body(request, serving.max_request_bytes)
        except ClientDisconnect:
            return Response(status_code=499)
        except APIError as e:
            return e.response()
        loop = asyncio.get_running_loop()
        try:
            return JSONResponse(await loop.run_in_executor(serving.prep_pool, work, raw))
        except APIError as e:
            return e.response()

    @app.post("/tokenize")
    async def tokenize_endpoint(request: Request) -> Response:
        return await run(request, lambda raw: tokenize(
            engine, parse_tokenize(parse_json(raw), served)))

    @app.post(messages.COUNT_PATH)
    async def count_message_tokens(request: Request) -> Response:
        return messages.as_count(await run(request, lambda raw: tokenize(
            engine, parse_tokenize(messages.to_count(parse_json(raw)), served))))

    @app.post("/detokenize")
    async def detokenize_endpoint(request: Request) -> Response:
        return await run(request, lambda raw: detokenize(engine, parse_json(raw), served))
