"""The release notices of "ttl" entries: what the router learns D has dropped.

Every release of a retained turn (read, lease expired, capped, deleted, evicted) gets the next
generation number; the router asks for the releases after the generation it saw last
(`POST /v1/kv/retention`, `since`) and stops handing those entries out. The log keeps the
newest `RELEASE_LOG` notices; a router that asks from further back is told that some are
missing (`reset`).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

RELEASE_LOG = 8192  # release notices kept for the router's polls


class Released(NamedTuple):
    generation: int  # the table's generation after these releases
    request_ids: list[str]  # "ttl" entries released after the asked-for generation
    reset: bool  # the log no longer reaches back that far: some releases are missing


class ReleaseLog:
    def __init__(self, size: int = RELEASE_LOG) -> None:
        self.generation = 0
        self._log: deque[tuple[int, str]] = deque(maxlen=size)

    def add(self, request_id: str) -> None:
        self.generation += 1
        self._log.append((self.generation, request_id))

    def since(self, generation: int) -> Released:
        oldest = self._log[0][0] if self._log else self.generation + 1
        ids = [rid for g, rid in self._log if g > generation]
        return Released(self.generation, ids, 0 <= generation < oldest - 1)
