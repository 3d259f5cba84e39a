"""The engine: requests in, one `step()` at a time (schedule -> run -> process).

Its parts: `builder.py` builds the model, tokenizer, pool and block manager from the config;
`output_processor.py` turns sampled tokens into outputs (detokenizing, stop conditions, held-back
text); `remote_kv.py` is the glue to the KV connector (park while pulling, resume on its events);
`calibration.py` keeps the prefill cost model; `parallel.py` holds an n > 1 request's choices.
Here: admission, the step with its per-request fault isolation, finish / abort / fail, and the
public operations the server and the KV connector ask for (`EngineHost`, engine/kv_transfer.py).
"""

from __future__ import annotations

import logging
import time

import torch

from duplexkv.engine.admission import Admission, Prompt, RequestRejected
from duplexkv.engine.builder import build
from duplexkv.engine.calibration import Calibration
from duplexkv.engine.config import EngineConfig
from duplexkv.engine.grammar import Grammars
from duplexkv.engine.host import HostOps
from duplexkv.engine.kv_transfer import KVConnectorBase
from duplexkv.engine.output_processor import OutputProcessor, ReqState, RequestOutput
from duplexkv.engine.parallel import Choices, choice_params
from duplexkv.engine.remote_kv import KVEvents, RemoteKV
from duplexkv.engine.sampler import greedy_rows, sample_token
from duplexkv.engine.scheduler import ScheduledSeq, Scheduler
from duplexkv.engine.sequence import Sequence
from duplexkv.engine.state import EngineViews
from duplexkv.wire.kv_params import KVTransferParams
from duplexkv.wire.sampling import SamplingParams

log = logging.getLogger(__name__)
MAX_CONSECUTIVE_STEP_FAILURES = 3
__all__ = ["EngineFatal", "LLMEngine", "Prompt", "RequestOutput", "RequestRejected"]


class EngineFatal(RuntimeError):
    """The engine's own state can no longer be trusted (block integrity broken after a failed
    step, or steps keep failing): the process must stop so that a supervisor restarts it.
    `outputs` are the failed step's answers, still to be delivered."""

    def __init__(self, message: str, outputs: list | None = None) -> None:
        super().__init__(message)
        self.outputs = outputs or []


