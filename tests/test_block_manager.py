"""Block manager on a tiny pool: exact block ids, reference counts, prefix hits (and that a
hash collision serves no wrong block), copy-on-write, swap and eviction order. No model
involved."""
import pytest

from qserve.engine import block_manager
from qserve.engine.block_manager import BlockManager
from qserve.engine.sequence import Sequence
from qserve.sampling_params import SamplingParams

BS = 4  # tokens per block


def make_seq(tokens, rid="r"):
    return Sequence(rid, 0, list(tokens), len(tokens), SamplingParams())


def hit(bm, seq):
    """Attach the sequence's prefix-cache hits, as the scheduler does; returns their tokens."""
    seq.num_computed_tokens = bm.match_prefix(seq)
    return seq.num_computed_tokens


def compute(bm, seq, n=None):
    """Pretend a forward pass computed n more tokens (default: all of them)."""
    n = seq.num_tokens - seq.num_computed_tokens if n is None else n
    assert bm.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    bm.commit_computed_blocks(seq)


def test_allocate_exact_ids_and_free_order():
    bm = BlockManager(num_blocks=11, block_size=BS, watermark=0.0)
    a = make_seq(range(10))  # 3 blocks
    assert bm.allocate_slots(a, 10)
    assert bm.block_table(a.seq_id) == [0, 1, 2]
    b = make_seq(range(100, 105))  # 2 blocks
    assert bm.allocate_slots(b, 5)
    assert bm.block_table(b.seq_id) == [3, 4]
    assert bm.num_free_blocks == 6
    bm.free(a)
    # freed tail-first: block 2 is evicted before 1, before 0
    assert list(bm.free_queue)[-3:] == [2, 1, 0]
    bm.check_invariants([b])


def test_all_or_nothing_when_pool_runs_out():
    bm = BlockManager(num_blocks=3, block_size=BS, watermark=0.0)
    a = make_seq(range(13))  # needs 4 blocks
    assert not bm.allocate_slots(a, 13)
    assert bm.block_table(a.seq_id) == [] and bm.num_free_blocks == 3
    assert bm.allocate_slots(a, 12)
    assert bm.block_table(a.seq_id) == [0, 1, 2]


def test_prefix_sharing_and_ref_counts():
    bm = BlockManager(num_blocks=11, block_size=BS, watermark=0.0)
    system = list(range(8))  # two full blocks of shared prefix
    a = make_seq(system + [50, 51, 52])
    compute(bm, a)
    assert bm.block_table(a.seq_id) == [0, 1, 2]
    b = make_seq(system + [60, 61])
    assert hit(bm, b) == 8
    assert bm.block_table(b.seq_id) == [0, 1]
    assert bm.ref_count[:3] == [2, 2, 1]
    compute(bm, b)
    assert bm.block_table(b.seq_id) == [0, 1, 3]
    assert bm.prefix_hits == 2
    bm.check_invariants([a, b])
    bm.free(a)
    assert bm.ref_count[:4] == [1, 1, 0, 1]
    bm.free(b)
    bm.check_invariants([])
    # the freed blocks still hold the prefix: a new request hits it
    c = make_seq(system + [70])
    assert hit(bm, c) == 8 and bm.block_table(c.seq_id) == [0, 1]


def test_last_token_is_never_a_cache_hit():
    bm = BlockManager(num_blocks=11, block_size=BS, watermark=0.0)
    a = make_seq(range(8))
    compute(bm, a)
    b = make_seq(range(8))  # the whole prompt is cached, but its last token must run
    assert hit(bm, b) == 4
    assert bm.block_table(b.seq_id) == [0]


def test_cached_block_evicted_only_when_reused_lru():
    bm = BlockManager(num_blocks=4, block_size=BS, watermark=0.0)
    a = make_seq(range(8))
    compute(bm, a)
    bm.free(a)  # free queue now: 2, 3, 1, 0 (1 and 0 still cached)
    assert list(bm.free_queue) == [2, 3, 1, 0]
    b = make_seq(range(100, 112))  # 3 blocks: takes 2, 3, then evicts 1
    assert bm.allocate_slots(b, 12)
    assert bm.block_table(b.seq_id) == [2, 3, 1]
    c = make_seq(list(range(8)) + [9])
    assert hit(bm, c) == 4  # block 0 survived, block 1 was evicted
    assert bm.block_table(c.seq_id) == [0]


