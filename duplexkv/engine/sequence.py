"""Request state: one `Sequence` per request, owned by the scheduler."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from duplexkv.wire.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks allocated, a transfer fills them
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class KVStats:
    """Where a request's prompt KV came from, and what it cost (reported on every response)."""

    local_hit_tokens: int = 0
    pulled_tokens: int = 0
    computed_tokens: int = 0
    transfer_bytes: int = 0
    transfer_ms: float = 0.0
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    preemptions: int = 0
    pull_outcome: str = ""  # "", "pulled", or why not: threshold, mismatch, expired, failed, ...
    # the reader's pull-or-recompute decision with both predictions (kv/pull_decision.py)
    pull_decision: dict | None = None
    # D prefilled a conversation's new suffix over its own retained turn (kv/local_reuse.py)
    decode_local: dict | None = None
    # choices 1.. of an n > 1 request: of local_hit_tokens, those taken from choice 0's blocks
    shared_tokens: int = 0

    def as_dict(self) -> dict:
        return {
            "local_hit_tokens": self.local_hit_tokens,
            "pulled_tokens": self.pulled_tokens,
            "computed_tokens": self.computed_tokens,
            "transfer_bytes": self.transfer_bytes,
            "transfer_ms": round(self.transfer_ms, 3),
            "queue_ms": round(self.queue_ms, 3),
            "prefill_ms": round(self.prefill_ms, 3),
            "preemptions": self.preemptions,
            "pull_outcome": self.pull_outcome,
            "pull_decision": self.pull_decision,
            "decode_local": self.decode_local,
            "shared_tokens": self.shared_tokens,
        }


@dataclass(slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_size: int
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in block_table
    num_hashed_blocks: int = 0  # leading blocks already registered in the prefix cache
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    stats: KVStats = field(default_factory=KVStats)
    error: str | None = None
    parent_id: str | None = None  # choices 1.. of an n > 1 request: the request's id
    index: int = 0  # the choice's index

    @property
    def output_id(self) -> str:
        """The request id its outputs carry (the request's, for every choice)."""
        return self.parent_id or self.request_id

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, stop: int) -> list[int]:
        """all_token_ids[start:stop] without joining the whole list (a decode step's token)."""
        prompt, n = self.prompt_token_ids, len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        if stop <= n:
            return prompt[start:stop]
        return prompt[start:] + self.output_token_ids[: stop - n]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_blocks(self) -> int:
        return len(self.block_table)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids(i * self.block_size, (i + 1) * self.block_size)
