"""The reuse ratio that matters: P's time to first token for the next turn of a conversation
whose history is already on D, three ways, measured in one run on the `bench` model:

    pull      P has nothing local; it verifies and READs the history's KV from D, computes the rest
    local     P's own prefix cache already holds the history (the ideal)
    recompute P computes the whole prompt

History 2k/8k/16k tokens plus a 256-token new user turn. Targets: pull within 1.1x of local at
16k, and at least 10x faster than recompute at 16k.

    .venv/bin/python duplexkv bench reuse [--lengths 2048 8192 16384] [--connector TcpConnector]
        [--secret [--auth-only]]

`--secret` also starts a P and a D sharing a fresh cluster secret (signed params, CURVE side
channel, authenticated HELLO) and reports, in the same run, their pull (verify + READ) next to
the one without a secret: what authentication costs. Each pull is split into its two phases from
P's own counters: verify (params check, side-channel verify and claim) and READ (the transport).
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from duplexkv.engine.dtype import describe as describe_dtype
from duplexkv.flags import Accumulate
from duplexkv.launch import bidirectional_kv, spawn, wait_ready, worker_args
from duplexkv.wire.kv_params import miss_params, replay_params

MISS = miss_params()
NEW_TURN = 256  # default of --new-tokens


def p_leg(client: httpx.Client, url: str, prompt: list[int], params: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = client.post(url + "/v1/completions", json={
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": params})
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return dt, r.json()


def d_turn(client: httpx.Client, p_url: str, d_url: str, prompt: list[int],
           answer: int) -> tuple[dict, list[int]]:
    """Put a finished turn on D: P computes `prompt`, D reads it and generates `answer` tokens."""
    _, pj = p_leg(client, p_url, prompt, MISS)
    r = client.post(d_url + "/v1/completions", json={
        "prompt": prompt, "max_tokens": answer, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": pj["kv_transfer_params"], "return_token_ids": True})
    r.raise_for_status()
    j = r.json()
    return j["kv_transfer_params"], j


def phases(client: httpx.Client, url: str) -> tuple[float, float]:
    """P's cumulative (verify ms, READ ms) over its pulls."""
    c = client.get(url + "/health").json()["kv_transfer"]["counters"]
    return c.get("verify_ms", 0.0), c.get("read_ms", 0.0)


