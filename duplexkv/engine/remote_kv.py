"""The engine's glue to its KV connector (engine/kv_transfer.py): a request with
`kv_transfer_params` is parked while the connector pulls, and the connector's events resume or
fail it. Every call into the connector is guarded: a connector error is counted and logged and
costs at most its request's remote KV (computed instead), never the engine.

    admission   wants(seq, params) -> park(seq): start_pull, or on failure resume (compute)
    each step   events(live) -> [(seq, event)] for requests still parked
                land(seq, KVLanded) / decline(seq, PullDeclined) -> resumed;
                LoadFailed -> the engine fails the request
    finish      finish(seq, reason) -> the connector's params for the blocks it keeps
    abort       abort(seq)

`KVEvents` applies the events to the engine's requests (a landed pull may start an n > 1
request's other choices, or emit the holder's first token at once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from duplexkv.engine.kv_transfer import (
    ConnectorEvent,
    KVConnectorBase,
    KVLanded,
    LoadFailed,
    NoKVConnector,
    PullDeclined,
)
from duplexkv.engine.block_manager import BlockManager
from duplexkv.engine.parallel import Choices
from duplexkv.engine.scheduler import Scheduler
from duplexkv.engine.sequence import Sequence
from duplexkv.wire.kv_params import KVTransferParams

if TYPE_CHECKING:
    from duplexkv.engine.output_processor import ReqState, RequestOutput

log = logging.getLogger(__name__)


class RemoteKV:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.connector: KVConnectorBase = NoKVConnector()
        self.num_errors = 0

    def attach(self, connector: KVConnectorBase) -> None:
        self.connector = connector
        self.scheduler.reclaim = connector.reclaim

    def wants(self, seq: Sequence, params: KVTransferParams | None) -> bool:
        """Should `seq` wait for remote KV? (Errors propagate: the request was never queued.)"""
        return params is not None and self.connector.wants_remote_kv(seq, params)

    def park(self, seq: Sequence) -> None:
        """Park `seq` and start its pull; if starting fails, compute it instead."""
        self.scheduler.park_for_remote_kv(seq)
        try:
            self.connector.start_pull(seq)
        except Exception:
            log.exception("starting the KV pull for %s failed; computing it", seq.request_id)
            self.num_errors += 1
            self.connector.on_abort(seq)
            seq.stats.pull_outcome = "failed"
            self.scheduler.resume(seq)

    def events(self, live: Callable[[str], Sequence | None]
               ) -> list[tuple[Sequence, ConnectorEvent]]:
        """The connector's events for requests still waiting (`live(id)`: its sequence, or None
        once aborted)."""
        try:
            events = self.connector.poll()
        except Exception:
            self.num_errors += 1
            log.exception("the connector's poll failed")
            return []
        out = []
        for ev in events:
            seq = live(ev.request_id)
            if seq is not None and ev.request_id in self.scheduler.parked:
                out.append((seq, ev))
        return out

    def decline(self, seq: Sequence, ev: PullDeclined) -> None:
        seq.stats.pull_outcome = ev.reason
        self.scheduler.resume(seq)

    def load_failed(self, seq: Sequence, ev: LoadFailed) -> None:
        seq.stats.pull_outcome = ev.reason
        self.abort(seq)

    def land(self, seq: Sequence, ev: KVLanded) -> None:
        seq.stats.pulled_tokens += ev.pulled_tokens
        seq.stats.transfer_bytes += ev.transfer_bytes
        seq.stats.transfer_ms += ev.transfer_ms
        seq.stats.pull_outcome = "pulled"
        self.scheduler.resume(seq, ev.num_computed_tokens)

    def finish(self, seq: Sequence, reason: str) -> KVTransferParams | None:
        try:
            return self.connector.on_finish(seq, reason)
        except Exception:  # the answer is still good; only its KV is not kept
            self.num_errors += 1
            log.exception("the connector's finish failed for %s", seq.request_id)
            return None

    def abort(self, seq: Sequence) -> None:
        try:
            self.connector.on_abort(seq)
        except Exception:
            self.num_errors += 1
            log.exception("the connector's abort failed for %s", seq.request_id)

    def extra_refs(self) -> dict[int, int]:
        return self.connector.extra_refs()


class KVEvents:
    """The engine's handling of its connector's events (a mixin of LLMEngine: a pull's outcome
    acts on the request table like a step does, through the engine's `fail_request`, `_fail`,
    `_start_choices` and `_append_token`)."""

    remote: RemoteKV
    requests: dict[str, ReqState]
    choices: Choices
    bm: BlockManager

    def _poll_connector(self) -> list[RequestOutput]:
        outputs = []
        for seq, ev in self.remote.events(self._live):
            st = self.requests[seq.request_id]
            try:
                out = self._on_kv_event(seq, ev)
            except Exception as e:
                out = self._fail(st, f"applying remote KV failed: {e!r}")
            if out is not None:
                outputs.append(out)
        return outputs

    def _live(self, request_id: str) -> Sequence | None:
        st = self.requests.get(request_id)
        return None if st is None else st.seq

    def _on_kv_event(self, seq: Sequence, ev: ConnectorEvent) -> RequestOutput | None:
        if isinstance(ev, LoadFailed):
            self.remote.load_failed(seq, ev)
            return self.fail_request(seq.request_id, ev.message)
        if isinstance(ev, PullDeclined):
            self.remote.decline(seq, ev)
            return None
        self.remote.land(seq, ev)
        if seq.request_id in self.choices.groups:  # the other choices share the pulled prompt
            self.bm.cache_blocks(seq)  # hashed before they take its blocks
            self._start_choices(seq)
        if ev.first_token_id is not None and seq.num_computed_tokens == seq.num_prompt_tokens:
            # the holder's greedy token after exactly this prompt: emit it, compute nothing
            self.bm.cache_blocks(seq)  # no step may follow (the request can finish right here)
            return self.accept_token(seq.request_id, ev.first_token_id)
        return None

    def accept_token(self, request_id: str, tok: int) -> RequestOutput:
        """Append a token sampled elsewhere (P's first token on a D leg) as this request's next
        output, exactly as if this engine had sampled it; the next step computes its KV."""
        st = self.requests[request_id]
        assert st.seq.num_computed_tokens == st.seq.num_tokens, "token before its context"
        return self._append_token(st, tok)

