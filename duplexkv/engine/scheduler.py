"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step has a token budget (`max_num_batched_tokens`). Running sequences go first (a decode
costs one token, an unfinished prefill takes the next chunk), then waiting sequences are admitted
in arrival order while budget, sequence slots and blocks last. When a running sequence cannot get
a block, the most recently admitted running sequence is preempted: its blocks are freed and it
goes back to the front of the queue to be recomputed (its prefix usually hits the cache).
Waiting sequences whose remote KV landed hold their blocks and may pass a head that cannot get
blocks; when nothing runs and none of them can get the block it still needs (they hold the pool
between them), the newest gives its blocks up and is recomputed later, so the pool never locks.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from duplexkv.engine.block_manager import BlockManager
from duplexkv.engine.sequence import SeqStatus, Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last token, so its logits are needed."""
        return self.start + self.num_new_tokens == self.seq.num_tokens


def holds_own_blocks(seq: Sequence) -> bool:
    """Blocks beyond shared prefix hits (e.g. remote KV that landed in them)."""
    return seq.num_blocks > seq.num_hashed_blocks


def insert_by_arrival(queue: deque[Sequence], seq: Sequence) -> None:
    """Into the queue at its arrival position, so that requests resumed after a pull (or that
    gave their blocks up) neither jump nor fall behind the others."""
    for i, other in enumerate(queue):
        if other.arrival_time > seq.arrival_time:
            queue.insert(i, seq)
            return
    queue.append(seq)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int,
                 max_num_seqs: int) -> None:
        self.bm = block_manager
        self.budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: dict[str, Sequence] = {}  # WAITING_FOR_REMOTE_KV
        # the oldest waiting sequence when the last schedule() could not give it blocks: remote
        # KV for younger sequences may not take blocks past it (it would starve)
        self.blocked_head: Sequence | None = None
        self.num_preemptions = 0
        # frees blocks held for other nodes when live work needs room; returns blocks released
        self.reclaim: Callable[[int], int] | None = None

    def _allocate(self, seq: Sequence, num_tokens: int) -> bool:
        if self.bm.allocate_for(seq, num_tokens):
            return True
        need = self.bm.blocks_needed(num_tokens) - seq.num_blocks
        return bool(self.reclaim and self.reclaim(need)) and self.bm.allocate_for(seq, num_tokens)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.parked)

    def schedule(self) -> list[ScheduledSeq]:
        batch: list[ScheduledSeq] = []
        budget = self.budget
        # running sequences first, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self._allocate(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                batch.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted; nothing after it is left
        self._admit(batch, budget)
        # nothing runs and the queue's own blocks fill the pool: none of them can ever get the
        # block it still needs, so the newest holder gives its blocks up (it recomputes later)
        while not batch and not self.running and self._unlock():
            self._admit(batch, self.budget)
        return batch

    def _admit(self, batch: list[ScheduledSeq], budget: int) -> None:
        """Admit waiting sequences into `batch` in order while budget, slots and blocks last."""
        # admit waiting sequences in order; behind a head that cannot get its blocks, only
        # sequences that already hold their own (landed remote KV) may pass it: they need little
        # more, and running them is the only way their blocks come free again
        self.blocked_head = None
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if self.blocked_head is not None and not holds_own_blocks(seq):
                i += 1
                continue
            if not seq.block_table:
                self.apply_prefix_hit(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._allocate(seq, seq.num_computed_tokens + n):
                if self.blocked_head is None:
                    self.blocked_head = seq
                if seq.status is SeqStatus.WAITING and seq.num_hashed_blocks == seq.num_blocks:
                    self.bm.free(seq)  # do not hold prefix hits while queued
                    seq.num_computed_tokens = 0
                i += 1
                continue
            del self.waiting[i]
            seq.status = SeqStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
                seq.stats.queue_ms = (seq.first_scheduled_time - seq.arrival_time) * 1e3
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, n))
            budget -= n

    def _unlock(self) -> bool:
        """Free the blocks of the newest waiting sequence that holds any (landed remote KV),
        behind a head that cannot get blocks; False when there is none."""
        holders = [q for q in self.waiting if q.block_table]
        if self.blocked_head is None or not holders:
            return False
        victim = max(holders, key=lambda q: q.arrival_time)
        self.waiting.remove(victim)
        self._drop_blocks(victim)
        insert_by_arrival(self.waiting, victim)
        return True

    def apply_prefix_hit(self, seq: Sequence) -> None:
        # at least one token must be computed to get logits, so never hit the whole sequence
        hits = self.bm.match_prefix(seq.all_token_ids, (seq.num_tokens - 1) // self.bm.block_size,
                                    seq.params.cache_salt)
        self.bm.acquire(hits)
        seq.block_table = list(hits)
        seq.num_computed_tokens = len(hits) * self.bm.block_size
        seq.num_hashed_blocks = len(hits)
        if seq.stats.preemptions == 0:
            seq.stats.local_hit_tokens = seq.num_computed_tokens

    def adopt_prefix(self, seq: Sequence, block_ids: list[int], num_tokens: int) -> None:
        """Before `add`: start `seq` from blocks this worker already holds for its first
        `num_tokens` tokens (a retained turn of its own, verified token by token by the caller)
        instead of the prefix cache. The caller's references stay with the caller; `seq` takes
        its own."""
        assert not seq.block_table and seq.num_computed_tokens == 0, "adopt into a fresh seq"
        assert 0 < num_tokens < seq.num_tokens, "at least one token must be computed"
        assert len(block_ids) == self.bm.blocks_needed(num_tokens)
        self.bm.acquire(block_ids)
        seq.block_table = list(block_ids)
        seq.num_computed_tokens = num_tokens
        seq.num_hashed_blocks = num_tokens // self.bm.block_size  # a partial last block: not yet
        seq.stats.local_hit_tokens = num_tokens

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._drop_blocks(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def _drop_blocks(self, seq: Sequence) -> None:
        """Free what `seq` computed: it is recomputed when it runs again."""
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.stats.preemptions += 1
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and release blocks (callers that retain blocks pin them first)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.parked.pop(seq.request_id, None)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.bm.free(seq)

    # remote KV: the engine parks a sequence while its connector pulls, then resumes it
    def park_for_remote_kv(self, seq: Sequence) -> None:
        """Apply the local prefix hit and hold `seq` out of scheduling (not queued)."""
        self.apply_prefix_hit(seq)
        seq.status = SeqStatus.WAITING_FOR_REMOTE_KV
        self.parked[seq.request_id] = seq

    def reserve_for_remote_kv(self, seq: Sequence, num_tokens: int) -> list[int] | None:
        """Blocks for a parked `seq`'s first `num_tokens` tokens (reclaiming blocks held for
        other workers if needed): the new block table, or None when there is no room."""
        assert seq.request_id in self.parked, "reserve for a sequence that is not parked"
        head = self.blocked_head
        if head is not None and head.arrival_time <= seq.arrival_time \
                and head.status is SeqStatus.WAITING:
            return None  # an older request waits for blocks: first come, first served
        return list(seq.block_table) if self._allocate(seq, num_tokens) else None

    def resume(self, seq: Sequence, num_computed_tokens: int | None = None) -> None:
        """Back to the queue: with `num_computed_tokens` computed (remote KV landed in its
        blocks) at the front, since its blocks are taken and only running it frees them; or, by
        default, at its arrival position (neither jumping nor falling behind the others: a
        declined pull once waited behind every newer request), giving its prefix hit back until
        it is admitted (it hits the cache again then)."""
        del self.parked[seq.request_id]
        if num_computed_tokens is None:
            num_computed_tokens = min(seq.num_computed_tokens,
                                      seq.num_hashed_blocks * self.bm.block_size)
        else:  # landed KV beyond the prefix hit sits in blocks reserved for it
            assert holds_own_blocks(seq), "remote KV landed without reserved blocks"
        assert num_computed_tokens <= seq.num_blocks * self.bm.block_size
        seq.num_computed_tokens = num_computed_tokens
        seq.status = SeqStatus.WAITING
        if holds_own_blocks(seq):
            # it holds blocks beyond shared prefix hits: run it first, so that they are freed
            self.waiting.appendleft(seq)
        else:  # no prefix hits held while queued (behind a blocked head they locked the pool)
            self.bm.free(seq)
            seq.num_computed_tokens = 0
            insert_by_arrival(self.waiting, seq)

    def refs_held(self) -> dict[int, int]:
        """Block -> number of references held by live sequences (for integrity checks)."""
        refs: dict[int, int] = {}
        for seq in [*self.running, *self.waiting, *self.parked.values()]:
            for bid in seq.block_table:
                refs[bid] = refs.get(bid, 0) + 1
        return refs