def timed_pull(client: httpx.Client, url: str, prompt: list[int],
               params: dict) -> tuple[float, dict, float, float]:
    """A P leg that pulls: (seconds, response, verify ms, READ ms)."""
    v0, r0 = phases(client, url)
    dt, pj = p_leg(client, url, prompt, params)
    v1, r1 = phases(client, url)
    return dt, pj, v1 - v0, r1 - r0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--lengths", type=int, nargs="+", action=Accumulate,
                    default=[2048, 8192, 16384])
    ap.add_argument("--connector", default="TcpConnector", choices=["TcpConnector",
                                                                    "NixlConnector"])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=NEW_TURN, help="tokens of the new turn")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--secret", action="store_true",
                    help="also measure a P and D with a cluster secret (authentication's cost)")
    ap.add_argument("--auth-only", action="store_true",
                    help="with --secret: measure only the two pulls (skip local and recompute)")
    args = ap.parse_args(argv)
    if args.auth_only and not args.secret:
        ap.error("--auth-only compares the pulls with and without --secret: add --secret")
    max_len = max(args.lengths) + args.new_tokens + 64
    common = ["--max-model-len", str(max(max_len, 4096)), "--kv-cache-memory", "1.0"]
    kv = bidirectional_kv(args.connector, insecure_kv=True)  # the baseline has no secret
    logs = Path(tempfile.mkdtemp(prefix="duplexkv-reuse-"))
    plain = {"DUPLEXKV_KV_SECRET": ""}  # the baseline runs without a secret, whatever is set
    procs = [
        spawn("p", worker_args(args.model, kv, *common, "--no-enable-prefix-caching"), logs,
              plain),
        spawn("p_local", worker_args(args.model, kv, *common), logs, plain),
        spawn("d", worker_args(args.model, kv, *common), logs, plain),
    ]
    if args.secret:
        env = {"DUPLEXKV_KV_SECRET": secrets.token_hex(32)}
        procs += [spawn("p_secret", worker_args(args.model, kv, *common,
                                                "--no-enable-prefix-caching"), logs, env),
                  spawn("d_secret", worker_args(args.model, kv, *common), logs, env)]
    try:
        wait_ready(procs)
        p, p_local, d = (x.url for x in procs[:3])
        client = httpx.Client(timeout=600)
        print(f"workers up (logs in {logs}); connector {args.connector}; "
              f"{describe_dtype(None)}")
        rows = []
        vocab = 4000  # ids valid for every preset (tiny has 4096)
        for n, hist in enumerate(args.lengths):
            res = {"pull": [], "local": [], "recompute": [], "pulled_tokens": [],
                   "transfer_ms": [], "verify_ms": [], "read_ms": []}
            if args.secret:
                res.update(pull_secret=[], transfer_ms_secret=[], verify_ms_secret=[],
                           read_ms_secret=[], pulled_tokens_secret=[])
            for rep in range(args.reps + 1):  # rep 0 warms up (handshakes, allocations)
                base = [(7919 * (i + 1000 * rep + 97 * n)) % (vocab - 10) + 5
                        for i in range(hist - 64)]
                d_params, dj = d_turn(client, p, d, base, 65)
                history = base + dj["choices"][0]["token_ids"]
                new_turn = [(31 * i + rep) % (vocab - 10) + 5 for i in range(args.new_tokens)]
                prompt = history + new_turn
                pulls = {"plain": lambda: timed_pull(client, p, prompt, replay_params(d_params))}
                if args.secret:
                    ps, ds = procs[3].url, procs[4].url
                    sd_params, sdj = d_turn(client, ps, ds, base, 65)
                    # D's answer can differ by a few tokens between two processes (bf16): pull
                    # the secret D's own history, which has the same length
                    sprompt = base + sdj["choices"][0]["token_ids"] + new_turn
                    pulls["secret"] = lambda: timed_pull(client, ps, sprompt,
                                                         replay_params(sd_params))
                # the pulls run back to back, in alternating order, so that both see the same
                # machine (the P prefills of the D turns above take the longest)
                got = {k: pulls[k]() for k in (sorted(pulls, reverse=bool(rep % 2)))}
                pull_s, pj, verify_ms, read_ms = got["plain"]
                if args.secret:
                    spull_s, spj, sverify_ms, sread_ms = got["secret"]
                    assert spj["kv_stats"]["pulled_tokens"] > 0, spj["kv_stats"]
                if args.auth_only:
                    local_s = rec_s = float("nan")
                else:
                    p_leg(client, p_local, history + [5], MISS)  # warm P's own cache
                    local_s, lj = p_leg(client, p_local, prompt, MISS)
                    rec_s, rj = p_leg(client, p, prompt, MISS)
                if rep == 0:
                    continue
                if args.secret:
                    res["pull_secret"].append(spull_s)
                    res["transfer_ms_secret"].append(spj["kv_stats"]["transfer_ms"])
                    res["verify_ms_secret"].append(sverify_ms)
                    res["read_ms_secret"].append(sread_ms)
                    res["pulled_tokens_secret"].append(spj["kv_stats"]["pulled_tokens"])
                res["pull"].append(pull_s)
                res["local"].append(local_s)
                res["recompute"].append(rec_s)
                res["pulled_tokens"].append(pj["kv_stats"]["pulled_tokens"])
                res["transfer_ms"].append(pj["kv_stats"]["transfer_ms"])
                res["verify_ms"].append(verify_ms)
                res["read_ms"].append(read_ms)
            med = {k: statistics.median(v) for k, v in res.items()}
            row = {"history": hist, "prompt": len(prompt), **med,
                   "pull_vs_local": med["pull"] / med["local"],
                   "recompute_vs_pull": med["recompute"] / med["pull"]}
            if args.secret:
                row["auth_overhead"] = med["transfer_ms_secret"] / med["transfer_ms"] - 1
                row["auth_overhead_min"] = (min(res["transfer_ms_secret"])
                                            / min(res["transfer_ms"]) - 1)
            row["reps"] = res
            rows.append(row)
            print(f"history {hist:6d}: pull {med['pull'] * 1e3:8.1f} ms "
                  f"(pulled {med['pulled_tokens']:.0f} tok, transfer {med['transfer_ms']:.1f} ms)"
                  f"  local {med['local'] * 1e3:8.1f} ms  recompute {med['recompute'] * 1e3:8.1f}"
                  f" ms  pull/local {row['pull_vs_local']:.2f}x  recompute/pull "
                  f"{row['recompute_vs_pull']:.1f}x", flush=True)
            print(f"  pull phases: verify {med['verify_ms']:.1f} ms, READ {med['read_ms']:.1f} ms",
                  flush=True)
            if args.secret:
                print(f"  with a cluster secret: pull {med['pull_secret'] * 1e3:8.1f} ms, "
                      f"verify + READ {med['transfer_ms_secret']:.1f} ms vs "
                      f"{med['transfer_ms']:.1f} ms without ({row['auth_overhead']:+.1%}); "
                      f"verify {med['verify_ms_secret']:.1f} vs {med['verify_ms']:.1f} ms, "
                      f"READ {med['read_ms_secret']:.1f} vs {med['read_ms']:.1f} ms; pulled "
                      f"{med['pulled_tokens_secret']:.0f} vs {med['pulled_tokens']:.0f} tokens; "
                      f"fastest {min(res['transfer_ms_secret']):.1f} vs "
                      f"{min(res['transfer_ms']):.1f} ms ({row['auth_overhead_min']:+.1%}); each "
                      f"rep: {res['transfer_ms_secret']} vs {res['transfer_ms']}", flush=True)
        for name, url in [("d", d)] + ([("d_secret", procs[4].url)] if args.secret else []):
            t = client.get(url + "/health").json()["kv_transfer"]["transport"]
            if "grants_issued" in t:  # NIXL: each claim registers, then deregisters, its blocks
                print(f"{name}: {t['grants_issued']} claims exposed, register + deregister "
                      f"{t['grant_ms_per_claim']:.3f} ms per claim")
        print("\n| history | pull from D | local hit (ideal) | recompute | pull / local | "
              "recompute / pull | pulled tokens | transfer |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['history']} | {r['pull'] * 1e3:.0f} ms | {r['local'] * 1e3:.0f} ms | "
                  f"{r['recompute'] * 1e3:.0f} ms | {r['pull_vs_local']:.2f}x | "
                  f"{r['recompute_vs_pull']:.1f}x | {r['pulled_tokens']:.0f} | "
                  f"{r['transfer_ms']:.1f} ms |")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    finally:
        for x in procs:
            x.stop()


if __name__ == "__main__":
    main()
