"""vLLM-shaped worker answers, and a loopback HTTP server that replays them (a stand-in for a vLLM
prefill or decode server behind the router; not one of our parts).

Where the shapes come from (vLLM's source, read for this purpose):
- `kv_transfer_params`: `NixlConnector` scheduler `request_finished`
  (vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py, split later into
  nixl/pull_scheduler.py): `do_remote_prefill` = "I am P", `do_remote_decode` = "I am D",
  `remote_block_ids` one list per KV-cache group (HMA: e.g. full-attention + sliding-window),
  `remote_engine_id`, `remote_request_id`, `remote_host`/`remote_port` (the side channel),
  `tp_size`, `remote_num_tokens`, `remote_blocks_expiry_time` (`time.perf_counter() +
  decoder_kv_blocks_ttl` on D: D's monotonic clock, not wall time; None on P). A one-way D
  (no bidirectional transfer) returns `null`.
- response bodies: vllm/entrypoints/openai/serving_chat.py: `usage.prompt_tokens_details.cached_tokens`
  (only with --enable-prompt-tokens-details and a non-zero count; else
  `prompt_tokens_details` is null), the non-stream
  body's top-level `kv_transfer_params`; streaming: the finish chunk (the one with a
  `finish_reason`) carries `kv_transfer_params`, an `include_usage` chunk with `choices: []`
  follows, then `data: [DONE]`.
The numbers (block ids, ports, clock values) are made up in those shapes.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from workers import send_json

MODEL = "Qwen/Qwen3-0.6B"

P_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [[3, 4, 5]], "remote_engine_id": "9c1f0e2a-p",
            "remote_request_id": "chatcmpl-p-0", "remote_host": "10.0.0.5",
            "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 40,
            "remote_blocks_expiry_time": None}

# bidirectional vLLM D: two KV-cache groups (full + sliding window, the latter clipped)
D_PARAMS = {"do_remote_prefill": False, "do_remote_decode": True,
            "remote_block_ids": [[11, 12, 13, 14], [13, 14]], "remote_engine_id": "4be7d3c1-d",
            "remote_request_id": "chatcmpl-d-0", "remote_host": "10.0.0.6",
            "remote_port": 5601, "tp_size": 1, "remote_num_tokens": 52,
            "remote_blocks_expiry_time": 183457.25}


def usage(prompt: int, completion: int, cached: int | None) -> dict:
    details = None if cached is None else {"cached_tokens": cached}
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion, "prompt_tokens_details": details}


def chat_json(content: str, finish: str, use: dict, params: dict | None) -> dict:
    return {"id": "chatcmpl-7d1e", "object": "chat.completion", "created": 1764570000,
            "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content,
                                                 "refusal": None, "annotations": None,
                                                 "audio": None, "function_call": None,
                                                 "tool_calls": [], "reasoning_content": None},
                         "logprobs": None, "finish_reason": finish, "stop_reason": None}],
            "service_tier": None, "system_fingerprint": None, "usage": use,
            "prompt_logprobs": None, "kv_transfer_params": params}


def chat_chunks(pieces: list[str], use: dict | None, params: dict | None) -> list[dict]:
    base = {"id": "chatcmpl-7d1e", "object": "chat.completion.chunk", "created": 1764570000,
            "model": MODEL}
    out = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]}]
    out += [{**base, "choices": [{"index": 0, "delta": {"content": p}, "logprobs": None,
                                  "finish_reason": None}]} for p in pieces]
    out.append({**base, "choices": [{"index": 0, "delta": {"content": ""}, "logprobs": None,
                                     "finish_reason": "length", "stop_reason": None}],
                "kv_transfer_params": params})
    if use is not None:
        out.append({**base, "choices": [], "usage": use})
    return out


class VllmStub:
    """`role` "prefill" or "decode"; a decode stub returns D_PARAMS when `bidirectional`, else
    null. Every POST body is recorded in `seen` (the router's warm-up calls in `warmups`). `hold_after_done_s`: a streaming answer keeps
    its connection open that long after `[DONE]` before closing."""

    def __init__(self, role: str, bidirectional: bool = True, cached: int | None = 16,
                 hold_after_done_s: float = 0.0, d_ttl_s: float | None = None,
                 owned_by: str = "vllm", warmup_delay_s: float = 0.0,
                 warmup_status: int = 200) -> None:
        self.owned_by = owned_by  # /v1/models `owned_by`: what the router takes it for
        self.role, self.bidirectional, self.cached = role, bidirectional, cached
        self.d_ttl_s = d_ttl_s  # set: D's expiry = its perf_counter() + this, as vLLM's
        self.hold_after_done_s = hold_after_done_s
        self.seen: list[dict] = []
        self.warmups: list[dict] = []
        self.order: list[str] = []  # "warmup" / "turn", per POST as it arrived
        self.warmup_delay_s, self.warmup_status = warmup_delay_s, warmup_status
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _json(self, status: int, body: dict) -> None:
                send_json(self, status, body)

            def do_GET(self):  # noqa: N802
                if self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model",
                                                                 "owned_by": stub.owned_by}]})
                else:
                    self._json(200, {})

            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.path not in ("/v1/chat/completions", "/v1/completions"):
                    self._json(404, {"detail": "Not Found"})  # as vLLM (e.g. /v1/kv/retention)
                    return
                body = json.loads(body)
                warmup = self.headers.get("x-request-id", "").startswith("duplexkv-warmup-")
                stub.order.append("warmup" if warmup else "turn")
                if warmup:  # the router's cold-start exchange (router/warmup.py)
                    stub.warmups.append(body)
                    time.sleep(stub.warmup_delay_s)
                    if stub.warmup_status != 200:
                        self._json(stub.warmup_status, {"error": {"message": "warm-up refused"}})
                        return
                else:
                    stub.seen.append(body)
                if stub.role == "prefill":
                    self._json(200, chat_json("The", "length", usage(40, 1, stub.cached),
                                              copy.deepcopy(P_PARAMS)))
                    return
                params = copy.deepcopy(D_PARAMS) if stub.bidirectional else None
                if params is not None and stub.d_ttl_s is not None:
                    params["remote_blocks_expiry_time"] = time.perf_counter() + stub.d_ttl_s
                if params is not None:  # one entry per turn, as vLLM's request ids
                    params["remote_request_id"] = f"chatcmpl-d-{len(stub.seen)}"
                if not body.get("stream"):
                    self._json(200, chat_json("The answer is 42.", "length",
                                              usage(40, 6, stub.cached), params))
                    return
                include = (body.get("stream_options") or {}).get("include_usage")
                chunks = chat_chunks(["The", " answer", " is", " 42", "."],
                                     usage(40, 6, stub.cached) if include else None, params)
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("connection", "close")
                self.end_headers()
                for c in chunks:
                    self.wfile.write(b"data: " + json.dumps(c).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                time.sleep(stub.hold_after_done_s)
                self.close_connection = True

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
