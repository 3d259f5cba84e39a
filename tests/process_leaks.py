"""Processes a test module left running. Every process the suite starts inherits a mark in its
environment (set by conftest at import); once a module's fixtures are torn down, a process
still carrying the mark is a leak: it is killed (it would steal the 2 cores from every later
test: a leaked worker stepping its engine starved the vLLM interop test into lease expiries)
and reported at the end of the run."""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass

MARK = "DUPLEXKV_TEST_RUN"
# multiprocessing's resource tracker: one per process that used shared memory or semaphores,
# idle, ending with the pytest process that started it: not a leak
NOT_LEAKS = ("from multiprocessing.resource_tracker import main",)


@dataclass(frozen=True)
class Leak:
    module: str
    pid: int
    cmd: str


def mark_this_run(environ=os.environ) -> str:
    """Set the mark (once per run) and return it."""
    return environ.setdefault(MARK, uuid.uuid4().hex)


def marked_processes(mark: str) -> dict[int, str]:
    """pid -> command line of every other process carrying `mark`."""
    want = f"{MARK}={mark}".encode()
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if want not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone, or not ours to read
            continue
        if cmd and not any(n in cmd for n in NOT_LEAKS):  # a zombie has no command line
            found[int(name)] = cmd[:200]
    return found


def reap(mark: str, module: str, grace_s: float = 3.0) -> list[Leak]:
    """Kill what carries `mark` (TERM, then KILL after `grace_s`); the leaks found."""
    found = marked_processes(mark)
    if not found:
        return []
    deadline = time.monotonic() + grace_s  # a process exiting on its own is given a moment
    while found and time.monotonic() < deadline:
        time.sleep(0.2)
        found = {p: c for p, c in marked_processes(mark).items() if p in found}
    for pid in found:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p in marked_processes(mark) for p in found):
        time.sleep(0.2)
    for pid in marked_processes(mark):
        if pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    return [Leak(module, pid, cmd) for pid, cmd in found.items()]
