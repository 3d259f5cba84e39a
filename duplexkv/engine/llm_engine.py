"""The engine: requests in, one `step()` at a time (schedule -> run -> sample -> postprocess).

Longer than 300 lines: a request's whole lifecycle (admission and checks, the step with its
per-request fault isolation, stop handling, the connector's events, finish/abort/fail) acts on one
request table, and reads best in one place.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from duplexkv.engine.block_manager import BlockManager
from duplexkv.engine.config import EngineConfig
from duplexkv.engine.dtype import read_cpu_flags, resolve_dtype
from duplexkv.engine.cost_model import PrefillCostModel, Sample
from duplexkv.engine.kv_pool import DTYPE, block_bytes, num_blocks_for
from duplexkv.engine.kv_transfer import (
    ConnectorEvent,
    KVConnectorBase,
    KVTransferParams,
    LoadFailed,
    NoKVConnector,
    PullDeclined,
)
from duplexkv.engine.model_runner import ModelRunner
from duplexkv.engine.parallel import Choices, choice_params
from duplexkv.engine.sampler import make_generator, process_row, sample_row
from duplexkv.wire.sampling import SamplingParams
from duplexkv.engine.scheduler import Scheduler
from duplexkv.engine.sequence import KVStats, Sequence
from duplexkv.model.chat_template import load_chat_template
from duplexkv.model.config import ModelLoadError
from duplexkv.model.generation_config import sampling_defaults
from duplexkv.model.loader import load_config, load_weights
from duplexkv.model.registry import resolve_model
from duplexkv.model.segment_cache import TooManyTokens
from duplexkv.model.tokenizer import IncrementalDetokenizer, Tokenizer

Prompt = str | list[int] | list[dict]
log = logging.getLogger(__name__)
MAX_CONSECUTIVE_STEP_FAILURES = 3


class RequestRejected(ValueError):
    """The request can never be served as asked (too long, bad parameters); say why."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineFatal(RuntimeError):
    """The engine's own state can no longer be trusted (block integrity broken after a failed
    step, or steps keep failing): the process must stop so that a supervisor restarts it.
    `outputs` are the failed step's answers, still to be delivered."""

    def __init__(self, message: str, outputs: list | None = None) -> None:
        super().__init__(message)
        self.outputs = outputs or []


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated so far
    text: str  # generated text so far (stop strings removed)
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    kv_stats: KVStats | None = None
    kv_transfer_params: KVTransferParams | None = None  # the connector's, on the final output
    error: str | None = None  # with finish_reason "error"
    # as vLLM: the stop string or stop token id that ended it; None for eos and length
    stop_reason: int | str | None = None
    index: int = 0  # the choice (n > 1: engine/parallel.py)


@dataclass(slots=True)
class _ReqState:
    seq: Sequence
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    emitted_chars: int = 0  # text already returned as new_text
    text: str = ""
    sent_tokens: int = 0


