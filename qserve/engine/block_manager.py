"""Block manager: which physical KV blocks each sequence owns, on the device and in host swap.

    sequence tokens   [t0 .. t15][t16 .. t31][t32 t33 _ _ ...]
    block_table          7          2           9              (logical i -> physical id)
    ref_count[7] = 3  (a system prompt shared by three sequences)

Full blocks are keyed by hash(parent block's hash, the block's tokens), so two sequences whose
prompts share a prefix map it to the same physical blocks (prefix caching). A freed block keeps
its hash and contents until it is reused, so a later request can still hit it; the free queue is
least-recently-freed first, which is the eviction order. Forked siblings share every block,
including the partially filled last one; the first write into a shared block copies it
(copy-on-write). The manager only moves block ids around: the copies it asks for are returned
to the caller, which has the cache engine carry them out before the next forward pass.

A sequence's logical blocks are its device blocks followed by its host blocks:

    block_table [7, 2]   host_block_table [40, 41, 42]     logical blocks 0-1 on the device,
                                                           2-4 in host memory

A swapped-out sequence has only host blocks. A layer-wise prefill (engine/layerwise.py) keeps
its prefix-cache hits on the device and writes the rest straight to host blocks; while it
computes, it borrows "staging" blocks, whole device blocks whose per-layer slices hold any
layer's K/V for the length of one step.
"""
from __future__ import annotations

from collections import OrderedDict

from qserve.engine.sequence import Sequence


def block_hash(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent_hash, tokens))


