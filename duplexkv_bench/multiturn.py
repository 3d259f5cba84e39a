"""`duplexkv bench multiturn`: TTFT per turn and per context length, with and without reuse of
a conversation's history through D, modelled on vLLM's multi-turn benchmark (protocol.md 7).

    off     the router without a conversation id: P recomputes the whole prompt every turn
            (P runs without prefix caching, as in AWS's evaluation, emulating eviction)
    on      the same router with a conversation id: P READs the history's KV from D
    ideal   one worker with prefix caching on: its local cache holds the history

Without --url the benchmark launches its own cluster (router + 1 P + 1 D, P without prefix
caching) for off/on, stops it, then launches the single worker for ideal; the modes never run
at the same time. Each mode sends conversations of identical shape but different text (a
file's texts are the same in every mode), after an unrecorded two-turn warm-up. Results:
tables on the terminal, results.json, results.md and ttft_vs_context.png in --output-dir.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from duplexkv.engine.dtype import DTYPE_CHOICES
from duplexkv.flags import Accumulate
from duplexkv.launch import LaunchError
from duplexkv.model.registry import resolve_model
from duplexkv.router.placement import DEFAULT_MODE, MODES
from duplexkv_bench import report
from duplexkv_bench.client import Result, Runner, Target
from duplexkv_bench.multiturn_config import BenchConfig
from duplexkv_bench.targets import BenchError, check_target, client_key, dtype_note, phases
from duplexkv_bench.workload import (DEFAULT_SIZES, Conversation, Sizes, TextSource, load_file,
                                     materialise, plan, total_tokens)

CONNECTORS = ("TcpConnector", "NixlConnector")
WARMUP = Sizes(32, (80, 96), (4, 4), max_turns=2)


def conversations(cfg: BenchConfig, tok) -> list[Conversation]:
    """The generated workload, or a file's conversations (all of them by default; cycled when
    more are asked for, each copy with its own id)."""
    if cfg.workload in DEFAULT_SIZES:
        return plan(cfg.workload, cfg.sizes or DEFAULT_SIZES[cfg.workload],
                    cfg.conversations or 1, cfg.max_context, cfg.seed)
    convs = load_file(Path(cfg.workload), tok)
    n = cfg.conversations or len(convs)
    return [replace(convs[i % len(convs)], id=f"{i}:{convs[i % len(convs)].id}")
            for i in range(n)]


def result_line(r: Result) -> str:
    if r.error:
        return f"[red]{r.mode:5s} {r.conversation} turn {r.turn:2d} FAILED: {escape(r.error)}[/red]"
    reuse = (f"kept on D     {r.local_hit_tokens:6,d}" if r.placement == "decode_local"
             else f"pulled from D {r.pulled_tokens:6,d}")  # decode_local: D reused its own
    return (f"{r.mode:5s} {r.conversation} turn {r.turn:2d}  context {r.context_tokens:6,d}  "
            f"TTFT {r.ttft_ms:8,.0f} ms  {reuse}  recomputed {r.recomputed_tokens:6,d}")


class Live:
    """The terminal while modes run: a progress bar per mode, each result's line above them."""

    def __init__(self, progress: Progress, modes: tuple[str, ...], turns: int) -> None:
        self.progress = progress
        self.log = progress.console.print
        self.tasks = {m: progress.add_task(report.MODE_NAMES[m], total=turns, last="")
                      for m in report.MODES if m in modes}

    def recorder(self, mode: str) -> Callable[[Result], None]:
        """A Runner's on_result for `mode`."""
        task = self.tasks[mode]

        def on_result(r: Result) -> None:
            self.progress.advance(task)
            self.log(result_line(r))
            if r.ttft_ms is not None:
                self.progress.update(task, last=f"context {r.context_tokens:,}  "
                                                f"TTFT {r.ttft_ms:,.0f} ms")
        return on_result


