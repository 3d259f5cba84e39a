"""vLLM workers, multi-turn TTFT through three front-ends in one interleaved run.

    duplexkv bench vllm_multiturn [--proxy PATH/disagg_proxy_multiturn.py] [--model bench]
        [--max-context 8192] [--conversations 2] [--answer-tokens 32 64] [--no-plugin]
        [--bind none|cores] [--engine inproc|mp] [--json FILE]

vLLM P (no prefix cache) and D, unpinned (`--bind cores`: P on core 0, D on core 1), each engine
in its server's process (`--engine mp`: vLLM's default processes, whose polling starved 2 cores:
docs/vllm.md), NixlConnector with `bidirectional_kv_xfer`, float32 (greedy answers compare
exactly), duplexkv's vLLM plugin (`--no-plugin`: stock 0.32, whose streams carry no params). Then
a single vLLM server answers every recorded turn as the oracle. The front-ends, in turn on every turn (order rotating per turn):

    off      our router, no conversation id: one-way P/D, P computes every whole prompt
    proxy    vLLM's own disagg_proxy_multiturn.py from the path given (not shipped here), with
             `conversation_id` in the body as it requires
    on       our router with `conversation_id`: verified bidirectional reuse

Agentic conversations (workload.py), each front-end its own text of the same shape; turns
streamed and timed on the client; P's D->P reads per turn from vLLM's
`vllm:nixl_xfer_time_seconds_count`. The table: per prompt-length bucket, median TTFT per front-end
and its ratio to `off`, turns where P read D's KV, answers equal (docs/results/vllm-multiturn.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from duplexkv.flags import Accumulate
from duplexkv.launch import LaunchError, free_port, router_args, spawn, start, wait_ready
from duplexkv.model.registry import resolve_model
from duplexkv_bench import vllm_venv
from duplexkv_bench.client import RequestFailed, Result, Target, chat_turn
from duplexkv_bench.machine_limits import cpu_line, loadavg
from duplexkv_bench.workload import DEFAULT_SIZES, TextSource, materialise, plan

KV = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
      "kv_connector_extra_config": {"bidirectional_kv_xfer": True}}
READS = "vllm:nixl_xfer_time_seconds_count"
BUCKETS = (1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(slots=True)
class Row:
    mode: str
    conversation: str
    turn: int
    prompt_tokens: int
    ttft_ms: float | None
    reads: float  # D->P reads P started during the turn
    equal: bool
    verify: str = ""  # our router's check (on): hit, partial, mismatch/...
    error: str | None = None
    text: str = ""
    messages: list | None = None  # what was sent (for the oracle, after the run)
    max_tokens: int = 0  # the answer's length asked for (the oracle asks the same)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="duplexkv bench vllm_multiturn",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=vllm_venv.default_venv())
    ap.add_argument("--proxy", type=Path, help="vLLM's disagg_proxy_multiturn.py (a path to "
                    "your vLLM checkout); without it the proxy column is left out")
    ap.add_argument("--model", default="bench", help="a preset or a model directory")
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--answer-tokens", type=int, nargs=2, default=[32, 64], metavar=("MIN", "MAX"))
    ap.add_argument("--threshold", type=int, default=64, help="vLLM's kv_recompute_threshold")
    ap.add_argument("--no-plugin", action="store_true", help="stock vLLM: no duplexkv plugin")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bind", choices=["cores", "none"], default="none",
                    help="none (default): vLLM's `nobind`, the scheduler places every thread; "
                    "cores: P's OpenMP threads on core 0, D's on core 1 (vLLM's binding)")
    ap.add_argument("--engine", choices=["inproc", "mp"], default="inproc",
                    help="inproc (default): each vLLM engine in its API server's process; mp: "
                    "vLLM's default engine-core and worker processes")
    ap.add_argument("--modes", nargs="+", action=Accumulate, default=["off", "proxy", "on"],
                    choices=["off", "proxy", "on"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if "proxy" in args.modes and args.proxy is None:
        args.modes = [m for m in args.modes if m != "proxy"]
    elif args.proxy is not None and not args.proxy.is_file():
        ap.error(f"--proxy {args.proxy}: no such file (vLLM's examples/disaggregated/"
                 "disaggregated_serving/disagg_proxy_multiturn.py)")
    if args.max_context < 2048 or args.conversations < 1 or min(args.answer_tokens) < 1:
        ap.error("--max-context >= 2048, --conversations >= 1, --answer-tokens >= 1")
    return args


def p_reads(url: str) -> float:
    """P's D->P read count; NaN when P does not answer (the turn's row then says so, and the
    run goes on instead of losing what it measured)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return math.nan
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(READS))


