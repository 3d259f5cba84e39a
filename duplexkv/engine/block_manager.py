"""KV block allocation with a prefix cache.

Blocks are identified by a chained hash over (parent hash, the block's token ids), seeded with a
model/layout fingerprint, so equal hashes mean equal token prefixes on any node with the same model.
A request's `cache_salt` (vLLM's field; the router sets one per tenant) is folded into that seed
(`salted`): requests with different salts share no cached block, on this node or across nodes.
Only full blocks enter the cache. A freed block keeps its hash and stays reusable until it is
handed out again (lazy eviction, least recently freed first).

    state of a block     ref_count   hash     in free queue
    free                 0           none     yes
    cached-free          0           set      yes   (a hit revives it)
    in use               > 0         either   no    (sequences and pins share ref_count)
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple
from typing import Sequence as Seq

from duplexkv.engine.sequence import Sequence

NO_HASH = b""


def hash_block(parent: bytes, token_ids: Seq[int]) -> bytes:
    """128-bit chained hash of one block; `parent` is the previous block's hash or the seed."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def salted(seed: bytes, salt: str | None) -> bytes:
    """The hash seed of requests carrying `salt` (None or "": the unsalted seed)."""
    if not salt:
        return seed
    return hashlib.blake2b(seed + b"\x00cache_salt\x00" + salt.encode(), digest_size=16).digest()


def salt_tag(seed: bytes, salt: str | None) -> bytes:
    """A short public tag of a salted seed (b"" without a salt): a verify presents it, so even a
    prompt shorter than a block matches only an entry of its own salt (kv/retention.py)."""
    if not salt:
        return b""
    return hashlib.blake2b(salted(seed, salt), digest_size=8, person=b"duplexkv-tag").digest()


def hash_token_blocks(seed: bytes, token_ids: Seq[int], block_size: int) -> list[bytes]:
    """Chained hashes of every full block of `token_ids`."""
    hashes, parent = [], seed
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes = NO_HASH
    token_ids: tuple[int, ...] = ()


class BlockCounts(NamedTuple):
    free: int
    cached_free: int
    in_use: int
    total: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 seed: bytes) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.seed = seed
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.num_evicted = 0
        # blocks in the free queue that hold a hash (kept as blocks move, so `counts` need not
        # walk the pool: 0.5 ms at 8,192 blocks, every published snapshot; check_integrity
        # checks it against a walk)
        self.num_cached_free = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or cached-free)."""
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # prefix cache
    def match_prefix(self, token_ids: Seq[int], max_blocks: int | None = None,
                     salt: str | None = None) -> list[int]:
        """Block ids of the longest cached run of full blocks that prefixes `token_ids`, among
        the blocks cached under the same `salt`."""
        if not self.enable_prefix_caching:
            return []
        hits, parent = [], salted(self.seed, salt)
        n = len(token_ids) // self.block_size
        if max_blocks is not None:
            n = min(n, max_blocks)
        for i in range(n):
            toks = token_ids[i * self.block_size : (i + 1) * self.block_size]
            parent = hash_block(parent, toks)
            bid = self.hash_to_block.get(parent)
            if bid is None or self.blocks[bid].token_ids != tuple(toks):
                break
            hits.append(bid)
        return hits

    def acquire(self, block_ids: Seq[int]) -> None:
        """Take a reference on cached blocks (a prefix hit or a pin by an outside holder)."""
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free_queue[bid]
                self.num_cached_free -= bool(block.hash)
            block.ref_count += 1

    pin = acquire

    def unpin(self, block_ids: Seq[int]) -> None:
        self._release(block_ids)

    # allocation
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_queue)

    def allocate(self, num_blocks: int) -> list[int]:
        assert self.can_allocate(num_blocks), "allocate without can_allocate"
        out = []
        for _ in range(num_blocks):
            bid, _ = self.free_queue.popitem(last=False)
            block = self.blocks[bid]
            assert block.ref_count == 0
            if block.hash:
                self.num_cached_free -= 1
                if self.hash_to_block.get(block.hash) == bid:
                    del self.hash_to_block[block.hash]
                    self.num_evicted += 1
                block.hash, block.token_ids = NO_HASH, ()
            block.ref_count = 1
            out.append(bid)
        return out

    def allocate_for(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq.block_table to hold `num_tokens` tokens; False (and no change) if no room."""
        need = self.blocks_needed(num_tokens) - seq.num_blocks
        if need <= 0:
            return True
        if not self.can_allocate(need):
            return False
        seq.block_table.extend(self.allocate(need))
        return True

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references, tail first so that the prefix stays cached longest."""
        self._release(reversed(seq.block_table))
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def _release(self, block_ids) -> None:
        for bid in block_ids:
            block = self.blocks[bid]
            assert block.ref_count > 0, f"block {bid} released more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[bid] = None
                self.num_cached_free += bool(block.hash)

    def cache_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly completed full blocks in the prefix cache."""
        n_full = min(seq.num_computed_tokens // self.block_size, seq.num_blocks)
        if n_full <= seq.num_hashed_blocks:
            return
        if not self.enable_prefix_caching:
            seq.num_hashed_blocks = n_full
            return
        bs, start = self.block_size, seq.num_hashed_blocks
        tokens = seq.token_ids(start * bs, n_full * bs)
        parent = (self.blocks[seq.block_table[start - 1]].hash if start
                  else salted(self.seed, seq.params.cache_salt))
        for i in range(start, n_full):
            toks = tuple(tokens[(i - start) * bs : (i - start + 1) * bs])
            parent = hash_block(parent, toks)
            block = self.blocks[seq.block_table[i]]
            if not block.hash:
                block.hash, block.token_ids = parent, toks
                self.hash_to_block.setdefault(parent, block.block_id)
            assert block.hash == parent, f"block {block.block_id} holds other tokens"
        seq.num_hashed_blocks = n_full

    # invariants
    def counts(self) -> BlockCounts:
        """The blocks in each state, from the free queue's length and `num_cached_free`."""
        idle, cached = len(self.free_queue), self.num_cached_free
        return BlockCounts(idle - cached, cached, self.num_blocks - idle, self.num_blocks)

    def walk_counts(self) -> BlockCounts:
        """`counts` by looking at every block (check_integrity)."""
        free = cached = used = 0
        for b in self.blocks:
            if b.ref_count > 0:
                used += 1
            elif b.hash:
                cached += 1
            else:
                free += 1
        return BlockCounts(free, cached, used, self.num_blocks)

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> BlockCounts:
        """Assert the pool's invariants; `expected_refs` (block -> refs held by sequences and
        pins) is checked exactly when given."""
        c = self.walk_counts()
        assert c == self.counts(), f"kept counts {self.counts()}, walked {c}"
        assert c.free + c.cached_free + c.in_use == c.total
        assert len(self.free_queue) == c.free + c.cached_free
        for bid in self.free_queue:
            assert self.blocks[bid].ref_count == 0, f"block {bid} in free queue but referenced"
        for h, bid in self.hash_to_block.items():
            assert self.blocks[bid].hash == h, f"hash index points to block {bid} with other hash"
        for b in self.blocks:
            assert b.ref_count >= 0
            assert bool(b.hash) == bool(b.token_ids)
            if expected_refs is not None:
                want = expected_refs.get(b.block_id, 0)
                assert b.ref_count == want, f"block {b.block_id}: {b.ref_count} refs, want {want}"
        return c