@contextlib.contextmanager
def live(console: Console, modes: tuple[str, ...], turns: int) -> Iterator[Live]:
    columns = (TextColumn("{task.description:20s}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("{task.fields[last]}"))
    with Progress(*columns, console=console) as progress:
        yield Live(progress, modes, turns)


def run_modes(cfg: BenchConfig, console: Console, convs: list[Conversation],
              source: TextSource) -> tuple[list[Result], dict[str, float]]:
    results: list[Result] = []
    wall: dict[str, float] = {}
    tag = uuid.uuid4().hex[:8]
    with live(console, cfg.modes, sum(len(c.turns) for c in convs)) as display:
        order = phases(cfg, display.log)
        if cfg.reverse:  # drift between phases then biases the ratios the other way
            order = [(tuple(reversed(modes)), cm) for modes, cm in reversed(order)]
        for modes, target_cm in order:
            with target_cm() as (url, model):
                for mode in modes:
                    target = Target(mode, url, model, mode == "on", tag, client_key())
                    runner = Runner(target, cfg.clients, cfg.idle_s, display.recorder(mode))
                    if cfg.warmup:
                        warm = [replace(c, id="warmup")
                                for c in plan("agentic", WARMUP, 1, 10**6, cfg.seed)]
                        runner.run_sync(materialise(warm, source, cfg.seed, f"warmup-{mode}"),
                                        record=False)
                    t0 = time.perf_counter()
                    results += runner.run_sync(materialise(convs, source, cfg.seed, mode))
                    wall[mode] = time.perf_counter() - t0
    return results, wall


def diagnose(results: list[Result]) -> list[str]:
    """Why reuse did not happen, if it did not (the target's configuration, usually)."""
    later = [r for r in results if r.mode == "on" and r.turn > 1 and r.error is None]
    if not later:
        return []
    if not any(r.has_kv_stats for r in later):
        return ["the target's responses carry no kv_stats: pulled/recomputed tokens are unknown "
                "(is it a duplexkv router?)"]
    if any(r.pulled_tokens or r.placement == "decode_local" for r in later):
        return []
    states = sorted({r.router_conversation for r in later})
    outcomes = sorted({r.pull_outcome for r in later})
    return [f"reuse on pulled no tokens from D after turn 1 (router conversation states "
            f"{states}, P pull outcomes {outcomes}); check that bidirectional_kv_xfer is on for "
            f"both P and D and that the router keeps conversations"]


def prepare(cfg: BenchConfig, console: Console) -> tuple[list[Conversation], TextSource]:
    from duplexkv.model.tokenizer import Tokenizer  # imports torch

    tok = Tokenizer.from_dir(resolve_model(cfg.tokenizer or cfg.model))
    convs = conversations(cfg, tok)
    source = TextSource(tok, total_tokens(convs) * 2)
    console.print(f"workload {cfg.workload}: {len(convs)} conversation(s), "
                  f"{sum(len(c.turns) for c in convs)} turns each mode, up to "
                  f"{max(c.planned_context for c in convs):,} context tokens; {cfg.clients} "
                  f"at once; modes {', '.join(cfg.modes)}")
    return convs, source


def make_console() -> Console:
    """The terminal's console; 160 columns wide when the output is a file or a pipe."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def run(cfg: BenchConfig, console: Console | None = None) -> dict:
    console = console or make_console()
    t0 = time.perf_counter()
    for url, what in ((cfg.url, "router"), (cfg.ideal_url, "ideal worker")):
        if url:
            check_target(url, what)  # fail fast, before preparing the texts
    convs, source = prepare(cfg, console)
    note = dtype_note(cfg)
    console.print(note)
    results, wall = run_modes(cfg, console, convs, source)
    summary = report.summarize(results, wall)
    for table in report.tables(summary):
        console.print(table)
    notes = diagnose(results)
    for note in notes:
        console.print(f"[yellow]warning: {escape(note)}[/yellow]")
    out = cfg.output_dir
    out.mkdir(parents=True, exist_ok=True)
    took = time.perf_counter() - t0
    doc = {"command": cfg.command, "config": {**asdict(cfg), "output_dir": str(out)},
           "dtype": note,
           "took_s": took, "warnings": notes, "summary": summary,
           "requests": [r.as_dict() for r in results]}
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    md = f"`{cfg.command}`\n\n{note}\n\n{report.markdown(summary)}\n" if cfg.command else \
        f"{note}\n\n{report.markdown(summary)}\n"
    (out / "results.md").write_text(md)
    where = cfg.url or f"1P1D launched here, {os.cpu_count()} CPU cores, {note}"
    title = (f"{cfg.model}, {cfg.workload}, {len(convs)} conversation(s), {cfg.clients} at once "
             f"({where})")
    from duplexkv_bench import chart  # matplotlib: only when needed

    chart.plot(out / "ttft_vs_context.png", results, summary["modes"], title)
    console.print(f"took {took / 60:.1f} min; wrote {out / 'results.json'}, "
                  f"{out / 'results.md'}, {out / 'ttft_vs_context.png'}")
    return doc


def add_arguments(m: argparse.ArgumentParser) -> None:
    """`duplexkv bench multiturn`'s flags (its parser: command.py)."""
    m.add_argument("--url", help="a running router (default: launch a cluster)")
    m.add_argument("--ideal-url", help="with --url: a single worker with prefix caching on")
    m.add_argument("--model", default="bench", help="model to launch (default: bench)")
    m.add_argument("--tokenizer", help="model dir sizing the texts (default: --model's)")
    m.add_argument("--workload", default="agentic",
                   help="agentic (default), chat, or a JSON file of conversations")
    m.add_argument("--max-context", type=int, default=16384, metavar="TOKENS")
    m.add_argument("--conversations", type=int, help="per mode (default: 1, or all of a file's)")
    m.add_argument("--clients", type=int, default=1, help="conversations at once")
    m.add_argument("--idle", type=float, default=0.0, metavar="S",
                   help="wait between the turns of a conversation")
    m.add_argument("--modes", nargs="+", action=Accumulate,
                   choices=report.MODES, default=list(report.MODES))
    m.add_argument("--system-tokens", type=int)
    m.add_argument("--input-tokens", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help="tokens each turn adds (tool result / user message)")
    m.add_argument("--answer-tokens", type=int, nargs=2, metavar=("MIN", "MAX"))
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--kv-connector", default="TcpConnector", choices=CONNECTORS)
    m.add_argument("--placement", choices=MODES, default=DEFAULT_MODE, help="the router's")
    m.add_argument("--kv-recompute-threshold", type=int, default=None, metavar="TOKENS",
                   help="the launched workers' fixed pull rule (default: their cost model)")
    m.add_argument("--dtype", choices=DTYPE_CHOICES, help="the launched workers' (default auto)")
    m.add_argument("--output-dir", type=Path, help="default: out/multiturn-DATE-TIME")
    m.add_argument("--no-warmup", dest="warmup", action="store_false")
    m.add_argument("--reverse", action="store_true",
                   help="modes in reverse (ideal, on, off): run once each way to see drift")
    m.set_defaults(run=run_multiturn)


def command_line() -> str:
    """The command as typed (for the JSON and markdown), when run from the command line."""
    name = Path(sys.argv[0]).name
    return "duplexkv " + shlex.join(sys.argv[1:]) if name in ("duplexkv", "cli.py") else ""


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    if (args.conversations is not None and args.conversations < 1) or args.clients < 1:
        raise ValueError("--conversations and --clients must be at least 1")
    sizes = None
    if args.workload in DEFAULT_SIZES:
        sizes = DEFAULT_SIZES[args.workload]
        for name, value in (("system_tokens", args.system_tokens),
                            ("input_tokens", args.input_tokens),
                            ("answer_tokens", args.answer_tokens)):
            if value is not None:
                sizes = replace(sizes, **{name: tuple(value) if isinstance(value, list)
                                          else value})
    elif not Path(args.workload).is_file():
        raise ValueError(f"--workload must be agentic, chat or a JSON file; "
                         f"{args.workload!r} is none")
    kw = dict(workload=args.workload, max_context=args.max_context,
              conversations=args.conversations, clients=args.clients, idle_s=args.idle,
              modes=tuple(args.modes), sizes=sizes, seed=args.seed, model=args.model,
              tokenizer=args.tokenizer, url=args.url and args.url.rstrip("/"),
              ideal_url=args.ideal_url and args.ideal_url.rstrip("/"),
              connector=args.kv_connector, placement=args.placement, dtype=args.dtype,
              kv_recompute_threshold=args.kv_recompute_threshold, warmup=args.warmup,
              reverse=args.reverse, command=command_line())
    if args.output_dir:
        kw["output_dir"] = args.output_dir
    return BenchConfig(**kw)


def run_multiturn(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    try:
        doc = run(cfg)
    except LaunchError as e:
        raise BenchError(str(e)) from None
    failed = sum(s["failed"] for s in doc["summary"]["per_mode"].values())
    return 1 if failed else 0