class Bench:
    def __init__(self, args: argparse.Namespace, model_dir: Path, logs: Path) -> None:
        self.args, self.model_dir, self.logs = args, model_dir, logs
        self.name = "bench"
        self.stops: list = []
        self.urls: dict[str, str] = {}

    def start(self) -> None:
        a = self.args
        kv = json.dumps({**KV, "kv_connector_extra_config": {
            "bidirectional_kv_xfer": True, "kv_recompute_threshold": a.threshold}})
        env = {"VLLM_PLUGINS": ""} if a.no_plugin else {}
        engine_env, engine_args = vllm_venv.engine_layout(a.engine)
        env.update(engine_env)
        max_len = self.max_model_len()
        p_cores, d_cores = ("0", "1") if a.bind == "cores" else ("nobind", "nobind")
        specs = {  # name -> (cores, extra args, env)
            "prefill": (p_cores, (*engine_args, "--no-enable-prefix-caching",
                                  "--kv-transfer-config", kv),
                        {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}),
            "decode": (d_cores, (*engine_args, "--kv-transfer-config", kv),
                       {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}),
        }
        with ThreadPoolExecutor(len(specs)) as ex:
            futures = {n: ex.submit(vllm_venv.start_vllm, a.venv, self.model_dir, "float32",
                                    max_len, cores, 2, self.logs, extra=extra,
                                    log_name=f"vllm-{n}", env={**env, **e}, name=self.name)
                       for n, (cores, extra, e) in specs.items()}
            servers = {n: f.result() for n, f in futures.items()}
        self.stops += [s.stop for s in servers.values()]
        self.urls.update({n: s.url for n, s in servers.items()})
        router = spawn("router", router_args([self.urls["prefill"]], [self.urls["decode"]]),
                       self.logs)
        self.stops.append(router.stop)
        wait_ready([router])
        self.urls["off"] = self.urls["on"] = router.url
        if "proxy" in a.modes:
            self.urls["proxy"] = self._start_proxy()

    def max_model_len(self) -> int:
        """--max-context plus room for an answer, within the model's own limit."""
        cfg = json.loads((self.model_dir / "config.json").read_text())
        return min(self.args.max_context + 256, int(cfg["max_position_embeddings"]))

    def _start_proxy(self) -> str:
        p_port, d_port = (self.urls[n].rsplit(":", 1)[1] for n in ("prefill", "decode"))
        port = free_port()
        proxy = start("proxy", [sys.executable, str(self.args.proxy), "--host", "127.0.0.1",
                                "--port", str(port), "--prefiller-host", "127.0.0.1",
                                "--prefiller-port", p_port, "--decoder-host", "127.0.0.1",
                                "--decoder-port", d_port], self.logs,
                      url=f"http://127.0.0.1:{port}")
        self.stops.append(proxy.stop)
        try:
            wait_ready([proxy], timeout_s=60)
        except LaunchError as e:
            raise RuntimeError(f"vLLM's sample proxy did not start: {e}") from None
        return proxy.url

    def stop(self) -> None:
        for stop in reversed(self.stops):
            stop()

    def oracle(self, rows: list[Row]) -> None:
        """P, D and the front-ends are stopped: a single vLLM server on both cores answers
        every recorded turn; fills each row's prompt length and `equal`."""
        a = self.args
        engine_env, engine_args = vllm_venv.engine_layout(a.engine)
        server = vllm_venv.start_vllm(a.venv, self.model_dir, "float32", self.max_model_len(),
                                      "0-1", 2, self.logs, extra=engine_args,
                                      log_name="vllm-single", env=engine_env,
                                      name=self.name)
        try:
            with httpx.Client(timeout=1800, trust_env=False) as client:
                for r in rows:
                    resp = client.post(server.url + "/v1/chat/completions", json={
                        "model": self.name, "messages": r.messages, "temperature": 0,
                        "max_tokens": r.max_tokens,
                        "ignore_eos": True})
                    resp.raise_for_status()
                    body = resp.json()
                    r.prompt_tokens = body["usage"]["prompt_tokens"]
                    r.equal = r.text == (body["choices"][0]["message"]["content"] or "")
        finally:
            server.stop()

    async def run(self) -> list[Row]:
        a = self.args
        from duplexkv.model.tokenizer import Tokenizer  # imports torch

        tok = Tokenizer.from_dir(self.model_dir)
        sizes = DEFAULT_SIZES["agentic"]
        sizes = type(sizes)(sizes.system_tokens, sizes.input_tokens, tuple(a.answer_tokens))
        shapes = plan("agentic", sizes, a.conversations, a.max_context, a.seed)
        source = TextSource(tok, 40_000)
        convs = {m: materialise(shapes, source, a.seed, m) for m in a.modes}
        rows: list[Row] = []
        async with httpx.AsyncClient(timeout=1800, trust_env=False) as client:
            for i in range(len(shapes)):
                history = {m: [{"role": "system", "content": convs[m][i].system}]
                           for m in a.modes}
                for k, turn in enumerate(shapes[i].turns):
                    order = a.modes[k % len(a.modes):] + a.modes[:k % len(a.modes)]
                    for m in order:
                        history[m].append({"role": "user", "content": convs[m][i].turns[k].text})
                        row = await self.turn(client, m, f"c{i}", k, history[m],
                                              turn.answer_tokens)
                        rows.append(row)
                        print(f"{m:<6} c{i} turn {k + 1}: {row.prompt_tokens} tokens, TTFT "
                              f"{row.ttft_ms or 0:.0f} ms, P read {row.reads:g} {row.verify} "
                              f"{row.error or ''}", flush=True)
        return rows

    async def turn(self, client: httpx.AsyncClient, mode: str, conv: str, k: int,
                   messages: list, n: int) -> Row:
        target = Target(mode, self.urls[mode], self.name, send_conversation_id=mode != "off",
                        tag="vmt")
        r = Result(mode, conv, k + 1)
        before = p_reads(self.urls["prefill"])
        try:
            text = await chat_turn(client, target, messages, n, f"vmt-{mode}-{conv}", r)
        except (RequestFailed, httpx.HTTPError, ValueError) as e:
            text, r.error = "", f"{type(e).__name__}: {e}"
        reads = p_reads(self.urls["prefill"]) - before
        sent = [dict(m) for m in messages]
        messages.append({"role": "assistant", "content": text})
        verify = r.verify if mode == "on" else ""
        return Row(mode, conv, k + 1, r.context_tokens, r.ttft_ms, reads, False, verify,
                   r.error, text, sent, n)


