"""Block manager and scheduler invariants under random operation sequences."""

import random

import pytest

from duplexkv.engine.block_manager import BlockManager, hash_token_blocks
from duplexkv.wire.sampling import SamplingParams
from duplexkv.engine.scheduler import Scheduler
from duplexkv.engine.sequence import Sequence

BS = 4


def make_seq(i, tokens):
    return Sequence(f"s{i}", list(tokens), SamplingParams(max_tokens=8), BS)


def test_hash_chain_depends_on_prefix_and_seed():
    a = hash_token_blocks(b"seed", [1, 2, 3, 4, 5, 6, 7, 8], BS)
    b = hash_token_blocks(b"seed", [9, 2, 3, 4, 5, 6, 7, 8], BS)
    c = hash_token_blocks(b"other", [1, 2, 3, 4, 5, 6, 7, 8], BS)
    assert len(a) == 2 and a[1] != b[1] and a[0] != c[0]
    assert hash_token_blocks(b"seed", [1, 2, 3], BS) == []


def test_prefix_hit_revives_freed_blocks_and_eviction_is_lru():
    bm = BlockManager(4, BS, True, b"s")
    seq = make_seq(0, range(8))
    assert bm.allocate_for(seq, 8)
    seq.num_computed_tokens = 8
    bm.cache_blocks(seq)
    first = list(seq.block_table)
    bm.free(seq)
    assert bm.counts().cached_free == 2
    assert bm.match_prefix(list(range(8))) == first
    assert bm.match_prefix([0, 1, 2, 3, 9, 9, 9, 9]) == first[:1]
    # allocating all 4 blocks evicts the cached ones; the hash index forgets them
    taken = bm.allocate(4)
    assert sorted(taken) == [0, 1, 2, 3]
    assert bm.match_prefix(list(range(8))) == []
    assert bm.num_evicted == 2
    bm.check_integrity({b: 1 for b in taken})


def test_pins_keep_blocks_out_of_eviction():
    bm = BlockManager(3, BS, True, b"s")
    seq = make_seq(0, range(8))
    bm.allocate_for(seq, 8)
    seq.num_computed_tokens = 8
    bm.cache_blocks(seq)
    held = list(seq.block_table)
    bm.pin(held)
    bm.free(seq)
    assert not bm.can_allocate(2)
    bm.unpin(held)
    assert bm.can_allocate(3)
    bm.check_integrity({})


def test_disabled_prefix_cache_never_hits():
    bm = BlockManager(4, BS, False, b"s")
    seq = make_seq(0, range(8))
    bm.allocate_for(seq, 8)
    seq.num_computed_tokens = 8
    bm.cache_blocks(seq)
    bm.free(seq)
    assert bm.match_prefix(list(range(8))) == []
    assert bm.counts().cached_free == 0


