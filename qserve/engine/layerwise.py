"""Layer-wise KV offload: the copies around each layer of a step (after LayerKV, Ant Group 2024).

A request-level engine starts a prompt only when device blocks for all of it, in every layer,
are free; under load, time-to-first-token is mostly that wait. A layer-wise prefill needs device
memory for only a few layers at a time. It keeps its K/V in host blocks and borrows "staging"
blocks from the device pool for the length of one step:

    device pool, seen as layer slices     borrowed blocks 12, 13: 2 x L slices, any layer in any
    layer 0   [ 0 .. 11 | 12 | 13 | ..]   slices of group 0: layers 0, k, 2k, ...
    layer 1   [ 0 .. 11 | 12 | 13 | ..]   slices of group 1: layers 1, k + 1, ...
    ...                                   (k = kv_offload_lookahead groups, each with room for
                                           one layer of every layer-wise sequence's tail)

    before layer i   fetch the sequence's earlier K/V of layer i from host into group i % k
                     (done ahead, while layers i - k + 1 .. i - 1 compute)
    layer i          attention reads and writes group i % k through a per-layer block table
    after layer i    offload group i % k's new K/V to host, then fetch layer i + k into it

The copies run in order on the cache engine's CopyQueue (a side stream on CUDA, a copy thread
on the CPU), so waiting for layer i's fetch also means every earlier copy is done. Once its
prompt is computed, a layer-wise sequence is brought back whole, like a swapped one, before it
decodes. Who starts layer-wise, and how many blocks it borrows (StagingPlan), is the
scheduler's; StepLayers here carries out one step's copies for the model runner.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from qserve.kernels.paged_attention import PagedAttentionMetadata

if TYPE_CHECKING:
    from qserve.engine.block_manager import BlockManager
    from qserve.engine.cache_engine import CacheEngine
    from qserve.engine.scheduler import SchedulerOutput, StagingPlan


class StepLayers:
    """What happens around each layer of one forward pass that moves blocks (swap,
    copy-on-write) or computes layer-wise prefills: `before(i)` waits for what layer i needs
    and gives it its cache and metadata; `after(i)` starts the copies that layer i enables;
    `close()` waits for every copy, after which the staging blocks may be reused."""

    def __init__(self, ce: CacheEngine, caches: list[dict[str, torch.Tensor]],
                 meta: PagedAttentionMetadata, moves: list[int] | None,
                 out: SchedulerOutput, positions: torch.Tensor, plan: StagingPlan | None,
                 bm: BlockManager):
        """`bm`: the block manager that holds the step's block tables (host tails included)."""
        self.ce, self.caches, self.meta, self.moves = ce, caches, meta, moves
        self.staged = bool(out.staging)
        self.fetched: dict[int, int] = {}  # layer -> ticket of its fetch
        self.offloaded: dict[int, int] = {}  # layer -> ticket of its offload
        if self.staged:
            self._plan(out, positions, plan, bm)

    def _plan(self, out: SchedulerOutput, positions: torch.Tensor, plan: StagingPlan,
              bm: BlockManager) -> None:
        ce, meta = self.ce, self.meta
        L, N, bs, k = ce.num_layers, ce.num_blocks, ce.block_size, plan.groups
        # each layer-wise prefill: (row, device blocks before its tail, host tail, computed)
        tails = [(r, len(bm.block_table(s.seq.seq_id)), bm.host_block_table(s.seq.seq_id),
                  s.seq.num_computed_tokens) for r, s in enumerate(out.scheduled) if s.layerwise]
        G = sum(len(tail) for _, _, tail, _ in tails)
        slices = torch.tensor([l * N + b for b in out.staging for l in range(L)])
        assert slices.numel() >= k * G, "the scheduler borrowed too few staging blocks"
        self.group_slices = slices[:k * G].view(k, G)  # (k, G) flat slice ids
        by_layer = self.group_slices[torch.arange(L) % k]  # (L, G)
        # device blocks of every row in every layer's slices; tails are placeholders so far
        tables = meta.block_tables.cpu().unsqueeze(0) + (torch.arange(L) * N).view(L, 1, 1)
        fetch_host, fetch_at, off_host, off_at = [], [], [], []
        start = 0
        for r, p, tail, c in tails:
            tables[:, r, p:p + len(tail)] = by_layer[:, start:start + len(tail)]
            have = -(-c // bs) - p  # tail blocks holding K/V already: fetch them
            first = c // bs - p  # first tail block this step writes: offload from it on
            fetch_host += tail[:have]
            fetch_at += range(start, start + have)
            off_host += tail[first:]
            off_at += range(start + first, start + len(tail))
            start += len(tail)
        rows = torch.repeat_interleave(torch.arange(len(meta.query_lens_list)),
                                       torch.tensor(meta.query_lens_list))
        pos = positions.cpu()
        self.slots = tables[:, rows, pos // bs] * bs + pos % bs  # (L, T)
        dev = meta.block_tables.device
        self.tables, self.slots = tables.to(dev), self.slots.to(dev)  # (L, B, max_blocks), (L, T)
        self.fetch_host, self.fetch_at = torch.tensor(fetch_host, dtype=torch.int64), fetch_at
        self.off_host, self.off_at = torch.tensor(off_host, dtype=torch.int64), off_at
        self.k = k
        for i in range(k):
            self._fetch(i)

    def _fetch(self, layer: int) -> None:
        if self.fetch_at and layer < self.ce.num_layers:
            self.fetched[layer] = self.ce.fetch_layer(
                layer, self.fetch_host, self.group_slices[layer % self.k, self.fetch_at])

    def before(self, i: int) -> tuple[dict[str, torch.Tensor], PagedAttentionMetadata]:
        copier = self.ce.copier
        if not self.staged:
            if self.moves:
                copier.wait(self.moves[i])
            return self.caches[i], self.meta
        # staged slices of any layer may sit in blocks that this step's moves touch: all of
        # the moves go first (the queue runs in order, so a later ticket covers them too).
        # Layer i writes the slices of group i % k, which layer i - k's offload reads: that
        # copy must be done too (a fetch for layer i comes after it; without one, wait for it)
        copier.wait(max(self.fetched.pop(i, 0), self.offloaded.pop(i - self.k, 0),
                        self.moves[-1] if self.moves else 0))
        return self.ce.flat_layer(i), dataclasses.replace(
            self.meta, block_tables=self.tables[i], slot_mapping=self.slots[i])

    def after(self, i: int) -> None:
        if not self.staged:
            return
        if self.off_at:
            self.offloaded[i] = self.ce.offload_layer(
                i, self.group_slices[i % self.k, self.off_at], self.off_host)
        self._fetch(i + self.k)

    def close(self) -> None:
        self.ce.copier.wait_all()
