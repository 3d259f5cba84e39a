"""Repeated identical log records, collapsed: the first is written, the next ones within
`interval_s` are counted, and the first after the interval carries the count (issue 32: accept()
failing with EMFILE logged 7,000-11,000 lines a second, 300 MB of log in 93 s).

Only warnings and errors are collapsed (an info line per request differs anyway); the key is the
logger, the level and the formatted message with the exception's type and text, if any.
"""

from __future__ import annotations

import logging
import threading
import time

DEFAULT_INTERVAL_S = 10.0
MAX_KEYS = 1024  # distinct messages tracked at once; the oldest are forgotten beyond it


class RepeatFilter(logging.Filter):
    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, clock=time.monotonic) -> None:
        super().__init__()
        self.interval_s, self.clock = interval_s, clock
        self.seen: dict[tuple, list] = {}  # key -> [time written, repeats suppressed since]
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        key = (record.name, record.levelno, record.getMessage()[:500],
               None if exc is None else (type(exc).__name__, str(exc)[:200]))
        now = self.clock()
        with self.lock:
            entry = self.seen.get(key)
            if entry is not None and now - entry[0] < self.interval_s:
                entry[1] += 1
                return False
            repeats = entry[1] if entry is not None else 0
            self.seen.pop(key, None)
            self.seen[key] = [now, 0]
            if len(self.seen) > MAX_KEYS:
                del self.seen[next(iter(self.seen))]
        if repeats:
            record.msg = f"{record.msg} (and {repeats} more times in the last " \
                         f"{now - entry[0]:.0f} s)"
        return True


def collapse_repeats(interval_s: float = DEFAULT_INTERVAL_S,
                     loggers: tuple[str, ...] = ("", "uvicorn", "uvicorn.error")) -> RepeatFilter:
    """Add one RepeatFilter to every handler of `loggers` (the root's and uvicorn's own, which
    uvicorn's logging configuration gives handlers that do not propagate)."""
    f = RepeatFilter(interval_s)
    for name in loggers:
        for h in logging.getLogger(name).handlers:
            if not any(isinstance(x, RepeatFilter) for x in h.filters):
                h.addFilter(f)
    return f