class LLMEngine(Admission, KVEvents, EngineViews, HostOps):
    def __init__(self, config: EngineConfig) -> None:
        parts = build(config)  # model, dtype, tokenizer, generation defaults, pool, fingerprint
        for name in parts.__slots__:
            setattr(self, name, getattr(parts, name))
        self.scheduler = Scheduler(self.bm, self.config.max_num_batched_tokens,
                                   self.config.max_num_seqs)
        self.requests: dict[str, ReqState] = {}  # by sequence (choice) id
        self.choices = Choices(self.config.block_size)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len, self.grammars)
        self.remote = RemoteKV(self.scheduler)
        self.costs = Calibration()  # calibrate() once loaded; every lone prefill after
        self._next_id = 0
        self.num_failed_requests = 0  # ended by an error of their own (not by the client)
        self.num_failed_steps = 0
        self._consecutive_step_failures = 0

    def attach_connector(self, connector: KVConnectorBase) -> None:
        """Use `connector` for KV transfer (docs/architecture.md, "The connector contract")."""
        self.remote.attach(connector)

    # requests
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None,
                    kv_params: KVTransferParams | None = None) -> Sequence:
        """Queue a request; with `kv_params` the connector may first pull remote KV for it
        (the sequence is parked until the connector's event resumes it)."""
        params = params or SamplingParams()
        params.validate()
        ids = self.tokenize(prompt)
        self.check_request(len(ids), params)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self.requests or request_id in self.choices.groups:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, ids, choice_params(params, 0) if params.n > 1 else params,
                       self.config.block_size)
        self.requests[request_id] = self.outputs.new_state(seq)
        try:
            wants = self.remote.wants(seq, kv_params)
        except BaseException:
            del self.requests[request_id]  # never queued: nothing else to undo
            raise
        if params.n > 1:
            self.choices.open(seq, params)
        if wants:
            self.remote.park(seq)
        else:
            self.scheduler.add(seq)
            self._start_choices(seq)  # nothing to share, or a decode-local prefix adopted
        return seq

    def _start_choices(self, seq: Sequence) -> None:
        """Start the choices held back for `seq` (a choice 0) once the prompt blocks they share
        are computed: each takes them by reference and computes the rest (engine/parallel.py)."""
        children, blocks, shared = self.choices.ready(seq)
        for child in children:
            self.requests[child.request_id] = self.outputs.new_state(child)
            if shared:
                self.scheduler.adopt_prefix(child, blocks, shared)
                child.stats.shared_tokens = shared
            self.scheduler.add(child)

    def abort(self, request_id: str) -> None:
        """End a request (every choice of it) without an answer."""
        for rid in self.choices.close(request_id) or [request_id]:
            st = self.requests.pop(rid, None)
            if st is not None and not st.seq.is_finished:
                self.remote.abort(st.seq)
                self.scheduler.finish(st.seq, "abort")

    def fail_request(self, request_id: str, message: str) -> RequestOutput | None:
        """End a request with finish_reason "error" (e.g. a KV load failed under policy fail)."""
        st = self.requests.pop(request_id, None)
        if st is None:
            return None
        st.seq.error = message
        self.scheduler.finish(st.seq, "error")
        if st.seq.output_id in self.choices.groups:  # one choice failed: so did its request
            self.abort(st.seq.output_id)
        return self.outputs.error_output(st, message)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def has_work(self) -> bool:
        """Something can be scheduled now (parked sequences wait for their transfer)."""
        return self.scheduler.has_work

    # the step
    def step(self) -> list[RequestOutput]:
        """Run one batch. A failure confined to one request ends that request with an error;
        a failure of the whole forward pass ends the batch's requests, then the pool's
        integrity is checked and the engine goes on (EngineFatal when it cannot)."""
        outputs = self._poll_connector()
        if outputs:  # e.g. a D leg's first token: to its client now, not after a forward pass
            return outputs
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        t0 = time.perf_counter()
        try:
            logits = self.runner.run(batch)
        except Exception as e:
            return self._fail_step(batch, e)
        self._consecutive_step_failures = 0
        dt_ms = (time.perf_counter() - t0) * 1e3
        self.costs.observe(batch, dt_ms)
        sampling = [item for item in batch if item.samples]
        self._advance(batch, dt_ms)
        return self._process(sampling, logits)

    def _advance(self, batch: list[ScheduledSeq], dt_ms: float) -> None:
        """Account the computed tokens; cache full blocks; start choices waiting on them."""
        for item in batch:
            seq = item.seq
            if seq.in_prefill:
                seq.stats.prefill_ms += dt_ms
                seq.stats.computed_tokens += min(item.num_new_tokens,
                                                 seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += item.num_new_tokens
            self.bm.cache_blocks(seq)
            self._start_choices(seq)  # before seq can finish and drop its references

    def _process(self, sampling: list[ScheduledSeq], logits: torch.Tensor | None
                 ) -> list[RequestOutput]:
        """Sample each sampling row and turn its token into an output, one request at a time."""
        outputs: list[RequestOutput] = []
        if logits is None:
            return outputs
        tops = greedy_rows(logits) if all(item.seq.params.greedy for item in sampling) \
            else None
        for i, item in enumerate(sampling):
            st = self.requests.get(item.seq.request_id)
            if st is None:  # a sibling choice's failure ended this request meanwhile
                continue
            try:
                seq = st.seq
                tok = sample_token(logits[i], seq.params, self.banned_tokens(seq),
                                   seq.prompt_token_ids, seq.output_token_ids, st.generator,
                                   st.matcher, None if tops is None else tops[i])
            except Exception as e:
                outputs.append(self._fail(st, f"sampling failed: {e}"))
                continue
            try:
                outputs.append(self._append_token(st, tok))
            except Exception as e:
                outputs.append(self._fail(st, f"processing the sampled token failed: {e!r}"))
        return outputs

    def _append_token(self, st: ReqState, tok: int) -> RequestOutput:
        stop = self.outputs.append(st, tok)
        kv_params = None
        if stop is not None:
            kv_params = self.remote.finish(st.seq, stop.reason)
            self.scheduler.finish(st.seq, stop.reason)
            del self.requests[st.seq.request_id]
            self.choices.finished(st.seq)
        return self.outputs.output(st, stop, kv_params)

    def _fail(self, st: ReqState, message: str) -> RequestOutput:
        """End one request with finish_reason "error"; the others are not touched."""
        log.error("request %s failed: %s", st.seq.request_id, message)
        self.num_failed_requests += 1
        if not st.seq.is_finished:
            self.remote.abort(st.seq)
        out = self.fail_request(st.seq.request_id, message)
        assert out is not None
        return out

    def _fail_step(self, batch: list[ScheduledSeq], exc: Exception) -> list[RequestOutput]:
        log.exception("step failed for %d requests", len(batch), exc_info=exc)
        self.num_failed_steps += 1
        self._consecutive_step_failures += 1
        outputs = [self._fail(self.requests[item.seq.request_id], f"the forward pass failed: "
                                                                  f"{exc!r}")
                   for item in batch if item.seq.request_id in self.requests]
        try:
            self.check_integrity()
        except AssertionError as e:
            raise EngineFatal(f"KV block integrity broken after a failed step: {e}",
                              outputs) from exc
        if self._consecutive_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineFatal(f"{self._consecutive_step_failures} steps in a row failed, last: "
                              f"{exc!r}", outputs) from exc
        return outputs

    def calibrate(self, budget_s: float = 2.0) -> None:
        """Fit the prefill cost model on this model and machine (engine/calibration.py). Only
        before any request (the engine thread must not run yet)."""
        self.costs.calibrate(self, budget_s)

    def check_integrity(self) -> None:
        """Pool invariants, and every block reference accounted for (sequences + pins)."""
        refs = self.scheduler.refs_held()
        for bid, n in self.remote.extra_refs().items():
            refs[bid] = refs.get(bid, 0) + n
        self.bm.check_integrity(refs)
