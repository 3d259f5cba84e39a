"""`duplexkv demo`: `up` on the default model, then one agentic conversation (a system prompt,
growing tool outputs, several turns) run twice, reuse off and on, and a table per turn.

P runs without prefix caching, as in AWS's evaluation: a busy prefill worker has long evicted
the conversation, so without reuse it recomputes the whole history every turn. With reuse the
router chooses per turn (`--placement auto`, the default): the conversation's D, which holds the
history, prefills only the new tokens itself, or P READs the history's KV from that D
(`--placement prefill`: always P).

Both modes are measured alike on one cluster, turn by turn, the modes alternating (off then on,
then on then off, ...), so that neither meets a colder cluster or a drifting machine more than
the other. First, unrecorded, each runs its own first turn and a second turn of other text
under another conversation id: P and D then know the first turn's exact length (CPU kernels are
compiled per input length: whichever mode met it second would look faster) and every path of a
turn. Turn 1, where nothing can be reused, shows about 1.0x.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from duplexkv.launch import LaunchError
from duplexkv.up import add_cluster_args
from duplexkv_bench.client import Result, Runner, Target
from duplexkv_bench.multiturn import live, make_console, prepare
from duplexkv_bench.multiturn_config import BenchConfig
from duplexkv_bench.report import ratio
from duplexkv_bench.targets import client_key, dtype_note, phases
from duplexkv_bench.workload import Conversation, Sizes, TextSource, materialise

DEMO_SIZES = Sizes(1024, (1024, 1536), (48, 64))


async def alternate(runners: dict[str, Runner], convs: dict[str, Conversation],
                    record: bool = True) -> list[Result]:
    """Each mode's conversation turn by turn, the modes taking turns in alternating order."""
    results: list[Result] = []
    order = list(runners)
    async with runners[order[0]].client() as client:
        t0 = time.perf_counter()
        steps = {m: runners[m].turns(client, convs[m], t0, record) for m in order}
        while steps:
            for mode in [m for m in order if m in steps]:
                try:
                    results.append(await anext(steps[mode]))
                except StopAsyncIteration:
                    del steps[mode]
            order.reverse()
    return results


def warmup(timed: Conversation, other: Conversation) -> Conversation:
    """The timed conversation's first turn (its system prompt, its text), then `other`'s second."""
    return replace(timed, id="warmup", turns=(timed.turns[0], *other.turns[1:2]))


def run_alternating(cfg: BenchConfig, console: Console, conv: Conversation,
                    source: TextSource) -> list[Result]:
    """Off and on on one cluster: both warmed alike, then timed turn by turn, alternating."""
    tag = uuid.uuid4().hex[:8]
    with live(console, cfg.modes, len(conv.turns)) as display:
        ((modes, target_cm),) = phases(cfg, display.log)  # off and on: one launched cluster
        with target_cm() as (url, model):
            runners = {m: Runner(Target(m, url, model, m == "on", tag, client_key()),
                                 on_result=display.recorder(m)) for m in modes}
            timed = {m: materialise([conv], source, cfg.seed, m)[0] for m in modes}
            warm = {m: warmup(timed[m], materialise([conv], source, cfg.seed, f"warmup-{m}")[0])
                    for m in modes}
            asyncio.run(alternate(runners, warm, record=False))
            return asyncio.run(alternate(runners, timed))


def demo_table(results: list[Result]) -> Table:
    t = Table(title="One agentic conversation, twice: TTFT per turn (router -> P -> D, "
                    "measured by the client)", title_justify="left")
    for h in ("turn", "context tokens", "TTFT reuse off", "TTFT reuse on", "speed-up",
              "prefill on", "history reused", "tokens computed"):
        t.add_column(h, justify="right")
    off = {r.turn: r for r in results if r.mode == "off"}
    on = {r.turn: r for r in results if r.mode == "on"}
    for turn in sorted(set(off) | set(on)):
        a, b = off.get(turn), on.get(turn)
        ctx = (b or a).context_tokens
        speed = ratio(a and a.ttft_ms, b and b.ttft_ms)
        ok = b is not None and not b.error
        t.add_row(str(turn), f"{ctx:,}", _s(a), _s(b), "-" if speed is None else f"{speed:.1f}x",
                  ("D" if b.placement == "decode_local" else "P") if ok else "-",
                  f"{reused(b):,}" if ok else "-", f"{b.recomputed_tokens:,}" if ok else "-")
    return t


