"""Model runner: turns one step's schedule into flat tensors and runs the model.

It sees sequences only as token ids and computed counts, and asks the block manager for their
block tables; it never sees queues.
"""
from __future__ import annotations

import array
import logging

import torch

from qserve.engine.block_manager import BlockManager
from qserve.engine.cache_engine import CacheEngine
from qserve.engine.cuda_graph import DecodeGraphs, enabled as cuda_graphs_enabled, uncapturable
from qserve.engine.layerwise import StepLayers
from qserve.engine.sampler import logprob_dicts
from qserve.engine.scheduler import SchedulerOutput, StagingPlan
from qserve.kernels.paged_attention import PagedAttentionMetadata
from qserve.models.base import CausalLM

log = logging.getLogger(__name__)


class ModelRunner:
    EXPAND_MAX = 17  # run_speculative: longest query still run as one-token rows (K <= 16)
    PROMPT_LOGIT_ROWS = 128  # prompt logprobs: rows of logits formed at a time

    def __init__(self, model: CausalLM, cache_engine: CacheEngine,
                 block_manager: BlockManager, device: torch.device,
                 staging: StagingPlan | None = None, max_num_seqs: int | None = None):
        """max_num_seqs: the most sequences a step decodes; given on CUDA, decode steps run
        as CUDA graphs (engine/cuda_graph.py) up to that batch, for a model they can capture."""
        self.model = model
        self.staging = staging
        self.cache_engine = cache_engine
        self.block_manager = block_manager  # the block tables of the scheduled sequences
        self.device = device
        self.block_size = cache_engine.block_size
        self.layer_caches = [cache_engine.layer(i) for i in range(model.arch.num_layers)]
        self.sliding_window = model.arch.sliding_window
        self.table_rows = TableRows()
        self.graphs = None
        if max_num_seqs and cuda_graphs_enabled(device):
            blocker = uncapturable(model)
            if blocker is None:
                self.graphs = DecodeGraphs(model, self.layer_caches, device, max_num_seqs,
                                           model.rope.max_positions, self.block_size,
                                           self.sliding_window)
            else:
                log.info("decode steps run without CUDA graphs: %s cannot be captured", blocker)

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor,
                                                      PagedAttentionMetadata, list[int]]:
        """Pack the scheduled tokens.

        Returns:
            input_ids (T,), positions (T,), attention metadata, and the flat row of each
            sampling sequence's last token (where its logits come from).
        """
        input_ids, positions, slots, starts, seq_lens, query_lens, tables, logit_rows = (
            self._pack(out))
        dev = self.device
        meta = PagedAttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
            max_seq_len=max(seq_lens),
            decode_only=all(n == 1 for n in query_lens),
            sliding_window=self.sliding_window,
        )
        return (torch.tensor(input_ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), meta, logit_rows)

    def _pack(self, out: SchedulerOutput) -> tuple[list[int], ...]:
        """The step's host lists: input ids, positions, slots (T each), query start offsets
        (B + 1), seq_lens, query_lens (B), and logit rows; the block tables as a (B, width)
        int64 tensor, rows zero-padded (TableRows)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logit_rows: list[int] = []
        tables = []  # (seq id, table, its first entry this step may have changed)
        bm = self.block_manager
        for s in out.scheduled:
            seq, n = s.seq, s.num_new_tokens
            c = seq.num_computed_tokens
            table = bm.block_table(seq.seq_id)
            if s.layerwise:
                # its tail gets per-layer staging slices (StepLayers); until then its host
                # block ids hold the places
                table = table + bm.host_block_table(seq.seq_id)
            input_ids.extend(seq.token_ids[c:c + n])
            pos = range(c, c + n)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            starts.append(starts[-1] + n)
            seq_lens.append(c + n)
            query_lens.append(n)
            tables.append((seq.seq_id, table, c // bs))  # copy-on-write: block c // bs
            if s.samples:
                logit_rows.append(starts[-1] - 1)
        return (input_ids, positions, slots, starts, seq_lens, query_lens,
                self.table_rows.tensor(tables), logit_rows)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """Execute the step's block copies, then the forward pass.

        Returns:
            (S, vocab) fp32 logits, one row per scheduled sequence that samples, in order.
        """
        hidden, rows = self._forward(out)
        self._record_prompt_logprobs(out, hidden)
        self._pool(out, hidden)
        if not rows:
            return hidden.new_empty((0, self.model.arch.vocab_size), dtype=torch.float32)
        if len(rows) < hidden.shape[0]:
            hidden = hidden[torch.tensor(rows, device=hidden.device)]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run_all_positions(self, out: SchedulerOutput) -> torch.Tensor:
        """Like run(), but logits for every scheduled token, not just the sampling ones: what
        evaluation needs (the next-token distribution at each position of a text).

        Returns:
            (T, vocab) fp32 logits, one row per scheduled token, in packed order.
        """
        hidden, _ = self._forward(out)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run_speculative(self, out: SchedulerOutput) -> torch.Tensor:
        """Like run(), but a sampling sequence carrying k provisional draft tokens gets the
        logits of its last k + 1 positions: the target's distributions after the token before
        the drafts and after each draft, which speculative decoding verifies them against.

        When no sequence computes more than EXPAND_MAX tokens, the step runs as a decode step
        with one query row per token ("batch expansion"): row j of a sequence attends to the
        context up to its own position, which the cache holds once the layer has written the
        step's K/V. Every position then takes the same attention path as one-token decoding.

        Returns:
            (sum over sampling sequences of 1 + k, vocab) fp32 logits, grouped by sequence in
            order, positions ascending within a group.
        """
        expand = (max(s.num_new_tokens for s in out.scheduled) <= self.EXPAND_MAX
                  and not out.staging)
        hidden, rows = self._forward(out, expand)  # (T, hidden)
        self._record_prompt_logprobs(out, hidden)
        self._pool(out, hidden)
        sampling = [s for s in out.scheduled if s.samples]
        rows = [r - s.num_spec_tokens + j for r, s in zip(rows, sampling)
                for j in range(s.num_spec_tokens + 1)]
        return self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])

    def _record_prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor) -> None:
        """Append to each scheduled sequence that wants prompt logprobs (SamplingParams.
        prompt_logprobs) those of the prompt tokens this step predicts: the row of position p
        holds the distribution of token p + 1. Rows are packed in scheduling order, one per
        scheduled token (drafts included), so a sequence's rows start after the tokens of
        those before it. Logits are formed PROMPT_LOGIT_ROWS rows at a time: a 2,048-token
        chunk of a 128k vocabulary would be 1 GiB of fp32 at once."""
        start = 0
        for s in out.scheduled:
            seq, n = s.seq, s.num_new_tokens
            if seq.wants_prompt_logprobs:
                c, first = seq.num_computed_tokens, len(seq.prompt_logprobs)
                lo, hi = first - 1, min(seq.num_prompt_tokens - 1, c + n)  # positions
                if c <= lo < hi:  # positions before c were recorded when they ran
                    self._prompt_logprobs(seq, hidden[start + lo - c:start + hi - c],
                                          seq.token_ids[lo + 1:hi + 1])
            start += n

    def _prompt_logprobs(self, seq, hidden: torch.Tensor, targets: list[int]) -> None:
        """{top-N ids in rank order, then the target id: logprob} for each row of hidden, of
        the model's own distribution (no temperature or penalty), appended to
        seq.prompt_logprobs in the sampler's form for a generated token."""
        k, step = seq.params.prompt_logprobs, self.PROMPT_LOGIT_ROWS
        for i in range(0, len(targets), step):
            lp = torch.log_softmax(self.model.compute_logits(hidden[i:i + step]), -1)
            t = torch.tensor(targets[i:i + step], device=lp.device)
            seq.prompt_logprobs += logprob_dicts(lp, t, [k] * len(t))

    @staticmethod
    def _pool(out: SchedulerOutput, hidden: torch.Tensor) -> None:
        """Pool each embedding request's rows of this step (its prompt's final hidden states,
        packed in scheduling order like _record_prompt_logprobs's) into seq.pooled: the
        first position's row (cls), the last's (last), or their sum (mean, divided by the
        count once the prompt is done). A prompt recomputed from position 0 starts over."""
        start = 0
        for s in out.scheduled:
            seq, n = s.seq, s.num_new_tokens
            if seq.pooling is not None:
                c, kind = seq.num_computed_tokens, seq.pooling.pooling
                rows = hidden[start:start + n].float()  # (n, hidden)
                if kind == "mean":
                    seq.pooled = rows.sum(0) if c == 0 else seq.pooled + rows.sum(0)
                    if c + n == seq.num_tokens:
                        seq.pooled /= seq.num_tokens
                elif kind == "cls" and c == 0:  # (copies: the step's buffers are reused)
                    seq.pooled = rows[0].clone()
                elif kind == "last" and c + n == seq.num_tokens:
                    seq.pooled = rows[-1].clone()
            start += n

    def _graphable(self, out: SchedulerOutput) -> bool:
        """Whether this step can replay a CUDA graph: one new token per sequence, every block
        on the device, no block copies, and a batch within the captured buckets."""
        return (self.graphs is not None and not out.staging
                and not (out.swap_out or out.swap_in or out.copies)
                and all(s.num_new_tokens == 1 and not s.layerwise for s in out.scheduled)
                and self.graphs.fits(len(out.scheduled)))

    def _forward(self, out: SchedulerOutput, one_query_per_row: bool = False
                 ) -> tuple[torch.Tensor, list[int]]:
        """Block copies, then the forward pass: (T, hidden) final hidden states and the rows
        of the sampling sequences' last tokens. `one_query_per_row` runs every token as its
        own one-token query (see run_speculative)."""
        ce = self.cache_engine
        if not one_query_per_row and self._graphable(out):
            ids, pos, slots, _, seq_lens, _, tables, rows = self._pack(out)
            hidden = self.graphs.run(ids, pos, slots, seq_lens, tables)
            if hidden is not None:
                return hidden, rows
        moves = ce.start_moves(out.swap_out, out.swap_in, out.copies)  # run beside prepare()
        input_ids, positions, meta, rows = self.prepare(out)
        if one_query_per_row:
            meta = _one_query_per_row(meta)
        layers = None
        if out.staging or moves and not (meta.decode_only and self.device.type == "cpu"):
            layers = StepLayers(ce, self.layer_caches, meta, moves, out, positions, self.staging,
                                self.block_manager)
        elif moves:  # the fused CPU decode step runs every layer in one call
            ce.copier.wait_all()
        try:
            hidden = self.model(input_ids, positions, self.layer_caches, meta, layers)
        finally:
            if layers is not None:  # no staging block is given back under a pending copy
                layers.close()
        return hidden, rows


