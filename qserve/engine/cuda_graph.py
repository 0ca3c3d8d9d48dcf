"""CUDA-graph decode: one captured forward pass per batch-size bucket, replayed each step.

A decode step launches ~8 Triton kernels and ~70 aten ops a layer; at small batches the host
takes longer to issue them than the GPU to run them. Captured once per bucket (as nano-vllm
and vLLM do), the step is one copy and one replay:

    buckets     1, 2, 4, 8, then every 16 up to max_num_seqs: a batch runs in the smallest
                bucket that holds it; its padding rows write no cache slot (slot -1, which the
                Triton KV write skips) and their outputs are dropped
    buffers     input_ids, positions, slot_mapping, seq_lens (max_batch,) and block_tables
                (max_batch, max_blocks) are views of one persistent device tensor, so the
                captured kernels' pointers stay valid; a step packs them into one pinned host
                tensor and copies over what the bucket reads (two transfers)

        flat:  [ ids | positions | slots | seq_lens | block_tables (max_batch x max_blocks) ]

    attention   captured per context bucket too (powers of two from 256 up to max_model_len),
                with max_seq_len = the bucket: decode_attention's grid covers every split a
                sequence that short can need (splits are fixed token ranges) and a split past
                a sequence's end adds exactly nothing, so a graph serves every length up to
                its bucket, and the partials stay sized for it, not for max_model_len

The model runner uses it only on CUDA with the Triton kernels, for models whose every module
can be captured (`uncapturable`), for decode steps without block copies or layer-wise staging;
a bucket that fails to capture falls back to eager launches. Not yet run on a GPU (README: the
GPU figures are unmeasured).
"""
from __future__ import annotations

import bisect
import logging
import os

import torch

from qserve.kernels.paged_attention import PagedAttentionMetadata

log = logging.getLogger(__name__)
PAD_SLOT = -1  # a padding row's slot: the KV write skips it


def enabled(device: torch.device) -> bool:
    """Graphs on CUDA unless QSERVE_CUDA_GRAPHS=0, and only where the Triton kernels run."""
    if device.type != "cuda" or os.environ.get("QSERVE_CUDA_GRAPHS", "1") == "0":
        return False
    from qserve.kernels.dispatch import _triton_available

    return _triton_available()


def uncapturable(model: torch.nn.Module) -> str | None:
    """The class of a module of `model` whose decode step a CUDA graph cannot capture, or
    None. A module says `cuda_graph_safe = False` when its forward reads a device value
    on the host (a capture cannot sync: a mixture's routing) or sizes its work from the
    metadata's host lists, which a graph fixes at its context bucket (the soft-capped
    attention's reference path would attend to the whole bucket)."""
    for module in model.modules():
        if not getattr(module, "cuda_graph_safe", True):
            return type(module).__name__
    return None


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, 16, 32, ... (every 16 past 16), and max_batch."""
    assert max_batch >= 1, max_batch
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + [b for b in range(16, max_batch, 16)] + [max_batch]


def context_bucket(max_seq_len: int, max_model_len: int) -> int:
    """The context a graph is captured for: the next power of two >= max_seq_len, at least
    256, at most max_model_len."""
    return min(max_model_len, max(256, 1 << (max_seq_len - 1).bit_length()))


def bucket_for(batch: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding `batch` rows; None when the batch is above them all."""
    i = bisect.bisect_left(buckets, batch)
    return buckets[i] if i < len(buckets) else None