@pytest.mark.parametrize("seed", range(5))
def test_random_block_operations_keep_integrity(seed):
    rng = random.Random(seed)
    bm = BlockManager(32, BS, True, b"s")
    live: list[Sequence] = []
    pins: list[list[int]] = []
    shared = [rng.randrange(50) for _ in range(12)]
    for step in range(400):
        op = rng.random()
        if op < 0.4:
            toks = (shared[: rng.randint(0, 12)] if rng.random() < 0.5 else []) + \
                [rng.randrange(50) for _ in range(rng.randint(1, 20))]
            seq = make_seq(step, toks)
            hits = bm.match_prefix(toks, (len(toks) - 1) // BS)
            bm.acquire(hits)
            seq.block_table = list(hits)
            seq.num_computed_tokens = len(hits) * BS
            seq.num_hashed_blocks = len(hits)
            if bm.allocate_for(seq, len(toks)):
                seq.num_computed_tokens = len(toks)
                bm.cache_blocks(seq)
                live.append(seq)
            else:
                bm.free(seq)
        elif op < 0.7 and live:
            bm.free(live.pop(rng.randrange(len(live))))
        elif op < 0.8 and live:
            pins.append(list(rng.choice(live).block_table))
            bm.pin(pins[-1])
        elif op < 0.9 and pins:
            bm.unpin(pins.pop(rng.randrange(len(pins))))
        refs: dict[int, int] = {}
        for ids in [s.block_table for s in live] + pins:
            for b in ids:
                refs[b] = refs.get(b, 0) + 1
        bm.check_integrity(refs)
        # every cached block's tokens are what its hash says
        for s in live:
            want = hash_token_blocks(b"s", s.all_token_ids, BS)
            for i, h in enumerate(want):
                blk = bm.blocks[s.block_table[i]]
                assert blk.hash == h and list(blk.token_ids) == s.block_tokens(i)


@pytest.mark.parametrize("seed", range(3))
def test_scheduler_random_workload_finishes_with_integrity(seed):
    rng = random.Random(seed)
    bm = BlockManager(24, BS, True, b"s")
    sched = Scheduler(bm, max_num_batched_tokens=10, max_num_seqs=5)
    seqs = [make_seq(i, [rng.randrange(30) for _ in range(rng.randint(1, 30))]) for i in range(15)]
    for s in seqs:
        s.params = SamplingParams(max_tokens=rng.randint(1, 12))
        sched.add(s)
    for _ in range(2000):
        if not sched.has_work:
            break
        batch = sched.schedule()
        assert batch, "scheduler stalled with work left"
        assert sum(b.num_new_tokens for b in batch) <= 10
        assert len({id(b.seq) for b in batch}) == len(batch)
        for b in batch:
            assert b.seq.num_blocks * BS >= b.start + b.num_new_tokens
            b.seq.num_computed_tokens += b.num_new_tokens
            bm.cache_blocks(b.seq)
            if b.samples:
                b.seq.output_token_ids.append(rng.randrange(30))
                if b.seq.num_output_tokens >= b.seq.params.max_tokens:
                    sched.finish(b.seq, "length")
        bm.check_integrity(sched.refs_held())
    assert not sched.has_work
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert bm.counts().in_use == 0


def test_remote_kv_does_not_starve_older_waiting_requests():
    """Remote KV reserved blocks as soon as a pull was verified, past the waiting queue, and a
    declined pull went back to the queue's front: under pressure the oldest request waited behind
    every newer one (a 10-minute soak had 18 requests time out after 300 s). Now a younger pull
    may not take blocks while an older request is blocked, and resumed requests keep their
    arrival order."""
    bm = BlockManager(8, BS, False, b"s")
    sched = Scheduler(bm, max_num_batched_tokens=1024, max_num_seqs=8)
    hog = make_seq(0, range(5 * BS))  # runs and holds 5 of 8 blocks
    sched.add(hog)
    assert [x.seq for x in sched.schedule()] == [hog]
    old = make_seq(1, range(100, 100 + 4 * BS))  # needs 4: blocked behind the hog
    sched.add(old)
    young = make_seq(2, range(200, 200 + 2 * BS))  # arrives later, pulls remote KV
    sched.park_for_remote_kv(young)
    assert sched.schedule()[0].seq is hog  # hog decodes; old cannot be admitted
    assert sched.blocked_head is old
    assert sched.reserve_for_remote_kv(young, 2 * BS) is None  # would have fit: 3 blocks free
    sched.resume(young)  # declined: recompute, in arrival order behind `old`
    assert list(sched.waiting) == [old, young]
    sched.finish(hog, "stop")
    batch = [x.seq for x in sched.schedule()]
    assert batch[0] is old


def test_landed_remote_kv_runs_first_so_a_full_pool_cannot_lock():
    """Requests whose remote KV landed hold their blocks; queued by arrival behind an older
    request that needs more blocks than are free, none could ever run (a soak locked D with 40
    waiting requests and 1015 of 1024 blocks in use). They go to the front instead."""
    bm = BlockManager(8, BS, False, b"s")
    sched = Scheduler(bm, max_num_batched_tokens=1024, max_num_seqs=8)
    old = make_seq(0, range(6 * BS))  # needs 6 blocks
    young = make_seq(1, range(100, 100 + 4 * BS))  # pulls 4 blocks' worth of remote KV
    sched.park_for_remote_kv(young)
    assert sched.reserve_for_remote_kv(young, 4 * BS) is not None  # nobody is blocked yet
    sched.add(old)
    sched.resume(young, 4 * BS - 1)  # landed: all but the last token computed
    assert list(sched.waiting) == [young, old]
    assert [x.seq for x in sched.schedule()] == [young]  # old waits for young to finish
    sched.finish(young, "stop")
    assert [x.seq for x in sched.schedule()] == [old]


def test_requests_holding_their_blocks_pass_a_blocked_head():
    """A preempted request (no blocks, needs many) at the head and requests behind it holding
    their landed remote KV: strict first-in-first-out admission locked a soak's D (40 waiting,
    0 running, 995 of 1024 blocks held by the queue). Those holding their blocks may pass."""
    bm = BlockManager(8, BS, False, b"s")
    sched = Scheduler(bm, max_num_batched_tokens=1024, max_num_seqs=8)
    landed = make_seq(1, range(100, 100 + 4 * BS))
    sched.park_for_remote_kv(landed)
    assert sched.reserve_for_remote_kv(landed, 4 * BS) is not None
    sched.resume(landed, 4 * BS - 1)
    head = make_seq(0, range(6 * BS))  # needs 6 of the 4 free blocks
    sched.waiting.appendleft(head)  # as a preempted request goes back
    assert [x.seq for x in sched.schedule()] == [landed]
    assert sched.blocked_head is head and list(sched.waiting) == [head]
    sched.finish(landed, "stop")
    assert [x.seq for x in sched.schedule()] == [head]


def test_waiting_requests_holding_all_blocks_give_them_up_rather_than_lock():
    """Two requests whose remote KV landed hold every block between them, and each needs one
    more for its last prompt token: neither could run, nothing ran to free a block, and D
    stood still (a soak: 0 running, 40 waiting, ~1,000 of 1,024 blocks held). The newest
    gives its blocks up and recomputes later; the older runs now."""
    bm = BlockManager(8, BS, False, b"s")
    sched = Scheduler(bm, max_num_batched_tokens=1024, max_num_seqs=8)
    older = make_seq(0, range(4 * BS + 1))  # 4 blocks of landed KV + one more token
    newer = make_seq(1, range(100, 100 + 4 * BS + 1))
    for seq in (older, newer):
        sched.park_for_remote_kv(seq)
        assert sched.reserve_for_remote_kv(seq, 4 * BS) is not None
    for seq in (older, newer):
        sched.resume(seq, 4 * BS)
    assert bm.num_free_blocks == 0
    assert [x.seq for x in sched.schedule()] == [older]
    assert newer.block_table == [] and newer.num_computed_tokens == 0
    assert newer.stats.preemptions == 1 and list(sched.waiting) == [newer]
    sched.finish(older, "stop")
    assert [x.seq for x in sched.schedule()] == [newer]  # recomputed from its prompt
    assert sum(bm.blocks[b].ref_count for b in range(8)) == len(newer.block_table)


def test_a_declined_pull_does_not_queue_holding_its_prefix_hits():
    """A D leg parks with its local prefix hit while it asks to pull, the pull is declined (no
    room) and it queues again behind an older request that needs more blocks than are free. It
    used to keep its prefix hits while skipped behind that head: forty such legs held 852 of a
    soak D's 1,024 blocks, the head never got its blocks and nothing ran again."""
    bm = BlockManager(8, BS, True, b"s")
    sched = Scheduler(bm, max_num_batched_tokens=1024, max_num_seqs=8)
    warm = make_seq(9, range(4 * BS + 1))  # leaves its 4 full blocks in the prefix cache
    sched.add(warm)
    assert [x.seq for x in sched.schedule()] == [warm]
    warm.num_computed_tokens = warm.num_tokens
    bm.cache_blocks(warm)
    sched.finish(warm, "stop")
    head = make_seq(0, range(1000, 1000 + 6 * BS))  # older, needs 6 blocks
    leg = make_seq(1, range(4 * BS + 8))  # newer, its first 4 blocks hit the cache
    sched.add(head)
    sched.park_for_remote_kv(leg)
    assert len(leg.block_table) == 4  # the hit, held while parked
    sched.resume(leg)  # the pull was declined
    assert leg.block_table == [] and list(sched.waiting) == [head, leg]
    assert [x.seq for x in sched.schedule()] == [head]


def test_token_ids_slices_as_all_token_ids_does():
    """`Sequence.token_ids(start, stop)` (a step's tokens, without joining prompt and output)
    equals all_token_ids[start:stop] wherever the slice falls."""
    seq = make_seq(0, range(10, 17))
    seq.output_token_ids.extend(range(50, 55))
    everything = seq.all_token_ids
    for start in range(len(everything) + 1):
        for stop in range(start, len(everything) + 2):
            assert seq.token_ids(start, stop) == everything[start:stop], (start, stop)
