"""A generation request's body -> what the engine runs: parse (the OpenAI layer, 400s naming the
field), tokenize, the sampling params (the model's generation config fills what the request left
out, as vLLM), the KV transfer params, and the engine's own admission checks, all before the
request is queued. Runs on the worker's prepare threads, never on the event loop.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from duplexkv.wire.kv_params import KVParamsError, KVTransferParams
from duplexkv.engine.llm_engine import LLMEngine, RequestRejected
from duplexkv.wire.sampling import SamplingParams
from duplexkv.http.errors import bad_request, model_not_found
from duplexkv.http.features import Features
from duplexkv.http.openai import COMPLETION_DEFAULT_MAX_TOKENS, GenerateRequest, Kind, parse_request
from duplexkv.http.request_id import clean_request_id

PREFIX = {"completion": "cmpl", "chat": "chatcmpl"}
WORKER = Features(structured=True)  # a worker's, without --enable-auto-tool-choice


@dataclass(frozen=True, slots=True)
class Prepared:
    req: GenerateRequest
    prompt_ids: list[int]
    params: SamplingParams
    kv_params: KVTransferParams | None


def prepare(engine: LLMEngine, served_model_names: tuple[str, ...], body: dict,
            kind: Kind, features: Features = WORKER) -> Prepared:
    req = parse_request(body, kind, features)
    if req.model is not None and req.model not in served_model_names:
        raise model_not_found(req.model)
    ids = _tokenize(engine, req)
    # default max_tokens, as vLLM: completions 16, chat the rest of the context (bounded by the
    # KV pool); the generation config's max_new_tokens when smaller (vLLM takes the least)
    cap = engine.capacity()
    limit = min(cap.max_model_len, cap.kv_tokens)
    defaults = engine.sampling_defaults
    default = min(COMPLETION_DEFAULT_MAX_TOKENS if kind == "completion" else limit,
                  defaults.get("max_tokens", limit))
    max_tokens = req.max_tokens if req.max_tokens is not None else \
        max(1, min(limit - len(ids), default))
    kwargs = req.sampling_kwargs(max_tokens)
    # the model's generation config fills what the request left out (vLLM)
    kwargs.update({k: v for k, v in defaults.items() if k != "max_tokens" and body.get(k) is None})
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        m = re.search(r"parameter (\w+)=", str(e))
        raise bad_request(str(e), m.group(1) if m else None) from None
    try:
        kv = None if req.kv_transfer_params is None else \
            KVTransferParams.from_dict(req.kv_transfer_params)
    except KVParamsError as e:
        raise bad_request(str(e), "kv_transfer_params") from None
    if kv is not None and kv.do_remote_decode and params.n > 1:
        # a prefill leg's answer is only its KV for D (vLLM's proxy sends n=1 to P too): n
        # choices here would be n-1 wasted ones, and D, which samples the choices, never sees n
        raise bad_request(f"`n` must be 1 on a prefill leg (kv_transfer_params.do_remote_decode"
                          f"), got {params.n}: send n to the decode leg, which samples the "
                          "choices over the prompt computed once", "n")
    try:
        engine.check_request(len(ids), params)
    except RequestRejected as e:
        raise bad_request(str(e), e.param) from None
    return Prepared(req, ids, params, kv)


def _tokenize(engine: LLMEngine, req: GenerateRequest) -> list[int]:
    field = "prompt" if req.kind == "completion" else "messages"
    try:
        if req.kind == "completion":
            return engine.tokenize(req.prompt)  # type: ignore[arg-type]
        return engine.tokenize(req.messages, req.add_generation_prompt,  # type: ignore[arg-type]
                               req.chat_options.render_kwargs())
    except RequestRejected as e:
        raise bad_request(str(e), field) from None
    except Exception as e:  # a chat template that cannot render these messages
        what = "apply the chat template" if req.kind == "chat" else "tokenize the prompt"
        raise bad_request(f"could not {what}: {e}", field) from None


class RequestIds:
    """Engine request ids: the client's X-Request-Id when given (suffixed if in flight)."""

    def __init__(self) -> None:
        self.in_flight: set[str] = set()

    def claim(self, header: str | None, kind: Kind) -> tuple[str, str]:
        """-> (engine request id, response id)."""
        base = clean_request_id(header) or ""
        rid = base or f"{PREFIX[kind]}-{uuid.uuid4().hex}"
        while rid in self.in_flight:
            rid = f"{base}-{uuid.uuid4().hex[:8]}"
        self.in_flight.add(rid)
        return rid, rid if rid.startswith(PREFIX[kind] + "-") else f"{PREFIX[kind]}-{rid}"

    def release(self, rid: str) -> None:
        self.in_flight.discard(rid)