class DecodeBuffers:
    """The persistent decode inputs (see the module docstring for the layout)."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device, pin: bool):
        self.max_batch, self.max_blocks = max_batch, max_blocks
        n = max_batch * (4 + max_blocks)
        self.device_flat = torch.zeros(n, dtype=torch.int64, device=device)
        self.host_flat = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        (self.input_ids, self.positions, self.slot_mapping, self.seq_lens,
         self.block_tables) = self._views(self.device_flat)
        self._host = self._views(self.host_flat)
        self.query_start_loc = torch.arange(max_batch + 1, device=device)  # one row each

    def _views(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        B = self.max_batch
        return (flat[:B], flat[B:2 * B], flat[2 * B:3 * B], flat[3 * B:4 * B],
                flat[4 * B:].view(B, self.max_blocks))

    def update(self, input_ids: list[int], positions: list[int], slots: list[int],
               seq_lens: list[int], tables: torch.Tensor, bucket: int) -> None:
        """Write one decode step's rows and pad them to `bucket` rows (token 0 at position 0,
        slot PAD_SLOT, a context of 1 in block 0), then copy what the bucket's graph reads to
        the device: the four (max_batch,) vectors and the first `bucket` table rows.

        A row's table entries past its own length are left as they were: attention reads a
        row's blocks only below its seq_len. The host tensor is reused: the caller must not
        update again before the previous copy has run (the engine reads each step's logits,
        a sync, before the next step)."""
        n = len(input_ids)
        assert 1 <= n <= bucket <= self.max_batch, (n, bucket, self.max_batch)
        assert len(positions) == len(slots) == len(seq_lens) == tables.shape[0] == n
        width = tables.shape[1]  # (n, width) int64 on the host, rows zero-padded
        assert width <= self.max_blocks, "block table too long"
        ids, pos, slot, lens, bt = self._host
        pad = self.max_batch - n
        ids.copy_(torch.tensor(input_ids + [0] * pad))
        pos.copy_(torch.tensor(positions + [0] * pad))
        slot.copy_(torch.tensor(slots + [PAD_SLOT] * pad))
        lens.copy_(torch.tensor(seq_lens + [1] * pad))
        bt[:n, :width] = tables
        bt[n:bucket, 0] = 0
        B = self.max_batch
        self.device_flat[:4 * B].copy_(self.host_flat[:4 * B], non_blocking=True)
        self.block_tables[:bucket].copy_(bt[:bucket], non_blocking=True)

    def metadata(self, batch: int, max_seq_len: int,
                 sliding_window: int | None) -> PagedAttentionMetadata:
        """The first `batch` rows as one-token queries over contexts of up to max_seq_len."""
        return PagedAttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[:batch + 1],
            seq_lens=self.seq_lens[:batch], block_tables=self.block_tables[:batch],
            query_lens_list=[1] * batch, seq_lens_list=[max_seq_len] * batch,
            max_seq_len=max_seq_len, decode_only=True, sliding_window=sliding_window)


class DecodeGraphs:
    """Captures the model's decode forward per bucket on first use, then replays it."""

    def __init__(self, model, layer_caches: list[dict[str, torch.Tensor]], device: torch.device,
                 max_batch: int, max_model_len: int, block_size: int,
                 sliding_window: int | None):
        self.model, self.layer_caches = model, layer_caches
        self.buckets = batch_buckets(max_batch)
        self.max_model_len, self.sliding_window = max_model_len, sliding_window
        self.buffers = DecodeBuffers(max_batch, -(-max_model_len // block_size), device,
                                     pin=device.type == "cuda")
        # (batch bucket, context bucket) -> the graph and its output (batch bucket, hidden)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.failed: set[int] = set()  # batch buckets that could not be captured
        self.pool = None

    def fits(self, batch: int) -> bool:
        b = bucket_for(batch, self.buckets)
        return b is not None and b not in self.failed

    def run(self, input_ids: list[int], positions: list[int], slots: list[int],
            seq_lens: list[int], tables: torch.Tensor) -> torch.Tensor | None:
        """(batch, hidden) final hidden states of one decode step, or None when its bucket
        cannot be captured (the caller runs the step eagerly)."""
        key = (bucket_for(len(input_ids), self.buckets),
               context_bucket(max(seq_lens), self.max_model_len))
        self.buffers.update(input_ids, positions, slots, seq_lens, tables, key[0])
        if key not in self.graphs and not self._capture(key):
            return None
        self.graphs[key].replay()
        return self.outputs[key][:len(input_ids)]

    def _forward(self, key: tuple[int, int]) -> torch.Tensor:
        b, context = key
        buf = self.buffers
        meta = buf.metadata(b, context, self.sliding_window)
        return self.model(buf.input_ids[:b], buf.positions[:b], self.layer_caches, meta, None)

    def _capture(self, key: tuple[int, int]) -> bool:
        """Capture one (batch, context) bucket over whatever the buffers hold (a capture
        reads no values). One eager run first compiles the Triton kernels and settles the
        allocator; it computes this step, and the replay then writes the same K/V again."""
        try:
            self._forward(key)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._forward(key)
        except Exception as e:  # noqa: BLE001  (an op that cannot be captured: run eagerly)
            log.warning("CUDA graph capture of decode batch %d failed (%s); running it "
                        "eagerly", key[0], e)
            self.failed.add(key[0])
            return False
        self.pool = graph.pool()  # every graph shares one memory pool
        self.graphs[key], self.outputs[key] = graph, out
        return True
