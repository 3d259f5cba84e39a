"""The router's token check of a replay to a P that does not verify tokens itself (vLLM): P's own
/tokenize of this prompt against the sequence D holds (learned on the previous turn's D leg);
verify.py decides what P may read (docs/vllm.md).
"""

from __future__ import annotations

import logging
import time

import httpx

from duplexkv.router.backends import Backend, BackendPool
from duplexkv.router.conversation.store import Entry
from duplexkv.router.metrics import RouterMetrics
from duplexkv.router.turn.calls import Unreachable, WorkerCalls
from duplexkv.router.turn.context import Turn
from duplexkv.router.verify import Verdict, token_list, tokenize_body, verify
from duplexkv.wire.kv_params import replay_params

log = logging.getLogger("duplexkv.router")
perf = time.perf_counter


class TokenCheck:
    def __init__(self, calls: WorkerCalls, pool: BackendPool, metrics: RouterMetrics,
                 threshold: int) -> None:
        self.calls, self.pool, self.metrics, self.threshold = calls, pool, metrics, threshold

    async def run(self, turn: Turn, p: Backend, entry: Entry) -> tuple[dict | None, Verdict]:
        """-> (the entry's params cut to the prefix P's prompt shares with D's held sequence,
        or None: the turn runs as a miss, counted by its reason; the verdict), also in
        kv_stats.verify."""
        t = perf()
        prompt = await self._tokenize(turn, p) if entry.tokens is not None else None
        d = self.pool.decode_at(entry.decode_url)
        block = (d.block_size if d is not None else None) or p.block_size
        checked, v = verify(replay_params(entry.params), entry.tokens, prompt, block,
                            self.threshold)
        v.verify_ms = round((perf() - t) * 1e3, 3)
        turn.stats.verify = v.as_dict()
        if checked is None:
            self.metrics.reuse.labels(v.pull_outcome()).inc()
            log.info("%s: not replaying D's KV to %s: %s %s (held %d, matched %d tokens)",
                     turn.request_id, p.name, v.outcome, v.reason, v.held_tokens,
                     v.matched_tokens)
        return checked, v

    async def _tokenize(self, turn: Turn, p: Backend) -> list[int] | None:
        """P's own tokens for this request's prompt (its /tokenize), or None if it cannot say."""
        body = tokenize_body(turn.req.body, chat=turn.req.path.endswith("/chat/completions"))
        try:
            resp = await self.calls.send(p, turn, body, path="/tokenize")
            tokens = token_list(resp.json().get("tokens")) if resp.status_code == 200 else None
        except (Unreachable, httpx.HTTPError, ValueError, AttributeError) as e:
            log.warning("%s: %s/tokenize failed: %r", turn.request_id, p.name, e)
            return None
        if tokens is None:
            log.warning("%s: %s/tokenize answered %d without tokens", turn.request_id, p.name,
                        resp.status_code)
        return tokens
