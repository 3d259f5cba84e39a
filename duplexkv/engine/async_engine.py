"""The engine on its own thread, with an asyncio front for the HTTP server.

One thread runs the step loop; request coroutines talk to it through a command queue and get
their outputs back on per-request asyncio queues. While requests wait for remote KV the loop
wakes at the connector's `poll_timeout` so that each step can poll it.

The loop also publishes the engine's snapshot (`last_snapshot`, at most every PUBLISH_S, after a
step) and when the running step began (`step_started`), so that /health can answer while a long
step runs instead of waiting for it (a probe would take a loaded worker for a hung one).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from duplexkv.wire.kv_params import KVTransferParams
from duplexkv.engine.llm_engine import LLMEngine, RequestOutput
from duplexkv.engine.memory import HeapTrimmer, tune_heap
from duplexkv.engine.state import EngineSnapshot
from duplexkv.wire.sampling import SamplingParams

log = logging.getLogger(__name__)
PUBLISH_S = 0.1  # the published snapshot is at most this much older than the last step


class EngineDeadError(RuntimeError):
    pass


class RequestFailed(RuntimeError):
    """The engine ended the request with an error (e.g. a KV load under policy "fail")."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    kv_params: KVTransferParams | None


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    fn: Callable[[], object]
    done: "asyncio.Future | None"
    loop: asyncio.AbstractEventLoop | None


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, item in items:
        q.put_nowait(item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._stop = threading.Event()
        self.dead: str | None = None
        # called (on the engine thread) once the engine has died and every client was told;
        # the server uses it to exit non-zero so that a supervisor restarts the worker
        self.on_dead: Callable[[str], None] | None = None
        tune_heap()  # the process's heap keeps what a step frees until the trimmer returns it
        self.trimmer = HeapTrimmer()
        self.last_snapshot: EngineSnapshot | None = None  # published by the engine thread
        self.snapshot_at = 0.0  # time.monotonic() of last_snapshot
        self.step_started = 0.0  # time.monotonic() when the running step began; 0: none runs

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._cmds.put(None)
        self._thread.join(timeout=10)

    # front (event loop side)
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       kv_params: KVTransferParams | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream outputs (n > 1: every choice's, each with its `index`, interleaved) until
        every choice has finished; `kv_params` go to the engine's connector with the request."""
        if self.dead:
            raise EngineDeadError(self.dead)
        self.engine.check_request(len(prompt_ids), params)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        if self.dead:  # died between the check above and registering the stream
            self._streams.pop(request_id, None)
            raise EngineDeadError(self.dead)
        self._cmds.put(_Add(request_id, prompt_ids, params, kv_params))
        finished, unfinished = False, params.n
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason == "error":  # the engine ended every choice
                    finished = True
                    raise RequestFailed(item.error or "request failed")
                unfinished -= item.finished
                finished = unfinished == 0
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._cmds.put(_Abort(request_id))

    async def call(self, fn: Callable[[], object]) -> object:
        """Run `fn` on the engine thread (to read or change engine state safely)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._cmds.put(_Call(fn, fut, loop))
        return await fut

    def call_soon(self, fn: Callable[[], object]) -> None:
        self._cmds.put(_Call(fn, None, None))

    def num_streams(self) -> int:
        """Requests whose outputs are being delivered (read without a lock, for /debug/memory)."""
        return len(self._streams)

    def abort(self, request_id: str) -> None:
        self._cmds.put(_Abort(request_id))

    # engine thread
    def _deliver(self, request_id: str, item) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _deliver_step(self, outs: list[RequestOutput]) -> None:
        """A step's outputs, one wake-up of each event loop for all of them: a wake-up (a write
        to the loop's self-pipe) cost ~30 us on the engine thread (AMD EPYC VM, 8 streams), once
        per stream and step before. Each stream's outputs keep their order."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outs:
            entry = self._streams.get(out.request_id)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _handle(self, cmd) -> None:
        if isinstance(cmd, _Add):
            try:
                self.engine.add_request(cmd.prompt_ids, cmd.params, cmd.request_id,
                                        cmd.kv_params)
            except Exception as e:  # rejected: tell the caller
                if not isinstance(e, ValueError):
                    log.exception("adding %s failed", cmd.request_id)
                self._deliver(cmd.request_id, e)
        elif isinstance(cmd, _Abort):
            self.engine.abort(cmd.request_id)
        elif isinstance(cmd, _Call):
            try:
                res, exc = cmd.fn(), None
            except Exception as e:
                res, exc = None, e
            if cmd.done is not None:
                fut = cmd.done
                cmd.loop.call_soon_threadsafe(
                    lambda: fut.done() or (fut.set_exception(exc) if exc else fut.set_result(res)))

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    timeout = self.engine.connector.poll_timeout()
                    if self.engine.has_work():
                        cmd = self._cmds.get_nowait()
                    elif timeout is not None:
                        cmd = self._cmds.get(timeout=timeout)
                    else:
                        cmd = self._cmds.get()
                    while cmd is not None or not self._cmds.empty():
                        if cmd is not None:
                            self._handle(cmd)
                        cmd = self._cmds.get_nowait()
                except queue.Empty:
                    pass
                self.step_started = time.monotonic()
                self._deliver_step(self.engine.step())
                now = time.monotonic()
                self.step_started = 0.0
                if now - self.snapshot_at > PUBLISH_S:
                    self.last_snapshot, self.snapshot_at = self.engine.snapshot(), now
                self.trimmer.tick(idle=not self.engine.has_unfinished())
        except BaseException as e:  # unrecoverable (EngineFatal or a bug): fail everyone, loudly
            log.exception("engine thread died")
            self.dead = f"engine failed: {e!r}"
            answered = set()
            for out in getattr(e, "outputs", []):  # the failed step's own errors first
                self._deliver(out.request_id, out)
                answered.add(out.request_id)
            for rid in list(self._streams):
                if rid not in answered:
                    self._deliver(rid, EngineDeadError(self.dead))
            if self.on_dead is not None:
                try:
                    self.on_dead(self.dead)
                except Exception:
                    log.exception("on_dead callback failed")
