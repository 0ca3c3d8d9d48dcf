"""Block manager: which physical KV blocks each sequence owns, on the device and in host swap.

It keeps every sequence's block table, by sequence id (as vLLM v1's KV cache manager does); a
sequence holds only its tokens and how many of them are computed (`TokenSeq`), so a draft
model's view of a sequence is just another id in the draft's own block manager.

    sequence tokens   [t0 .. t15][t16 .. t31][t32 t33 _ _ ...]
    block_table          7          2           9              (logical i -> physical id)
    ref_count[7] = 3  (a system prompt shared by three sequences)

Full blocks are keyed by sha256(parent block's key, the block's tokens), a fingerprint of the
whole prefix up to the block's end, so two sequences whose prompts share a prefix map it to the
same physical blocks (prefix caching). A hit also compares the parent key and the tokens the
block was registered with, so even a colliding key never serves a block that holds other
tokens or follows another parent. A freed block keeps its key and contents until it is reused, so a
later request can still hit it. Free blocks wait in two queues, each least-recently-freed first:
blocks no later admission has found in the cache (a user's own message, a one-off prompt,
generated text) and blocks one has (a shared system prompt, a conversation that came back, a
preempted request's own prefix). The first queue is
evicted first, so the one-off tails of finished requests never push out a prefix that requests
keep sharing (a segmented LRU: the second queue is evicted, oldest first, only when the first is
empty, so a prefix nobody uses any more still ages out under pressure). Forked siblings share every block, including the partially filled last one; the
first write into a shared block copies it (copy-on-write). The manager only moves block ids
around: the copies it asks for are returned to the caller, which has the cache engine carry
them out before the next forward pass.

A sequence's logical blocks are its device blocks followed by its host blocks:

    block_table [7, 2]   host_block_table [40, 41, 42]     logical blocks 0-1 on the device,
                                                           2-4 in host memory

A swapped-out sequence has only host blocks. A layer-wise prefill (engine/layerwise.py) keeps
its prefix-cache hits on the device and writes the rest straight to host blocks; while it
computes, it borrows "staging" blocks, whole device blocks whose per-layer slices hold any
layer's K/V for the length of one step.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Iterable, Protocol


class TokenSeq(Protocol):
    """What the block manager reads of a sequence (a Sequence, or a draft model's view of one)."""

    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int  # tokens with K/V in the cache; this step's slots start here


def block_hash(parent: bytes | None, tokens: tuple[int, ...]) -> bytes:
    """The prefix-cache key of a full block: sha256 of its parent's key and its token ids."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    """Device blocks with reference counts and a prefix cache; host blocks for swap; the block
    tables of every sequence that holds any."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 watermark: float = 0.01, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        # per block while the prefix cache knows it: (its key, its parent's key, its token ids)
        self.cached: list[tuple[bytes, bytes | None, tuple[int, ...]] | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        # free blocks, eviction order first: never hit by a second request, then hit ("shared")
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.free_shared: OrderedDict[int, None] = OrderedDict()
        self.shared = bytearray(num_blocks)  # 1: a cached block some admission hit, until evicted
        self.free_host: list[int] = list(range(num_host_blocks - 1, -1, -1))  # pop() -> lowest id
        self.tables: dict[int, list[int]] = {}  # seq_id -> device blocks, in logical order
        self.host_tables: dict[int, list[int]] = {}  # seq_id -> host blocks, after the device ones
        self.keys: dict[int, list[bytes]] = {}  # seq_id -> keys of its blocks offered to the cache
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) device copies, copy-on-write
        self.staging: list[int] = []  # device blocks lent to this step's layer-wise prefills
        # blocks match_prefix attached, every call (re-admissions too); the per-request count
        # the engine reports is the scheduler's num_prefix_hit_tokens
        self.prefix_hits = 0

    # ---- accounting ----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-unused ones included)."""
        return len(self.free_queue) + len(self.free_shared)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self.free_host)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's device blocks in logical order ([] when it holds none); read only."""
        return self.tables.get(seq_id, [])

    def host_block_table(self, seq_id: int) -> list[int]:
        """The sequence's host blocks, which follow its device blocks; read only."""
        return self.host_tables.get(seq_id, [])

    # ---- allocation ----------------------------------------------------------------------
    def _take_free_block(self) -> int:
        queue = self.free_queue if self.free_queue else self.free_shared
        block, _ = queue.popitem(last=False)
        self.shared[block] = 0
        if self.cached[block] is not None:  # evict it from the prefix cache
            key = self.cached[block][0]
            if self.hash_to_block.get(key) == block:
                del self.hash_to_block[key]
            self.cached[block] = None
        assert self.ref_count[block] == 0
        self.ref_count[block] = 1
        return block

    def _release(self, block: int) -> None:
        assert self.ref_count[block] > 0, f"double free of block {block}"
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            (self.free_shared if self.shared[block] else self.free_queue)[block] = None

    def _block_tokens(self, seq: TokenSeq, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _lookup(self, key: bytes, parent: bytes | None, tokens: tuple[int, ...]) -> int | None:
        """The cached block under `key`, if it was registered with this parent and these tokens:
        a key collision must not serve another prefix's K/V."""
        block = self.hash_to_block.get(key)
        if block is None or self.cached[block][1:] != (parent, tokens):
            return None
        return block

    def match_prefix(self, seq: TokenSeq) -> int:
        """Attach cached blocks for the longest cached prefix of a sequence that holds none.

        The last token is never taken from the cache, so a forward pass still produces its
        logits. Returns:
            the number of tokens the attached blocks hold; the caller counts them computed.
        """
        assert not self.tables.get(seq.seq_id) and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        table, keys, parent = [], [], None
        for i in range((len(seq.token_ids) - 1) // self.block_size):
            tokens = self._block_tokens(seq, i)
            key = block_hash(parent, tokens)
            block = self._lookup(key, parent, tokens)
            if block is None:
                break
            if self.ref_count[block] == 0:
                del (self.free_shared if self.shared[block] else self.free_queue)[block]
            self.shared[block] = 1
            self.ref_count[block] += 1
            table.append(block)
            keys.append(key)
            parent = key
        if table:
            self.tables[seq.seq_id], self.keys[seq.seq_id] = table, keys
        self.prefix_hits += len(table)
        return len(table) * self.block_size

    def can_allocate(self, seq: TokenSeq, num_new_tokens: int, watermark: bool = False) -> bool:
        need = self._new_blocks_for(seq, num_new_tokens)
        reserve = self.watermark_blocks if watermark else 0
        return self.num_free_blocks - need >= reserve

    def _new_blocks_for(self, seq: TokenSeq, num_new_tokens: int) -> int:
        total = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        need = max(0, total - len(self.block_table(seq.seq_id)))
        if num_new_tokens and self._writes_shared_block(seq):
            need += 1
        return need

    def _writes_shared_block(self, seq: TokenSeq) -> bool:
        """Will the next write land in a partially filled block that another sequence holds?"""
        table = self.block_table(seq.seq_id)
        i = seq.num_computed_tokens // self.block_size
        if seq.num_computed_tokens % self.block_size == 0 or i >= len(table):
            return False
        return self.ref_count[table[i]] > 1

    def allocate_slots(self, seq: TokenSeq, num_new_tokens: int, watermark: bool = False
                       ) -> bool:
        """Make the block table cover `num_new_tokens` more tokens, all or nothing.

        Args:
            seq: the sequence; slots start at seq.num_computed_tokens.
            num_new_tokens: tokens to be computed this step.
            watermark: keep `watermark_blocks` free (used when admitting new work).
        Returns:
            False (and nothing changed) when not enough free blocks.
        """
        if not self.can_allocate(seq, num_new_tokens, watermark):
            return False
        table = self.tables.setdefault(seq.seq_id, [])
        if num_new_tokens and self._writes_shared_block(seq):  # copy-on-write
            i = seq.num_computed_tokens // self.block_size
            src, dst = table[i], self._take_free_block()
            self._release(src)
            table[i] = dst
            self.pending_copies.append((src, dst))
        total = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        table.extend(self._take_free_block() for _ in range(total - len(table)))
        return True

    def commit_computed_blocks(self, seq: TokenSeq) -> None:
        """Register every newly full, computed device block of `seq` in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self.block_table(seq.seq_id)
        keys = self.keys.setdefault(seq.seq_id, [])
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        for i in range(len(keys), min(num_full, len(table))):  # host blocks are not shareable
            parent = keys[-1] if keys else None
            tokens = self._block_tokens(seq, i)
            key = block_hash(parent, tokens)
            keys.append(key)
            block = table[i]
            if key not in self.hash_to_block and self.cached[block] is None:
                self.hash_to_block[key] = block
                self.cached[block] = (key, parent, tokens)

    def trim(self, seq: TokenSeq) -> None:
        """Give back the blocks past the sequence's computed tokens: those that only held
        speculative tokens the target rejected. Never registered in the prefix cache, they go
        to the front of the free queue (reused first)."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        table = self.block_table(seq.seq_id)
        assert keep >= len(self.keys.get(seq.seq_id, ())), "trim would drop a committed block"
        for block in table[keep:]:
            self._release_uncached(block)
        del table[keep:]

    def _release_uncached(self, block: int) -> None:
        """Release a block; if that frees one holding nothing the prefix cache knows, it goes to
        the front of the free queue (reused first)."""
        self._release(block)
        if self.ref_count[block] == 0 and self.cached[block] is None:
            self.free_queue.move_to_end(block, last=False)

    def free(self, seq: TokenSeq) -> None:
        """Drop the sequence's blocks; device blocks tail first, so they are evicted before
        the (more shareable) head of the prefix."""
        for block in reversed(self.tables.pop(seq.seq_id, [])):
            self._release(block)
        self.free_host.extend(self.host_tables.pop(seq.seq_id, []))
        self.keys.pop(seq.seq_id, None)

    def fork(self, parent: TokenSeq, child: TokenSeq) -> None:
        """Give `child` every block of `parent` (which holds no host blocks)."""
        assert not self.host_block_table(parent.seq_id) and child.seq_id not in self.tables
        table = self.tables[child.seq_id] = list(self.block_table(parent.seq_id))
        self.keys[child.seq_id] = list(self.keys.get(parent.seq_id, ()))
        for block in table:
            self.ref_count[block] += 1

    # ---- swap ------------------------------------------------------------------------------
    def can_swap_out(self, seq: TokenSeq) -> bool:
        return len(self.block_table(seq.seq_id)) <= self.num_free_host_blocks

    def swap_out(self, seq: TokenSeq) -> list[tuple[int, int]]:
        """Move a sequence's device blocks to host memory, in front of any it has there.

        Returns:
            (device block, host block) pairs to copy before the device blocks are reused.
        """
        assert self.can_swap_out(seq)
        table = self.tables.pop(seq.seq_id, [])
        hosts = [self.free_host.pop() for _ in table]
        for block in reversed(table):
            self._release(block)
        self.host_tables[seq.seq_id] = hosts + self.host_block_table(seq.seq_id)
        self.keys.pop(seq.seq_id, None)  # its blocks are offered again once back
        return list(zip(table, hosts))

    def can_swap_in(self, seq: TokenSeq, num_new_tokens: int = 0, watermark: bool = True
                    ) -> bool:
        have = len(self.block_table(seq.seq_id))
        need = max(have + len(self.host_block_table(seq.seq_id)),
                   self.blocks_needed(seq.num_computed_tokens + num_new_tokens)) - have
        return self.num_free_blocks - need >= (self.watermark_blocks if watermark else 0)

    def swap_in(self, seq: TokenSeq) -> list[tuple[int, int]]:
        """Bring a sequence's host blocks back to the device, after the device blocks it has.

        Returns:
            (host block, device block) pairs to copy.
        """
        hosts = self.host_tables.pop(seq.seq_id, [])
        assert len(hosts) <= self.num_free_blocks
        mapping = [(host, self._take_free_block()) for host in hosts]
        self.tables.setdefault(seq.seq_id, []).extend(block for _, block in mapping)
        self.free_host.extend(hosts)
        return mapping

    # ---- layer-wise prefill ----------------------------------------------------------------
    def host_blocks_for(self, seq: TokenSeq, num_new_tokens: int) -> int:
        """Host blocks a layer-wise prefill needs beyond the ones it holds to compute
        `num_new_tokens` more tokens."""
        total = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        held = len(self.block_table(seq.seq_id)) + len(self.host_block_table(seq.seq_id))
        return max(0, total - held)

    def allocate_host_slots(self, seq: TokenSeq, num_new_tokens: int) -> bool:
        """Grow the host tail to cover `num_new_tokens` more tokens, all or nothing."""
        need = self.host_blocks_for(seq, num_new_tokens)
        if need > self.num_free_host_blocks:
            return False
        if need:
            tail = self.host_tables.setdefault(seq.seq_id, [])
            tail.extend(self.free_host.pop() for _ in range(need))
        return True

    def take_staging(self, num_blocks: int) -> bool:
        """Lend `num_blocks` more free device blocks to this step's staging, all or nothing."""
        if num_blocks > self.num_free_blocks:
            return False
        self.staging.extend(self._take_free_block() for _ in range(num_blocks))
        return True

    def release_staging(self) -> None:
        """Give the staging blocks back once the step's copies out of them are done; they held
        nothing worth caching, so they are reused first."""
        for block in self.staging:
            self._release_uncached(block)
        self.staging = []

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def check_invariants(self, live: Iterable[TokenSeq] = ()) -> None:
        """Only `live` sequences hold blocks, reference counts equal the block-table entries,
        and the prefix cache's two maps agree (test helper)."""
        owners = set(self.tables) | set(self.host_tables) | set(self.keys)
        assert owners <= {seq.seq_id for seq in live}, "blocks held by a finished sequence"
        counts = [0] * self.num_blocks
        for block in self.staging:
            counts[block] += 1
        for table in self.tables.values():
            for block in table:
                counts[block] += 1
        assert counts == self.ref_count, "ref counts out of step with block tables"
        assert all((c == 0) == (b in self.free_queue or b in self.free_shared)
                   for b, c in enumerate(counts))
        assert not set(self.free_queue) & set(self.free_shared)
        assert all(self.shared[b] for b in self.free_shared)
        host = sum(len(tail) for tail in self.host_tables.values())
        assert host + self.num_free_host_blocks == self.num_host_blocks
        assert all(self.cached[b][0] == key for key, b in self.hash_to_block.items())
        assert all(len(keys) <= len(self.block_table(i)) for i, keys in self.keys.items())