def test_fork_shares_blocks_and_copy_on_write():
    bm = BlockManager(num_blocks=11, block_size=BS, watermark=0.0)
    parent = make_seq(range(6))  # blocks 0 (full), 1 (2 of 4 slots)
    compute(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    assert bm.block_table(child.seq_id) == [0, 1] and bm.ref_count[:2] == [2, 2]
    parent.append_token(7)
    assert bm.allocate_slots(parent, 1)
    # parent writes into shared block 1: it gets a private copy (block 2), copy queued
    assert bm.block_table(parent.seq_id) == [0, 2]
    assert bm.take_pending_copies() == [(1, 2)]
    assert bm.ref_count[:3] == [2, 1, 1]
    child.append_token(8)
    assert bm.allocate_slots(child, 1)
    assert bm.block_table(child.seq_id) == [0, 1]  # block 1, no longer shared: written in place
    assert bm.take_pending_copies() == []
    bm.check_invariants([parent, child])


def test_swap_out_and_in_moves_every_block():
    bm = BlockManager(num_blocks=6, block_size=BS, num_host_blocks=4, watermark=0.0)
    a = make_seq(range(10))
    compute(bm, a)
    assert bm.block_table(a.seq_id) == [0, 1, 2]
    assert bm.can_swap_out(a)
    out = bm.swap_out(a)
    assert out == [(0, 0), (1, 1), (2, 2)]
    assert bm.block_table(a.seq_id) == [] and bm.host_block_table(a.seq_id) == [0, 1, 2]
    assert bm.num_free_blocks == 6 and bm.num_free_host_blocks == 1
    b = make_seq(range(50, 54))
    compute(bm, b)
    assert bm.can_swap_in(a, 1)
    back = bm.swap_in(a)
    assert [h for h, _ in back] == [0, 1, 2]
    a_table, b_table = bm.block_table(a.seq_id), bm.block_table(b.seq_id)
    assert a_table == [d for _, d in back] and not set(a_table) & set(b_table)
    assert bm.num_free_host_blocks == 4
    bm.check_invariants([a, b])


def test_host_pool_too_small_for_swap():
    bm = BlockManager(num_blocks=6, block_size=BS, num_host_blocks=2, watermark=0.0)
    a = make_seq(range(10))
    compute(bm, a)
    assert not bm.can_swap_out(a)


def test_watermark_reserves_blocks_for_admission_only():
    bm = BlockManager(num_blocks=10, block_size=BS, watermark=0.2)  # keep 2 free
    a = make_seq(range(32))  # 8 blocks would leave 2: allowed
    assert bm.allocate_slots(a, 32, watermark=True)
    b = make_seq(range(4))
    assert not bm.allocate_slots(b, 4, watermark=True)
    assert bm.allocate_slots(b, 4)  # a running sequence may dig into the reserve


@pytest.mark.parametrize("chunk", [1, 3, 4, 7])
def test_chunked_allocation_matches_whole(chunk):
    bm = BlockManager(num_blocks=11, block_size=BS, watermark=0.0)
    a = make_seq(range(23))
    while a.num_computed_tokens < a.num_tokens:
        compute(bm, a, min(chunk, a.num_tokens - a.num_computed_tokens))
    assert bm.block_table(a.seq_id) == list(range(6))
    assert len(bm.keys[a.seq_id]) == 5  # five full blocks registered
    bm.check_invariants([a])


def test_shared_prefix_outlives_one_off_tails():
    """Blocks a later request hit are evicted only after every block no request reused, even
    ones freed later: a finished user's own tail does not push out the system prompt."""
    bm = BlockManager(num_blocks=8, block_size=BS, watermark=0.0)
    system = list(range(8))  # 2 blocks
    a = make_seq(system + [40, 41, 42, 43, 44])
    compute(bm, a)  # blocks 0, 1 (system), 2, 3 (a's own)
    b = make_seq(system + [50, 51, 52, 53, 54])
    assert hit(bm, b) == 8
    compute(bm, b)  # hits 0, 1; own 4, 5
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])
    assert list(bm.free_shared) == [1, 0] and 1 not in bm.free_queue
    # a one-off request, freed after the system prompt: its blocks still go first
    c = make_seq(range(100, 108))
    compute(bm, c)  # blocks 6, 7
    bm.free(c)
    d = make_seq(range(200, 224))  # 6 blocks: every one-off block, none of the prompt's
    assert bm.allocate_slots(d, 24)
    assert sorted(bm.block_table(d.seq_id)) == [2, 3, 4, 5, 6, 7]
    f = make_seq(system + [60])
    assert hit(bm, f) == 8 and bm.block_table(f.seq_id) == [0, 1]
    bm.check_invariants([d, f])
    # with nothing else free, the shared blocks are evicted too, oldest first (tail first)
    bm2 = BlockManager(num_blocks=4, block_size=BS, watermark=0.0)
    a2, b2 = make_seq(system + [1]), make_seq(system + [2])
    compute(bm2, a2)
    assert hit(bm2, b2) == 8
    bm2.free(a2)
    bm2.free(b2)
    e = make_seq(range(300, 312))  # 3 blocks: both one-off ones, then shared block 1
    assert bm2.allocate_slots(e, 12)
    assert bm2.block_table(e.seq_id)[-1] == 1 and not bm2.shared[1]
    g = make_seq(system + [3])
    assert hit(bm2, g) == 4 and bm2.block_table(g.seq_id) == [0]  # block 0 survived
    bm2.check_invariants([e, g])