class TableRows:
    """The scheduled sequences' block tables as one (B, width) int64 tensor, rows zero-padded,
    made from int64 copies of the tables kept from the step before: a step converts only each
    table's entries from the block its first new token lands in (the one copy-on-write may
    have replaced) onward. A table that is another list than the step before (freed and
    re-admitted, swapped, forked) is converted whole; one that shrank (trim) is cut. The
    block manager changes a table in place only by appending, copy-on-write at that block,
    and trim. At 32 sequences of 2,000 tokens, torch.tensor over the padded lists of every
    table took ~0.4 ms a step of host time."""

    def __init__(self):
        self._rows: dict[int, tuple[list[int], array.array]] = {}  # seq id -> (table, copy)

    def tensor(self, tables: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """tables: (seq id, block table, first entry that may have changed since the step
        before) per row. Keeps the copies of these sequences only."""
        width = max((len(t) for _, t, _ in tables), default=0)
        flat, rows = array.array("q"), {}
        for seq_id, table, start in tables:
            kept = self._rows.get(seq_id)
            if kept is not None and kept[0] is table:
                row = kept[1]
                keep = min(start, len(row), len(table))
                del row[keep:]
                row.extend(table[keep:])
            else:
                row = array.array("q", table)
            rows[seq_id] = (table, row)
            flat.extend(row)
            if len(row) < width:
                flat.extend(array.array("q", bytes(8 * (width - len(row)))))
        self._rows = rows
        if not flat:
            return torch.zeros((len(tables), width), dtype=torch.int64)
        return torch.frombuffer(flat, dtype=torch.int64).view(len(tables), width)


def _one_query_per_row(meta: PagedAttentionMetadata) -> PagedAttentionMetadata:
    """The same tokens as T one-token queries: a sequence with n new tokens and context L
    becomes n rows with contexts L - n + 1 .. L over the same block table.

        seq_lens [7]  query_lens [3]   ->   seq_lens [5, 6, 7]  query_lens [1, 1, 1]
    """
    n = meta.query_lens_list
    seq_lens = [L - q + 1 + j for q, L in zip(n, meta.seq_lens_list) for j in range(q)]
    dev = meta.seq_lens.device
    repeats = torch.tensor(n, device=dev)
    return PagedAttentionMetadata(
        slot_mapping=meta.slot_mapping,
        query_start_loc=torch.arange(len(seq_lens) + 1, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
        block_tables=meta.block_tables.repeat_interleave(repeats, dim=0),
        query_lens_list=[1] * len(seq_lens),
        seq_lens_list=seq_lens,
        max_seq_len=meta.max_seq_len,
        decode_only=True,
        sliding_window=meta.sliding_window,
    )