def bucket(tokens: int) -> int:
    return next((b for b in BUCKETS if tokens <= b), BUCKETS[-1])


def table(rows: list[Row], modes: list[str]) -> str:
    lines = ["| prompt tokens | turns | " + " | ".join(
        f"{m} TTFT ms" + ("" if m == "off" else " (/off)") for m in modes) + " | " +
        " | ".join(f"{m}: P read D / answers equal" for m in modes) + " |",
        "|---" * (2 + 2 * len(modes)) + "|"]
    by: dict[int, dict[str, list[Row]]] = {}
    for r in rows:
        by.setdefault(bucket(r.prompt_tokens), {}).setdefault(r.mode, []).append(r)
    for b in sorted(by):
        med = {m: statistics.median([r.ttft_ms for r in by[b].get(m, []) if r.ttft_ms] or [0])
               for m in modes}
        cells = [f"{med[m]:.0f}" + ("" if m == "off" or not med["off"] else
                                    f" ({med[m] / med['off']:.2f})") for m in modes]
        counts = [f"{sum(r.reads > 0 for r in by[b].get(m, []))} / "
                  f"{sum(r.equal for r in by[b].get(m, []))} of {len(by[b].get(m, []))}"
                  for m in modes]
        turns = len(by[b].get(modes[0], []))
        lines.append(f"| ≤{b} | {turns} | " + " | ".join(cells) + " | " + " | ".join(counts)
                     + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    version = vllm_venv.installed_version(args.venv)
    if version is None:
        print(f"vLLM does not import from {args.venv}: python -m duplexkv_bench.vllm_venv")
        return 2
    model_dir = resolve_model(args.model)
    logs = Path(tempfile.mkdtemp(prefix="duplexkv-vllm-multiturn-"))
    print(f"{cpu_line()}\ndtype float32 (for exact answers; not --dtype auto's pick where bf16 "
          f"is native); model {model_dir}; vLLM {version}, plugin "
          f"{'off' if args.no_plugin else 'on'}; logs in {logs}", flush=True)
    bench = Bench(args, model_dir, logs)
    try:
        bench.start()
        load = loadavg()
        rows = asyncio.run(bench.run())
    finally:
        bench.stop()
    bench.oracle(rows)
    print(f"\nload average at start {load}, end {loadavg()}\n")
    print(table(rows, args.modes))
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_line(), "vllm_version": version,
                                         "plugin": not args.no_plugin, "modes": args.modes,
                                         "rows": [asdict(r) for r in rows]}, indent=1))
    failed = [r for r in rows if r.error or (r.mode != "proxy" and not r.equal)]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
