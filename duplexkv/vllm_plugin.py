"""A vLLM general plugin: `kv_transfer_params` at the end of streamed chat/text completions.

vLLM 0.32 returns a decode worker's `kv_transfer_params` (the blocks it keeps for the next turn,
bidirectional KV transfer) only in non-streaming bodies; upstream PR #40186, still open, adds them
to streams. Without them a router gets no reuse on streamed turns. This plugin adds one chunk
before `data: [DONE]` when the request's final output carries params:

    data: {"id": <the stream's id>, "object": <its object>, "created": ..., "model": ...,
           "choices": [], "kv_transfer_params": {...}}

(a trailing chunk with no choices, as an `include_usage` chunk is; clients skip it, our router
takes the params from it and removes it from what the client sees).

Installed into vLLM's own environment (`pip install --no-deps duplexkv`: the plugin imports
nothing but vLLM and the standard library); vLLM loads it through the `vllm.general_plugins`
entry point in every process, and it patches only the API server's two stream generators,
once. `VLLM_PLUGINS` (vLLM's allowlist) can leave it out. A vLLM without those generators logs
a warning and is left as it is.
"""

from __future__ import annotations

import json
import logging

log = logging.getLogger("duplexkv.vllm_plugin")
_MARK = "_duplexkv_stream_params"
DONE = "data: [DONE]\n\n"


def register() -> None:
    """The entry point: patch the chat and completion stream generators (idempotent)."""
    try:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    except ImportError as e:  # another vLLM layout: nothing to patch
        log.warning("duplexkv plugin: vLLM's serving modules not found (%s); streams stay "
                    "without kv_transfer_params", e)
        return
    _patch(OpenAIServingChat, "chat_completion_stream_generator", 1, pair=False)
    _patch(OpenAIServingCompletion, "completion_stream_generator", 2, pair=True)


def _patch(cls, name: str, gen_index: int, pair: bool) -> None:
    """Wrap cls.name(self, *args): args[gen_index] is the engine's result generator (of
    RequestOutput, or of (index, RequestOutput) pairs when `pair`)."""
    original = getattr(cls, name, None)
    if original is None or getattr(original, _MARK, False):
        if original is None:
            log.warning("duplexkv plugin: %s.%s not found; not patched", cls.__name__, name)
        return

    async def stream(self, *args, **kwargs):
        box: list = [None]
        args = list(args)
        if len(args) <= gen_index:
            async for event in original(self, *args, **kwargs):
                yield event
            return
        args[gen_index] = _watch(args[gen_index], box, pair)
        last = None
        async for event in original(self, *args, **kwargs):
            if event == DONE and box[0]:
                yield trailing_chunk(last, box[0])
            elif event.startswith("data: {"):
                last = event
            yield event

    setattr(stream, _MARK, True)
    stream.__name__, stream.__doc__ = original.__name__, original.__doc__
    setattr(cls, name, stream)


async def _watch(results, box: list, pair: bool):
    """Pass the engine's outputs through, keeping the last non-empty kv_transfer_params."""
    async for item in results:
        out = item[1] if pair else item
        params = getattr(out, "kv_transfer_params", None)
        if params:
            box[0] = params
        yield item


def trailing_chunk(last_event: str | None, params: dict) -> str:
    """The chunk that carries `params`, with the id/object/created/model of the stream's last
    chunk (so a client sees one stream)."""
    head: dict = {}
    if last_event is not None:
        try:
            prev = json.loads(last_event[len("data: "):])
            head = {k: prev[k] for k in ("id", "object", "created", "model") if k in prev}
        except (ValueError, TypeError):
            head = {}
    return "data: " + json.dumps({**head, "choices": [], "kv_transfer_params": params},
                                 separators=(",", ":")) + "\n\n"