def reused(r: Result) -> int:
    """History tokens not computed again: READ by P from D, or D's own (decode_local)."""
    return r.pulled_tokens + r.local_hit_tokens


def how(r: Result) -> str:
    if r.placement == "decode_local":
        return (f"D prefilled only {r.recomputed_tokens:,} new tokens over the {reused(r):,} "
                f"tokens of history it kept (no P leg)")
    return f"P pulled {r.pulled_tokens:,} tokens of KV from D and computed {r.recomputed_tokens:,}"


def _s(r: Result | None) -> str:
    if r is None:
        return "-"
    return "failed" if r.error or r.ttft_ms is None else f"{r.ttft_ms / 1e3:.2f} s"


def run(cfg: BenchConfig, console: Console | None = None) -> list[Result]:
    console = console or make_console()
    t0 = time.perf_counter()
    for paragraph in __doc__.split("\n\n")[1:3]:
        console.print(paragraph.replace("\n", " "))
    (conv,), source = prepare(cfg, console)  # one conversation
    console.print(dtype_note(cfg))
    results = run_alternating(cfg, console, conv, source)
    console.print(demo_table(results))
    last = max((r.turn for r in results if r.mode == "on" and not r.error), default=0)
    pair = [r for r in results if r.turn == last and not r.error]
    if len(pair) == 2:
        off, on = sorted(pair, key=lambda r: r.mode != "off")
        console.print(f"At {on.context_tokens:,} tokens of history, reuse cut the time to first "
                      f"token from {off.ttft_ms / 1e3:.2f} s to {on.ttft_ms / 1e3:.2f} s "
                      f"({off.ttft_ms / on.ttft_ms:.1f}x): {how(on)}.")
    console.print(f"demo took {time.perf_counter() - t0:.0f} s; worker logs in "
                  f"{cfg.output_dir / 'logs'}. Next: `duplexkv up` to serve, "
                  f"`duplexkv bench multiturn` to measure.")
    return results


def add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="start a cluster and show reuse on a multi-turn "
                                    "conversation (the first command to run)",
                       description=__doc__.split("\n\n")[0])
    add_cluster_args(p)
    p.add_argument("--max-context", type=int, default=8192, metavar="TOKENS")
    p.add_argument("--system-tokens", type=int, default=DEMO_SIZES.system_tokens)
    p.add_argument("--input-tokens", type=int, nargs=2, default=DEMO_SIZES.input_tokens,
                   metavar=("MIN", "MAX"))
    p.add_argument("--answer-tokens", type=int, nargs=2, default=DEMO_SIZES.answer_tokens,
                   metavar=("MIN", "MAX"))
    p.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    sizes = Sizes(args.system_tokens, tuple(args.input_tokens), tuple(args.answer_tokens))
    log_root = args.log_dir or Path(tempfile.mkdtemp(prefix="duplexkv-demo-"))
    cfg = BenchConfig(workload="agentic", max_context=args.max_context, modes=("off", "on"),
                      sizes=sizes, model=args.model, connector=args.kv_connector,
                      dtype=args.dtype, output_dir=log_root, placement=args.placement,
                      kv_recompute_threshold=args.kv_recompute_threshold)
    try:
        results = run(cfg)
    except LaunchError as e:
        raise ValueError(str(e)) from None
    return 1 if any(r.error for r in results) else 0
