"""Mid-stream migration: a D that breaks while it streams an answer (killed, hung, its host cut
off) has the answer continued on another D, so that the client sees one stream.

    what      the prompt's token ids (D's `prompt_token_ids` when it sends them, vLLM; else the
              new D's own /tokenize of the client's request, the tokenization D used) plus the
              token ids already streamed (the D leg asks for `return_token_ids` on a stream the
              router may continue; they are removed unless the client asked for them): a
              /v1/completions request with that sequence as its prompt, the client's sampling
              parameters, max_tokens (min_tokens) less the tokens already sent, streamed
    shape     the continuation's chunks are rewritten to the client's endpoint (a chat chunk's
              delta, or a completion's text) under the first chunk's id, created and model,
              then pass through the same StreamRelay (kv_stats, token ids stripped); its usage
              counts the prompt and every completion token, as one run would
    where     another D (least loaded, not one that broke this stream), each at most once
    same      under greedy decoding the continuation is the undisturbed answer's tail (the
              tests compare token for token). What cannot be continued exactly: a sampler's
              randomness (a seeded or unseeded non-greedy run draws other tokens after the
              break), a stop string that spans the break (each D checks the text it made),
              and answers the router does not continue at all: n > 1, logprobs, tools
    after     nothing is stored for the conversation's next turn (it runs as a miss)
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import httpx

from duplexkv.http.openai import COMPLETION_DEFAULT_MAX_TOKENS
from duplexkv.router.backends import Backend, BackendPool, in_flight
from duplexkv.router.legs import dumps
from duplexkv.router.liveness import WentDown
from duplexkv.router.stream import DONE, StreamRelay
from duplexkv.router.turn.calls import Unreachable, WorkerCalls
from duplexkv.router.turn.context import Turn
from duplexkv.router.verify import token_list, tokenize_body

log = logging.getLogger("duplexkv.router")

# client fields a continuation (a completion over token ids) does not take
DROPS = ("messages", "prompt", "n", "tools", "tool_choice", "parallel_tool_calls",
         "chat_template", "chat_template_kwargs", "add_generation_prompt",
         "continue_final_message", "documents", "response_format", "conversation_id",
         "kv_transfer_params", "return_token_ids", "max_completion_tokens", "max_tokens",
         "min_tokens", "min_completion_tokens", "logprobs", "top_logprobs", "echo", "suffix",
         "stream_options", "user")


def migratable(body: dict) -> bool:
    """Whether the router can continue this stream elsewhere (one choice, no logprobs, no
    tools: what a completion over token ids reproduces)."""
    return (body.get("n") in (None, 1) and not body.get("logprobs")
            and not body.get("tools") and not body.get("echo"))


def continuation_body(body: dict, ids: list[int], sent: int,
                      default_limit: int | None = None) -> dict | None:
    """The completion that continues `body` after `sent` tokens; None when none is left.
    `default_limit`: the original endpoint's max_tokens when the body names none."""
    out = {k: v for k, v in body.items() if k not in DROPS}
    limit = body.get("max_completion_tokens")
    limit = body.get("max_tokens") if limit is None else limit
    limit = default_limit if limit is None else limit
    if isinstance(limit, int):
        if limit - sent <= 0:
            return None
        out["max_tokens"] = limit - sent
    floor = body.get("min_tokens", body.get("min_completion_tokens"))
    if isinstance(floor, int) and floor - sent > 0:
        out["min_tokens"] = floor - sent
    usage = (body.get("stream_options") or {}).get("include_usage")
    out.update(prompt=ids, stream=True, return_token_ids=True,
               stream_options={"include_usage": bool(usage)})
    return out


def default_limit(chat: bool, max_model_len: int | None, prompt: int) -> int | None:
    """The original request's max_tokens when it names none: a completion's 16 (OpenAI's and
    vLLM's default), a chat's rest of the context (None when the worker's length is unknown)."""
    if not chat:
        return COMPLETION_DEFAULT_MAX_TOKENS
    return None if max_model_len is None else max(max_model_len - prompt, 0)