def model_fingerprint(model_dir: Path, dtype: str, block_size: int) -> bytes:
    """Seed of the block hash chain: same model files + dtype + layout => same hashes."""
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 16))
    h.update(f"{dtype}/{block_size}".encode())
    return h.digest()[:16]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        model_dir = resolve_model(config.model, config.revision)
        mc = load_config(model_dir)
        max_len = config.max_model_len or mc.max_position_embeddings
        if max_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {max_len} exceeds the model's "
                             f"max_position_embeddings {mc.max_position_embeddings}")
        choice = resolve_dtype(config.dtype, read_cpu_flags())
        log.info("dtype %s (%s)", choice.dtype, choice.reason)
        self.dtype_reason = choice.reason
        config = self.config = replace(config, max_model_len=max_len, dtype=choice.dtype)
        self.model_dir, self.model_config = model_dir, mc
        tok_dir = model_dir if config.tokenizer is None else \
            resolve_model(config.tokenizer, config.tokenizer_revision)
        self.tokenizer = Tokenizer.from_dir(tok_dir, load_chat_template(config.chat_template))
        self.sampling_defaults = sampling_defaults(config.generation_config, model_dir)
        try:
            SamplingParams(**{"max_tokens": 16, **self.sampling_defaults})
        except ValueError as e:
            raise ModelLoadError(f"generation config ({config.generation_config}): {e}") from None
        if self.sampling_defaults:
            log.info("sampling defaults from the model's generation config (a request's own "
                     "values win): %s", self.sampling_defaults)
        dtype = DTYPE[config.dtype]
        num_blocks = num_blocks_for(mc, config.block_size, dtype, config.num_kv_blocks,
                                    config.kv_cache_memory_gib)
        self.block_bytes = block_bytes(mc, config.block_size, dtype)
        self.runner = ModelRunner(mc, load_weights(model_dir, mc, dtype), config.dtype,
                                  config.block_size, num_blocks)
        self.fingerprint = model_fingerprint(model_dir, config.dtype, config.block_size)
        self.bm = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                               self.fingerprint)
        self.scheduler = Scheduler(self.bm, config.max_num_batched_tokens, config.max_num_seqs)
        self.requests: dict[str, _ReqState] = {}  # by sequence (choice) id
        self.choices = Choices(config.block_size)
        self._next_id = 0
        self.num_failed_requests = 0  # ended by an error of their own (not by the client)
        self.num_failed_steps = 0
        self._consecutive_step_failures = 0
        self.connector: KVConnectorBase = NoKVConnector()
        self.num_connector_errors = 0
        self.cost_model = PrefillCostModel()  # calibrate() once loaded; every lone prefill after
        self._calibrating = False

    def attach_connector(self, connector: KVConnectorBase) -> None:
        """Use `connector` for KV transfer (docs/architecture.md, "The connector contract")."""
        self.connector = connector
        self.scheduler.reclaim = connector.reclaim

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len  # type: ignore[return-value]

    # requests
    def tokenize(self, prompt: Prompt, add_generation_prompt: bool = True,
                 template_kwargs: dict | None = None) -> list[int]:
        """Prompt -> ids. A text far beyond the context is refused as soon as that is certain,
        without materialising its ids. `template_kwargs`: a chat's tools, documents and
        chat_template_kwargs, passed to the chat template."""
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            prompt = self.tokenizer.apply_chat_template(
                prompt, add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
        if isinstance(prompt, str):
            try:
                return self.tokenizer.encode(prompt, limit=self.max_model_len)
            except TooManyTokens as e:
                raise RequestRejected(
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, your prompt has at least {e.at_least} tokens. Please reduce "
                    f"the length of the prompt.", "prompt") from None
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise RequestRejected(f"token id {bad[0]} is outside the vocabulary "
                                      f"[0, {self.model_config.vocab_size})", "prompt")
            return list(prompt)
        raise RequestRejected("prompt must be a string, a list of token ids or chat messages")

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Reject what could never be served, with the reason and the limit."""
        if num_prompt_tokens == 0:
            raise RequestRejected("the prompt is empty", "prompt")
        outside = params.token_ids_outside(self.model_config.vocab_size)
        if outside is not None:
            raise RequestRejected(f"`{outside[0]}` names token id {outside[1]}, outside the "
                                  f"vocabulary [0, {self.model_config.vocab_size})", outside[0])
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {total} tokens ({num_prompt_tokens} in the prompt, "
                f"{params.max_tokens} for the completion). Please reduce the prompt or max_tokens.")
        if self.bm.blocks_needed(total) > self.bm.num_blocks:
            raise RequestRejected(
                f"the request needs {self.bm.blocks_needed(total)} KV blocks ({total} tokens) but "
                f"the KV pool has only {self.bm.num_blocks}; raise --num-kv-blocks or "
                f"--kv-cache-memory")

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
        self.requests[request_id] = self._state(seq)
        try:
            wants = kv_params is not None and self.connector.wants_remote_kv(seq, kv_params)
        except BaseException:
            del self.requests[request_id]  # never queued: nothing else to undo
            raise
        if params.n > 1:
            self.choices.open(seq, params)
        if wants:
            self.scheduler.park_for_remote_kv(seq)
            try:
                self.connector.start_pull(seq)
            except Exception:
                log.exception("starting the KV pull for %s failed; computing it", request_id)
                self.num_connector_errors += 1
                self.connector.on_abort(seq)
                seq.stats.pull_outcome = "failed"
                self.scheduler.resume(seq)
        else:
            self.scheduler.add(seq)
            self._start_choices(seq)  # nothing to share, or a decode-local prefix adopted
        return seq

    def _state(self, seq: Sequence) -> _ReqState:
        return _ReqState(seq, IncrementalDetokenizer(self.tokenizer), make_generator(seq.params))

    def _start_choices(self, seq: Sequence) -> None:
        """Start the choices held back for `seq` (a choice 0) once the prompt blocks they share
        are computed: each takes them by reference and computes the rest (engine/parallel.py)."""
        children, blocks, shared = self.choices.ready(seq)
        for child in children:
            self.requests[child.request_id] = self._state(child)
            if shared:
                self.scheduler.adopt_prefix(child, blocks, shared)
                child.stats.shared_tokens = shared
            self.scheduler.add(child)

    def abort(self, request_id: str) -> None:
        """End a request (every choice of it) without an answer."""
        for rid in self.choices.close(request_id) or [request_id]:
            st = self.requests.pop(rid, None)
            if st is not None and not st.seq.is_finished:
                self._connector_abort(st.seq)
                self.scheduler.finish(st.seq, "abort")

    def _connector_abort(self, seq: Sequence) -> None:
        try:
            self.connector.on_abort(seq)
        except Exception:
            self.num_connector_errors += 1
            log.exception("the connector's abort failed for %s", seq.request_id)

    def fail_request(self, request_id: str, message: str) -> RequestOutput | None:
        """End a request with finish_reason "error" (e.g. a KV load failed under policy fail)."""
        st = self.requests.pop(request_id, None)
        if st is None:
            return None
        seq = st.seq
        seq.error = message
        self.scheduler.finish(seq, "error")
        if seq.output_id in self.choices.groups:  # one choice failed: so did its request
            self.abort(seq.output_id)
        return RequestOutput(seq.output_id, seq.prompt_token_ids, list(seq.output_token_ids),
                             st.text, [], "", True, "error", seq.stats, None, message,
                             index=seq.index)

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
        sampling = [item for item in batch if item.samples]
        if len(batch) == 1 and batch[0].seq.in_prefill:  # one chunk alone: a cost sample
            self.cost_model.add(Sample(batch[0].num_new_tokens, batch[0].start, dt_ms),
                                real=not self._calibrating)
        for item in batch:
            seq = item.seq
            if seq.in_prefill:
                seq.stats.prefill_ms += dt_ms
                seq.stats.computed_tokens += min(item.num_new_tokens,
                                                 seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += item.num_new_tokens
            self.bm.cache_blocks(seq)
            self._start_choices(seq)  # before seq can finish and drop its references
        if logits is not None:
            for i, item in enumerate(sampling):
                st = self.requests.get(item.seq.request_id)
                if st is None:  # a sibling choice's failure ended this request meanwhile
                    continue
                try:
                    p = st.seq.params
                    row = logits[i]
                    process_row(row, p, self.banned_tokens(st.seq), st.seq.prompt_token_ids,
                                st.seq.output_token_ids)
                    tok = sample_row(row, p, st.generator)
                except Exception as e:
                    outputs.append(self._fail(st, f"sampling failed: {e}"))
                    continue
                try:
                    outputs.append(self._append_token(st, tok))
                except Exception as e:
                    outputs.append(self._fail(st, f"processing the sampled token failed: {e!r}"))
        return outputs

    def _fail(self, st: _ReqState, message: str) -> RequestOutput:
        """End one request with finish_reason "error"; the others are not touched."""
        log.error("request %s failed: %s", st.seq.request_id, message)
        self.num_failed_requests += 1
        if not st.seq.is_finished:
            self._connector_abort(st.seq)
        out = self.fail_request(st.seq.request_id, message)
        assert out is not None
        return out

    def _fail_step(self, batch: list, exc: Exception) -> list[RequestOutput]:
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

    # remote KV: the connector's events
    def _poll_connector(self) -> list[RequestOutput]:
        try:
            events = self.connector.poll()
        except Exception:
            self.num_connector_errors += 1
            log.exception("the connector's poll failed")
            return []
        outputs = []
        for ev in events:
            st = self.requests.get(ev.request_id)
            if st is None or ev.request_id not in self.scheduler.parked:
                continue  # aborted meanwhile
            try:
                out = self._apply_kv_event(st, ev)
            except Exception as e:
                out = self._fail(st, f"applying remote KV failed: {e!r}")
            if out is not None:
                outputs.append(out)
        return outputs

    def _apply_kv_event(self, st: _ReqState, ev: ConnectorEvent) -> RequestOutput | None:
        seq = st.seq
        if isinstance(ev, LoadFailed):
            seq.stats.pull_outcome = ev.reason
            self._connector_abort(seq)
            return self.fail_request(seq.request_id, ev.message)
        if isinstance(ev, PullDeclined):
            seq.stats.pull_outcome = ev.reason
            self.scheduler.resume(seq)
            return None
        seq.stats.pulled_tokens += ev.pulled_tokens
        seq.stats.transfer_bytes += ev.transfer_bytes
        seq.stats.transfer_ms += ev.transfer_ms
        seq.stats.pull_outcome = "pulled"
        self.scheduler.resume(seq, ev.num_computed_tokens)
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

    def banned_tokens(self, seq: Sequence) -> list[int]:
        """Tokens the sampler may not pick next: stop and eos tokens before min_tokens."""
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            return []
        return list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.tokenizer.eos_token_ids))

    def _append_token(self, st: _ReqState, tok: int) -> RequestOutput:
        seq, p = st.seq, st.seq.params
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.output_token_ids.append(tok)
        st.text += st.detok.push([tok])
        n_out = seq.num_output_tokens
        reason, stop_reason = None, None
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok in self.tokenizer.eos_token_ids:
                reason = "stop"
            elif tok in p.stop_token_ids:
                reason, stop_reason = "stop", tok
            elif p.stop:
                found = self._find_stop(st.text, p.stop)
                if found is not None:
                    cut, stop_reason = found
                    st.text, reason = st.text[:cut], "stop"
        if reason is None and (n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        kv_params = None
        if reason is not None:
            try:
                kv_params = self.connector.on_finish(seq, reason)
            except Exception:  # the answer is still good; only its KV is not kept
                self.num_connector_errors += 1
                log.exception("the connector's finish failed for %s", seq.request_id)
            self.scheduler.finish(seq, reason)
            del self.requests[seq.request_id]
            self.choices.finished(seq)
            visible = len(st.text)
        else:
            hold = max((len(s) for s in p.stop), default=1) - 1
            visible = max(st.emitted_chars, len(st.text) - hold)
        new_text = st.text[st.emitted_chars : visible]
        st.emitted_chars = visible
        new_ids = seq.output_token_ids[st.sent_tokens :]
        st.sent_tokens = n_out
        return RequestOutput(seq.output_id, seq.prompt_token_ids, list(seq.output_token_ids),
                             st.text[:visible], new_ids, new_text, reason is not None, reason,
                             seq.stats, kv_params, stop_reason=stop_reason, index=seq.index)

    @staticmethod
    def _find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
        """(where the earliest stop string starts, that string), or None."""
        found = [(i, s) for s in stops if (i := text.find(s)) >= 0]
        return min(found, key=lambda f: f[0]) if found else None

    def calibrate(self, budget_s: float = 2.0) -> None:
        """Fit the prefill cost model on this model and machine (engine/cost_model.py): random
        prompts of growing length, prefilled in chunks (each chunk a sample at a known context)
        with the prefix cache off, until the next prompt would pass `budget_s`. Only before
        any request (the engine thread must not run yet)."""
        assert not self.has_unfinished(), "calibrate before serving"
        import random

        rng = random.Random(0)
        bm, sched = self.bm, self.scheduler
        saved = bm.enable_prefix_caching, sched.budget
        cap = min(self.max_model_len - 1, (bm.num_blocks - 1) * bm.block_size)
        plan = [(16, 16), (64, 64), (256, 128), (512, 256), (1024, 512), (2048, 512),
                (4096, 1024), (8192, 2048)]
        t0 = time.perf_counter()
        self._calibrating = True
        bm.enable_prefix_caching = False
        try:
            for i, (length, chunk) in enumerate(plan):
                length = min(length, cap)
                predicted = self.cost_model.predict_ms(length, 0) or 0.0
                if i > 1 and (time.perf_counter() - t0) * 1e3 + predicted > budget_s * 1e3:
                    break
                sched.budget = min(chunk, saved[1])
                ids = [rng.randrange(self.model_config.vocab_size) for _ in range(length)]
                self.add_request(ids, SamplingParams(max_tokens=1, temperature=0),
                                 f"calibration-{i}")
                while self.has_unfinished():
                    self.step()
                if i == 0:  # the first forward pass pays one-off costs: not a sample
                    self.cost_model = PrefillCostModel()
                if length == cap:
                    break
        finally:
            bm.enable_prefix_caching, sched.budget = saved
            self._calibrating = False
        self.cost_model.fit()
        self.cost_model.calibration_ms = (time.perf_counter() - t0) * 1e3
        log.info("prefill cost model calibrated in %.0f ms: %s",
                 self.cost_model.calibration_ms, self.cost_model.as_dict()["predict_ms"])

    def check_integrity(self) -> None:
        """Pool invariants, and every block reference accounted for (sequences + pins)."""
        refs = self.scheduler.refs_held()
        for bid, n in self.connector.extra_refs().items():
            refs[bid] = refs.get(bid, 0) + n
        self.bm.check_integrity(refs)
