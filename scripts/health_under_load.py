"""The liveness defaults under load (docs/operations.md, "What the workers report"): router + P + D
of a preset, every option at its default; N concurrent 4-turn conversations of 500-word turns,
streamed, 32 tokens an answer, for S seconds. Counts failed turns and workers marked down or
suspect; polls P's and D's /health every 100 ms beside the load (latency, reported load) and
computes the probe timeout the router derives from each report (router/liveness.py); a /health
slower than that would be a false positive of the probe.

    PYTHONPATH=. python scripts/health_under_load.py bench 16 90 [float32]

Uses the test suite's launch helpers (tests/workers.py, tests/test_router.py).
"""
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import httpx  # noqa: E402
from duplexkv.model.synth import make_model
from duplexkv.router.backends import Backend
from duplexkv.router.liveness import Liveness
from duplexkv.router.worker_load import from_health
from test_router import bidi, start_router
from workers import start_worker, stopping

preset, n, secs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
dtype = sys.argv[4] if len(sys.argv) > 4 else "float32"
tmp = Path(tempfile.mkdtemp(prefix="i30load-"))
model = make_model(tmp / preset, preset, seed=0)
p = start_worker(model, tmp / "p.log", "--no-enable-prefix-caching", kv=bidi(), dtype=dtype,
                 timeout_s=600)
d = start_worker(model, tmp / "d.log", kv=bidi(), dtype=dtype, timeout_s=600)
name = model.name
with stopping(p, d):
    r = start_router(tmp / "router.log", [p.url], [d.url], placement=None, defaults=True)
    with stopping(r):
        stop = time.monotonic() + secs
        ok, failed, errors, too_long = [0], [0], [], [0]
        lock = threading.Lock()
        samples = {"p": [], "d": []}

        def poll(w, key):
            live = Liveness(None)
            while time.monotonic() < stop:
                t = time.perf_counter()
                try:
                    body = httpx.get(w.url + "/health", timeout=30).json()
                    rtt = time.perf_counter() - t
                    b = Backend(w.url, "prefill")
                    load = from_health(body)
                    if load is not None:
                        b.load = load
                    # the router's rtt term too: 4x the slowest /health of the last ~30 s
                    now = time.monotonic()
                    recent = [s[0] for s in samples[key] if s[6] > now - 30]
                    full = min(max(live.timeout(b), 4 * max(recent, default=0.0)), 10.0)
                    samples[key].append((rtt, body.get("waiting"), body.get("running"),
                                         body.get("expected_ttft_ms"),
                                         body.get("expected_step_ms"), live.timeout(b), now,
                                         full))
                except Exception:
                    samples[key].append((time.perf_counter() - t, None, None, None, None, None,
                                         time.monotonic(), None))
                time.sleep(0.1)

        def conversation(i):
            c = httpx.Client(timeout=600)
            while time.monotonic() < stop:
                conv = f"c-{uuid.uuid4().hex[:8]}"
                msgs = [{"role": "system", "content": "Be brief."}]
                for t in range(4):
                    if time.monotonic() >= stop:
                        break
                    msgs.append({"role": "user", "content": f"turn {t} of {i}: " +
                                 " ".join(f"w{(i * 7 + t * 13 + k) % 997}" for k in range(500))})
                    body = {"model": name, "messages": msgs, "max_tokens": 32, "stream": True,
                            "temperature": 0, "conversation_id": conv}
                    text, err = [], None
                    try:
                        with c.stream("POST", r.url + "/v1/chat/completions", json=body) as resp:
                            if resp.status_code == 400:  # the history outgrew the model
                                resp.read()
                                with lock:
                                    too_long[0] += 1
                                break
                            if resp.status_code != 200:
                                err = f"HTTP {resp.status_code}: {resp.read()[:200]!r}"
                            else:
                                for line in resp.iter_lines():
                                    if line.startswith("data: ") and line != "data: [DONE]":
                                        obj = json.loads(line[6:])
                                        if "error" in obj:
                                            err = str(obj)[:200]
                                        for ch in obj.get("choices") or []:
                                            delta = ch.get("delta") or {}
                                            text.append(delta.get("content") or "")
                    except Exception as e:
                        err = repr(e)[:200]
                    with lock:
                        if err:
                            failed[0] += 1
                            errors.append(err)
                        else:
                            ok[0] += 1
                    msgs.append({"role": "assistant", "content": "".join(text)})

        ths = [threading.Thread(target=poll, args=(w, k)) for w, k in ((p, "p"), (d, "d"))]
        ths += [threading.Thread(target=conversation, args=(i,)) for i in range(n)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        h = httpx.get(r.url + "/health", timeout=30).json()
        log = (tmp / "router.log").read_text()
        print(f"preset={preset} dtype={dtype} conversations={n} seconds={secs}")
        print(f"turns ok={ok[0]} failed={failed[0]} errors={errors[:3]} "
              f"(conversations ended by a 400 as longer than the model: {too_long[0]})")
        print("router log: marked down", log.count(" is down:"), "suspect", log.count("is suspect"))
        for role in ("prefill", "decode"):
            for w in h[role]:
                keys = ("healthy", "suspect", "errors", "reported_load")
                print(role, {k: w.get(k) for k in keys})
        for key, ss in samples.items():
            rtts = sorted(s[0] for s in ss)
            tos = [s[5] for s in ss if s[5] is not None]
            ttft = [s[3] for s in ss if s[3] is not None]
            step = [s[4] for s in ss if s[4] is not None]
            q = [(s[1] or 0) + (s[2] or 0) for s in ss if s[1] is not None]
            print(f"{key}: /health n={len(rtts)} p50={statistics.median(rtts):.3f} "
                  f"p99={rtts[int(len(rtts) * 0.99) - 1]:.3f} max={rtts[-1]:.3f} s; "
                  f"reported queue max={max(q, default=None)} "
                  f"expected_ttft_ms max={max(ttft, default=None)} "
                  f"expected_step_ms max={max(step, default=None)}; "
                  f"probe timeout from the report: max={max(tos, default=None)} "
                  f"min={min(tos, default=None)}; "
                  f"/health slower than that timeout: "
                  f"{sum(1 for s in ss if s[5] is not None and s[0] > s[5])}; "
                  f"slower than the router's whole timeout (with its rtt term): "
                  f"{sum(1 for s in ss if s[7] is not None and s[0] > s[7])}")
        print("logs in", tmp)
