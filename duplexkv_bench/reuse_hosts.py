"""Cross-host reuse: a turn's TTFT with and without pulling the history from D, P and D on hosts
of their own whose links are shaped (duplexkv_bench/hosts, needs root).

    duplexkv bench reuse_hosts [--rate 1gbit 10gbit] [--lengths 8192 16384] [--reps 2]
        [--connector TcpConnector|NixlConnector]

Three hosts: router, P (`--no-enable-prefix-caching`, as in the reference evaluation) and D, the
bench model in bf16, bidirectional KV transfer, started as on real machines (`--host`,
VLLM_NIXL_SIDE_CHANNEL_HOST, a cluster secret). P's and D's links are limited to `--rate` (tc tbf,
both directions), so every KV byte between them crosses the shaped link. For each history length:
turn 1 (history - 64 prompt tokens + a 64-token answer) puts the history on D; then two new
256-token turns on that history are streamed through the router and timed at the client to the
first token:

    off   no conversation id: classic P/D, P recomputes history + turn, D reads the turn from P
          (its own prefix cache already holds the history)
    on    the conversation's id: P verifies and READs the history from D, computes the turn

Different new turns for off and on, so that neither finds the other's tokens cached.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from duplexkv.flags import Accumulate

NEW_TURN, ANSWER = 256, 64
VOCAB = 4000


def stream_ttft(client: httpx.Client, url: str, prompt: list[int], conv: str | None,
                max_tokens: int = 4) -> tuple[float, dict]:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if conv:
        body["conversation_id"] = conv
    t0 = time.perf_counter()
    ttft, stats = None, {}
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if ttft is None and obj.get("choices") and obj["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
            stats = obj.get("kv_stats") or stats
    if ttft is None:
        raise RuntimeError("no token streamed")
    return ttft, stats


def first_turn(client: httpx.Client, url: str, prompt: list[int], conv: str) -> list[int]:
    r = client.post(url + "/v1/completions", json={
        "model": "bench", "prompt": prompt, "max_tokens": ANSWER, "temperature": 0,
        "ignore_eos": True, "conversation_id": conv, "return_token_ids": True})
    r.raise_for_status()
    return prompt + r.json()["choices"][0]["token_ids"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", nargs="+", action=Accumulate, default=["1gbit", "10gbit"])
    ap.add_argument("--lengths", type=int, nargs="+", action=Accumulate, default=[8192, 16384])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--connector", default="TcpConnector",
                    choices=["TcpConnector", "NixlConnector"])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    from duplexkv_bench.hosts.cluster import HostCluster
    from duplexkv_bench.hosts.netns import Network, can_build
    from duplexkv.model.registry import resolve_model

    ok, why = can_build()
    if not ok:
        raise SystemExit(f"reuse_hosts: {why}")
    model = str(resolve_model("bench"))
    common = ("--max-model-len", str(max(args.lengths) + NEW_TURN + 1024))
    logs = Path(tempfile.mkdtemp(prefix="duplexkv-reuse-hosts-"))
    rows = []
    with Network(["rt", "p", "d"]) as net:
        hc = HostCluster(net, model, logs, connector=args.connector, served_name="bench")
        p = hc.worker("p", "prefill", *common, "--no-enable-prefix-caching")
        d = hc.worker("d", "decode", *common)
        hc.ready([p, d], timeout_s=600)
        r = hc.router("rt", "router", [p], [d], "--placement", "prefill")  # P reads across
        hc.ready([r])
        print(f"hosts up (logs in {logs}); {args.connector}, bench model, bf16", flush=True)
        client = httpx.Client(timeout=600)
        for rate in args.rate:
            for h in ("p", "d"):
                net.shape(h, rate)
            for n, hist in enumerate(args.lengths):
                res: dict[str, list] = {"off": [], "on": [], "pulled": [], "transfer_ms": [],
                                        "d_pulled_off": []}
                for rep in range(args.reps + 1):  # rep 0 warms up
                    seed = 1000 * rep + 97 * n + 7 * len(rows)
                    base = [(7919 * (i + seed)) % (VOCAB - 10) + 5 for i in range(hist - ANSWER)]
                    conv = f"b-{uuid.uuid4().hex[:8]}"
                    history = first_turn(client, r.url, base, conv)
                    tails = [[(31 * i + 13 * k + seed) % (VOCAB - 10) + 5
                              for i in range(NEW_TURN)] for k in (1, 2)]
                    off_s, off_stats = stream_ttft(client, r.url, history + tails[0], None)
                    on_s, on_stats = stream_ttft(client, r.url, history + tails[1], conv)
                    if rep == 0:
                        continue
                    res["off"].append(off_s)
                    res["on"].append(on_s)
                    res["pulled"].append(on_stats["prefill"]["pulled_tokens"])
                    res["transfer_ms"].append(on_stats["prefill"]["transfer_ms"])
                    res["d_pulled_off"].append(off_stats["decode"]["pulled_tokens"])
                med = {k: statistics.median(v) for k, v in res.items()}
                row = {"rate": rate, "history": hist, **med, "speedup": med["off"] / med["on"]}
                rows.append(row)
                print(f"{rate:>7} history {hist:6d}: TTFT off {med['off'] * 1e3:8.0f} ms, on "
                      f"{med['on'] * 1e3:7.0f} ms ({row['speedup']:.1f}x); P pulled "
                      f"{med['pulled']:.0f} tokens, verify + READ {med['transfer_ms']:.0f} ms",
                      flush=True)
    print(f"\n| P-D link | history (+{NEW_TURN} new) | TTFT reuse off | TTFT reuse on | off / on "
          f"| history pulled by P | verify + READ |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['rate']} | {row['history']} | {row['off'] * 1e3:,.0f} ms | "
              f"{row['on'] * 1e3:,.0f} ms | {row['speedup']:.1f}x | {row['pulled']:.0f} | "
              f"{row['transfer_ms']:.0f} ms |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
