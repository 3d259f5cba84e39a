"""Workers report their load in /health (queue, and the cost model's expected time to first
token and longest step), vLLM workers in /metrics; the router's liveness probes wait longer for
a worker that reports load, whoever sent it (router/worker_load.py, router/liveness.py)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from duplexkv.router.backends import Backend
from duplexkv.router.liveness import PER_LEG_S, PROBE_TIMEOUT_S, Liveness
from duplexkv.router.worker_load import from_health, from_vllm_metrics
from workers import start_worker, stopping

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 5.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
"""


def test_vllm_queue_from_metrics():
    load = from_vllm_metrics(VLLM_METRICS)
    assert load is not None and (load.waiting, load.running) == (7, 3)
    assert load.expected_step_s == 0.0
    assert from_vllm_metrics("# nothing here\n") is None


def test_reports_that_do_not_parse_are_ignored():
    assert from_health({"status": "ok", "engine_busy": True}) is None
    assert from_health("ok") is None
    load = from_health({"waiting": float("inf"), "running": -3, "expected_ttft_ms": "x",
                        "expected_step_ms": float("nan")})
    assert load is not None and load.running == 0 and load.expected_step_s == 0.0
    assert load.waiting == 1 << 20


def test_a_loaded_worker_reports_its_queue_and_gets_a_longer_probe(tiny_model_dir, tmp_path):
    """24 long prompts sent straight to the worker (not through a router): its /health shows
    them queued with a predicted time to first token, and a probe of it would wait PER_LEG_S
    per request, though the router has no leg in flight to it. (Twelve copies of one 1.5k-token
    prompt, all but the first served from the prefix cache, drained in 0.3 s once bf16
    attention ran on AMX tiles, too fast for a poll on a busy machine to see the queue; 24
    distinct prompts of 3k tokens, more than the KV cache holds at once, keep it for ~2.5 s.)"""
    w = start_worker(tiny_model_dir, tmp_path / "w.log", "--num-kv-blocks", "512")
    with stopping(w):
        idle = w.health()
        assert idle["expected_ttft_ms"] == 0.0 and idle["expected_step_ms"] == 0.0, idle
        bodies = [{"model": w.name, "prompt": f"tool output {i}: " + "ok; " * 1000,
                   "max_tokens": 64, "temperature": 0, "ignore_eos": True} for i in range(24)]
        seen: list[dict] = []
        with ThreadPoolExecutor(24) as pool:
            futs = [pool.submit(w.post, "/v1/completions", body) for body in bodies]
            deadline = time.monotonic() + 60
            while not seen and time.monotonic() < deadline and not all(f.done() for f in futs):
                h = httpx.get(w.url + "/health", timeout=10).json()
                if h.get("waiting", 0) > 0 and (h.get("expected_ttft_ms") or 0) > 0:
                    seen.append(h)
                time.sleep(0.02)
            assert all(f.result().status_code == 200 for f in futs)
        assert seen, "the queue was never seen in /health"
        load = from_health(seen[0])
        assert load is not None and load.queued >= 2 and load.expected_ttft_s > 0, seen[0]
        assert load.expected_step_s > 0
        b = Backend(w.url, "prefill", "prefill[0]")
        b.load = load
        live = Liveness(httpx.AsyncClient())
        assert b.outstanding == 0
        assert live.timeout(b) >= min(PER_LEG_S * load.queued, 10.0) > PROBE_TIMEOUT_S


def test_health_answers_while_a_long_step_runs(tmp_path):
    """The bench preset prefilling 4,096-token chunks (its default budget) on this machine runs
    steps of seconds; /health answers meanwhile from the snapshot the engine published after a
    recent step (before, it waited for the step to end: a probe took the worker for hung)."""
    from duplexkv.model.synth import make_model

    model = make_model(tmp_path / "bench", "bench", seed=0)
    w = start_worker(model, tmp_path / "w.log", "--no-enable-prefix-caching", timeout_s=300)
    body = {"model": w.name, "prompt": " ".join(f"w{k % 997}" for k in range(3000)),
            "max_tokens": 1, "temperature": 0}
    took, busy = [], []
    pool = ThreadPoolExecutor(2)
    try:
        with stopping(w):  # the prompts are not waited for: stopping the worker ends them
            futs = [pool.submit(w.post, "/v1/completions", body) for _ in range(2)]
            deadline = time.monotonic() + 120
            while len(busy) < 5 and time.monotonic() < deadline \
                    and not all(f.done() for f in futs):
                t = time.perf_counter()
                h = httpx.get(w.url + "/health", timeout=30).json()
                took.append(time.perf_counter() - t)
                if h.get("engine_busy") and (h.get("step_running_s") or 0) > 0.5:
                    busy.append(h)
                time.sleep(0.05)
    finally:
        pool.shutdown(wait=True)
    print(f"/health while long steps ran: {len(took)} answers, max {max(took):.2f} s; "
          f"{len(busy)} during a step already 0.5 s long")
    assert busy, "no step ran longer than 0.5 s: nothing was shown"
    assert "waiting" in busy[-1] and busy[-1]["snapshot_age_s"] is not None
    assert max(took) < PROBE_TIMEOUT_S, f"/health took {max(took):.2f} s"


def test_a_cancelled_stream_read_leaves_no_task_reading_on():
    """A leg given up on while it waits for its stream's next event (the client gone, the worker
    marked down) cancels the read too: before, the read ran on alone and its end was logged as
    'Task exception was never retrieved ... StopAsyncIteration' (CI's vLLM interop run)."""
    import asyncio

    async def run() -> None:
        finished = asyncio.Event()
        cancelled = []

        async def events():
            try:
                await finished.wait()  # a worker with nothing to say yet
                yield "late"
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        live = Liveness(httpx.AsyncClient())
        b = Backend("http://127.0.0.1:9", "decode", "decode[0]")
        reader = asyncio.ensure_future(live.next(b, events()))
        await asyncio.sleep(0.05)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert cancelled == [True] and not others, others

    asyncio.run(run())