class BlockManager:
    """Device blocks with reference counts and a prefix cache; host blocks for swap."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 watermark: float = 0.01, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_to_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.free_host: list[int] = list(range(num_host_blocks - 1, -1, -1))  # pop() -> lowest id
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) device copies, copy-on-write
        self.staging: list[int] = []  # device blocks lent to this step's layer-wise prefills
        self.prefix_hits = 0  # blocks served from the prefix cache

    # ---- accounting ----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-unused ones included)."""
        return len(self.free_queue)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self.free_host)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation ----------------------------------------------------------------------
    def _take_free_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        old_hash = self.block_to_hash[block]
        if old_hash is not None:  # evict it from the prefix cache
            if self.hash_to_block.get(old_hash) == block:
                del self.hash_to_block[old_hash]
            self.block_to_hash[block] = None
        assert self.ref_count[block] == 0
        self.ref_count[block] = 1
        return block

    def _release(self, block: int) -> None:
        assert self.ref_count[block] > 0, f"double free of block {block}"
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free_queue[block] = None

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest cached prefix of a sequence that holds none.

        The last token is never taken from the cache, so a forward pass still produces its
        logits. Returns:
            the number of tokens now counted as computed.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        parent = None
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = block_hash(parent, tokens)
            block = self.hash_to_block.get(h)
            if block is None:
                break
            if self.ref_count[block] == 0:
                del self.free_queue[block]
            self.ref_count[block] += 1
            seq.block_table.append(block)
            if i >= len(seq.block_hashes):
                seq.block_hashes.append(h)
            parent = h
        seq.num_committed_blocks = len(seq.block_table)
        self.prefix_hits += len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        return seq.num_computed_tokens

    def can_allocate(self, seq: Sequence, num_new_tokens: int, watermark: bool = False) -> bool:
        need = self._new_blocks_for(seq, num_new_tokens)
        reserve = self.watermark_blocks if watermark else 0
        return self.num_free_blocks - need >= reserve

    def _new_blocks_for(self, seq: Sequence, num_new_tokens: int) -> int:
        total = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        need = max(0, total - len(seq.block_table))
        if num_new_tokens and self._writes_shared_block(seq):
            need += 1
        return need

    def _writes_shared_block(self, seq: Sequence) -> bool:
        """Will the next write land in a partially filled block that another sequence holds?"""
        i = seq.num_computed_tokens // self.block_size
        if seq.num_computed_tokens % self.block_size == 0 or i >= len(seq.block_table):
            return False
        return self.ref_count[seq.block_table[i]] > 1

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, watermark: bool = False) -> bool:
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
        if num_new_tokens and self._writes_shared_block(seq):  # copy-on-write
            i = seq.num_computed_tokens // self.block_size
            src = seq.block_table[i]
            dst = self._take_free_block()
            self._release(src)
            seq.block_table[i] = dst
            self.pending_copies.append((src, dst))
        total = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        while len(seq.block_table) < total:
            seq.block_table.append(self._take_free_block())
        return True

    def commit_computed_blocks(self, seq: Sequence) -> None:
        """Register every newly full, computed block of `seq` in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        num_full = min(num_full, len(seq.block_table))  # host blocks are not shareable
        for i in range(seq.num_committed_blocks, num_full):
            if i == len(seq.block_hashes):
                parent = seq.block_hashes[i - 1] if i else None
                tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
                seq.block_hashes.append(block_hash(parent, tokens))
            h = seq.block_hashes[i]
            block = seq.block_table[i]
            if h not in self.hash_to_block and self.block_to_hash[block] is None:
                self.hash_to_block[h] = block
                self.block_to_hash[block] = h
        seq.num_committed_blocks = max(seq.num_committed_blocks, num_full)

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's computed tokens: those that only held
        speculative tokens the target rejected. Never registered in the prefix cache, they go
        to the front of the free queue (reused first)."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        for block in seq.block_table[keep:]:
            self._release_uncached(block)
        del seq.block_table[keep:]

    def _release_uncached(self, block: int) -> None:
        """Release a block; if that frees one holding nothing the prefix cache knows, it goes to
        the front of the free queue (reused first)."""
        self._release(block)
        if self.ref_count[block] == 0 and self.block_to_hash[block] is None:
            self.free_queue.move_to_end(block, last=False)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; tail blocks go to the free queue first, so they are
        evicted before the (more shareable) head of the prefix."""
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_committed_blocks = 0
        for block in seq.host_block_table:
            self.free_host.append(block)
        seq.host_block_table = []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.block_table = list(parent.block_table)
        child.num_committed_blocks = parent.num_committed_blocks
        for block in child.block_table:
            self.ref_count[block] += 1

    # ---- swap ------------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= self.num_free_host_blocks

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move a sequence's device blocks to host memory, in front of any it has there.

        Returns:
            (device block, host block) pairs to copy before the device blocks are reused.
        """
        assert self.can_swap_out(seq)
        mapping = []
        for block in seq.block_table:
            host = self.free_host.pop()
            mapping.append((block, host))
        for block in reversed(seq.block_table):
            self._release(block)
        seq.host_block_table[:0] = [host for _, host in mapping]
        seq.block_table = []
        seq.num_committed_blocks = 0
        return mapping

    def can_swap_in(self, seq: Sequence, num_new_tokens: int = 0, watermark: bool = True
                    ) -> bool:
        have = len(seq.block_table)
        need = max(have + len(seq.host_block_table),
                   self.blocks_needed(seq.num_computed_tokens + num_new_tokens)) - have
        return self.num_free_blocks - need >= (self.watermark_blocks if watermark else 0)

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a sequence's host blocks back to the device, after the device blocks it has.

        Returns:
            (host block, device block) pairs to copy.
        """
        assert len(seq.host_block_table) <= self.num_free_blocks
        mapping = []
        for host in seq.host_block_table:
            block = self._take_free_block()
            mapping.append((host, block))
            seq.block_table.append(block)
            self.free_host.append(host)
        seq.host_block_table = []
        return mapping

    # ---- layer-wise prefill ----------------------------------------------------------------
    def host_blocks_for(self, seq: Sequence, num_new_tokens: int) -> int:
        """Host blocks a layer-wise prefill needs beyond the ones it holds to compute
        `num_new_tokens` more tokens."""
        total = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table) - len(seq.host_block_table))

    def allocate_host_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the host tail to cover `num_new_tokens` more tokens, all or nothing."""
        need = self.host_blocks_for(seq, num_new_tokens)
        if need > self.num_free_host_blocks:
            return False
        seq.host_block_table.extend(self.free_host.pop() for _ in range(need))
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

    def check_invariants(self, live: list[Sequence]) -> None:
        """Reference counts equal the number of live block-table entries (test helper)."""
        counts = [0] * self.num_blocks
        for block in self.staging:
            counts[block] += 1
        host = 0
        for seq in live:
            for block in seq.block_table:
                counts[block] += 1
            host += len(seq.host_block_table)
        assert counts == self.ref_count, "ref counts out of step with block tables"
        assert all((c == 0) == (b in self.free_queue) for b, c in enumerate(counts))
        assert host + self.num_free_host_blocks == self.num_host_blocks