def as_client_chunk(obj: dict, head: dict, chat: bool, prompt: int, sent: int) -> dict:
    """A continuation's completion chunk -> the client's chunk (its endpoint's shape)."""
    out = {**obj, **head}
    out.pop("kv_transfer_params", None)
    choices = []
    for c in obj.get("choices") or []:
        c = dict(c)
        if chat:
            text = c.pop("text", "")
            c["delta"] = {"content": text} if text else {}
        choices.append(c)
    out["choices"] = choices
    usage = obj.get("usage")
    if isinstance(usage, dict):  # the continuation counts the sent tokens as its prompt
        done = usage.get("completion_tokens", 0) + sent
        out["usage"] = {**usage, "prompt_tokens": prompt, "completion_tokens": done,
                        "total_tokens": prompt + done}
    return out


class Migration:
    def __init__(self, pool: BackendPool, calls: WorkerCalls, turn: Turn,
                 relay: StreamRelay) -> None:
        self.pool, self.calls, self.turn, self.relay = pool, calls, turn, relay
        self.chat = turn.req.path.endswith("/chat/completions")

    async def events(self, broken: Backend) -> AsyncIterator[bytes]:
        """The rest of the answer from other D's; raises Unreachable when none could go on."""
        relay, tried = self.relay, {broken}
        relay.drop_partial()
        prompt = relay.prompt_ids
        while not relay.done:
            d, _ = self.pool.choose_decode(None, tried)
            if d is None:
                raise Unreachable("no other decode worker to continue the stream on")
            tried.add(d)
            if prompt is None:
                prompt = await self._tokenize(d)
                if prompt is None:
                    continue
            sent = list(relay.output_ids or ())
            body = continuation_body(self.turn.req.body, prompt + sent, len(sent),
                                     default_limit(self.chat, d.max_model_len, len(prompt)))
            log.warning("%s: continuing the stream on %s after %d tokens",
                        self.turn.request_id, d.name, len(sent))
            if body is None:  # every token was sent: only the end is missing
                for event in relay.feed(DONE + b"\n\n"):
                    yield event
                return
            try:
                async for event in self._continue(d, body, len(prompt), len(sent)):
                    yield event
            except (Unreachable, WentDown, httpx.HTTPError) as e:
                log.warning("%s: the continuation on %s broke: %r", self.turn.request_id,
                            d.name, e)
                relay.drop_partial()

    async def _continue(self, d: Backend, body: dict, prompt: int,
                        sent: int) -> AsyncIterator[bytes]:
        with in_flight(d):
            resp = await self.calls.send(d, self.turn, body, stream=True,
                                         path="/v1/completions")
            try:
                if resp.status_code != 200:
                    await resp.aread()
                    raise Unreachable(self.calls.bad_status(d, resp))
                it = resp.aiter_lines()
                while True:
                    try:
                        line = await self.calls.liveness.next(d, it)
                    except StopAsyncIteration:
                        return
                    for event in self.relay.feed(self._line(line, prompt, sent)):
                        yield event
            finally:
                await resp.aclose()

    def _line(self, line: str, prompt: int, sent: int) -> bytes:
        if not line.startswith("data:") or line.startswith("data: [DONE]"):
            return (line + "\n").encode()
        try:
            obj = json.loads(line[5:])
        except ValueError:
            return (line + "\n").encode()
        if isinstance(obj, dict) and "choices" in obj:
            obj = as_client_chunk(obj, self.relay.head, self.chat, prompt, sent)
        return b"data: " + dumps(obj) + b"\n"

    async def _tokenize(self, d: Backend) -> list[int] | None:
        body = tokenize_body(self.turn.req.body, chat=self.chat)
        try:
            resp = await self.calls.send(d, self.turn, body, path="/tokenize")
            return token_list(resp.json().get("tokens")) if resp.status_code == 200 else None
        except (Unreachable, httpx.HTTPError, ValueError, AttributeError) as e:
            log.warning("%s: %s/tokenize failed: %r", self.turn.request_id, d.name, e)
            return None