def test_trim_returns_blocks_of_rejected_speculative_tokens():
    bm = BlockManager(num_blocks=11, block_size=BS, watermark=0.0)
    a = make_seq(range(7))
    compute(bm, a)  # 7 tokens: blocks [0, 1], block 0 committed
    a.add_spec_tokens([50, 51, 52, 53, 54, 55])  # drafts reach position 12: 4 blocks
    assert bm.allocate_slots(a, 6)
    assert bm.block_table(a.seq_id) == [0, 1, 2, 3]
    a.pop_spec_tokens()
    a.num_computed_tokens = 8  # one draft accepted
    a.append_token(60)
    bm.trim(a)
    assert bm.block_table(a.seq_id) == [0, 1]
    # never committed, so nothing can hit them: first in line for reuse, last freed first
    assert list(bm.free_queue)[:2] == [3, 2]
    bm.check_invariants([a])
    bm.trim(a)  # nothing past the computed tokens: a no-op
    assert bm.block_table(a.seq_id) == [0, 1]


def test_hash_collision_serves_no_wrong_block(monkeypatch):
    """Every block gets the same key: a hit still needs the parent key and the tokens the block
    was registered with, so a colliding block is a miss, never another prefix's K/V."""
    monkeypatch.setattr(block_manager, "block_hash", lambda parent, tokens: b"collide")
    bm = BlockManager(num_blocks=11, block_size=BS, watermark=0.0)
    a = make_seq([1, 2, 3, 4] * 2 + [9])  # blocks 0 and 1 hold the same tokens
    compute(bm, a)
    assert bm.block_table(a.seq_id) == [0, 1, 2]
    assert bm.hash_to_block == {b"collide": 0}  # block 1's key was taken: not registered
    b = make_seq([5, 6, 7, 8, 9])  # the key finds block 0, whose tokens differ
    assert hit(bm, b) == 0 and bm.block_table(b.seq_id) == []
    c = make_seq([1, 2, 3, 4] * 2 + [10])
    # block 0 is c's first block indeed; for c's second, the key finds block 0 again, with the
    # right tokens but registered as a first block (no parent): a miss, not a second hit
    assert hit(bm, c) == 4 and bm.block_table(c.seq_id) == [0]
    assert bm.prefix_hits == 1
    compute(bm, b)
    compute(bm, c)
    assert bm.block_table(b.seq_id) == [3, 4] and bm.block_table(c.seq_id) == [0, 5, 6]
    bm.check_invariants([a, b, c])


def test_prefix_key_covers_the_whole_prefix():
    """Equal blocks after different prefixes are different cache entries."""
    bm = BlockManager(num_blocks=11, block_size=BS, watermark=0.0)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    compute(bm, a)
    b = make_seq([9, 9, 9, 9, 5, 6, 7, 8, 0])  # block 1 equals a's block 1
    assert hit(bm, b) == 0
    compute(bm, b)
    assert bm.block_table(b.seq_id) == [3, 4, 5] and len(bm.hash_to_block) == 4
    assert block_manager.block_hash(None, (1, 2)) != block_manager.block_hash(None, (2, 1))
