"""Scheduler: decides, each step, which sequences compute how many tokens.

Queues: `waiting` (never started, or preempted by recompute), `running`, `swapped` (preempted
to host memory). One rule drives everything: a scheduled sequence computes
`min(num_tokens - num_computed_tokens, token budget left)` tokens. Running sequences go first
(oldest first); when one cannot get a block, the newest running sequence is preempted, by swap
or by recompute. Swapped sequences come back before any new request is admitted, and new
requests are admitted in arrival order only while blocks above the watermark remain.

Speculative tokens (provisional draft tokens at the end of a sequence, see sequence.py) are
scheduled with the rest or not at all: a sequence whose drafts do not fit the token budget or
the free blocks loses them before anyone is preempted for it. After the forward pass
`postprocess` takes them off again and hands them to the engine to verify; `accept_spec_tokens`
then counts the accepted ones as computed and gives back the blocks the rejected ones used:

    before the step   tokens  [ ... x | d1 d2 d3 ]        computed up to x (exclusive)
    forward pass              computes x d1 d2 d3          logits at 4 positions
    postprocess       tokens  [ ... x ]                    computed through x
    engine appends    tokens  [ ... x d1 t ]               d1 accepted, t sampled by the target
    accept (1)                computed through d1; blocks past it go back to the pool

With --kv-offload layerwise, a request that cannot get device blocks for its whole prompt can
still start: it computes its prompt layer by layer through a few borrowed staging blocks and
keeps its K/V in host memory, so its first token does not wait for device memory
(`StagingPlan` sizes the loan; engine/layerwise.py does the copies around each layer). Its
decode does: once its prompt is computed it comes back to the device like a swapped sequence,
and until there is room it waits in `swapped`. New requests may start this way while others
wait in `swapped`; full admissions and comebacks leave `kv_offload_reserve` of the pool free
(the block manager's watermark) so that layer-wise prefills can keep staging.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qserve.config import SchedulerConfig
from qserve.engine.block_manager import BlockManager
from qserve.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class StagingPlan:
    """How many device blocks a layer-wise prefill borrows (admission policy; the copies
    themselves are engine/layerwise.py's)."""

    num_layers: int
    lookahead: int  # layers of staged K/V in flight at once

    @property
    def groups(self) -> int:
        return min(self.lookahead, self.num_layers)

    def blocks_for(self, tail_blocks: int) -> int:
        """Device blocks to borrow for staging `tail_blocks` host blocks per layer: one slice
        each in every group, and a device block has num_layers slices."""
        return -(-self.groups * tail_blocks // self.num_layers)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens
    num_spec_tokens: int = 0  # of which provisional draft tokens (the last ones)
    # set by postprocess when num_spec_tokens > 0: the draft tokens and their draft probs
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None  # (num_spec_tokens, V), None: one-hot drafts
    layerwise: bool = False  # computes through staging blocks; its K/V tail is in host memory

    @property
    def samples(self) -> bool:
        """Does this step bring the sequence level with its tokens, so it gets a new one? (An
        embedding request never does: its prompt computed, it ends.)"""
        return (self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens
                and self.seq.pooling is None)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) block pairs
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device) block pairs
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device blocks
    staging: list[int] = field(default_factory=list)  # device blocks lent to layer-wise prefills
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 staging: StagingPlan | None = None):
        """`staging`: how many blocks a layer-wise prefill borrows; None: no layer-wise offload."""
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.staging_plan = staging
        self._staged_blocks = 0  # host-tail blocks this step stages, summed over sequences
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_recomputes = 0
        self.num_layerwise_admits = 0  # requests that started their prompt layer by layer
        # prompt tokens served by the prefix cache, counted once per sequence at its first
        # admission: a recompute-preempted sequence re-admitted later, or an admission tried
        # and undone for lack of blocks, would otherwise count its hits again
        self.num_prefix_hit_tokens = 0

    # ---- queues --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence from whichever queue holds it and free its blocks."""
        if seq.is_finished:
            return
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                break
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run `child` beside `parent`, sharing all its blocks."""
        assert parent.status is SequenceStatus.RUNNING
        self.block_manager.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self.running.insert(self.running.index(parent) + 1, child)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work: running sequences first, then swapped ones back, then new
        ones, all from one budget of `max_num_batched_tokens`.

        Returns:
            the sequences to run with their token counts, and the block copies (swap and
            copy-on-write) the cache engine must do before the forward pass.
        """
        out = SchedulerOutput()
        self._staged_blocks = 0
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(budget, out)
        budget = self._resume_swapped(budget, out)
        self._admit_waiting(budget, out)
        out.copies = self.block_manager.take_pending_copies()
        out.staging = list(self.block_manager.staging)
        return out

    @staticmethod
    def _missing(seq: Sequence, budget: int) -> int:
        """Tokens of `seq` to compute this step: all it lacks, up to the budget."""
        return min(seq.num_tokens - seq.num_computed_tokens, budget)

    def _schedule_running(self, budget: int, out: SchedulerOutput) -> int:
        """Running sequences, oldest first, each what it lacks up to the budget left; those
        the budget does not reach lose their drafts. Returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self.block_manager.host_block_table(seq.seq_id):  # a layer-wise prefill
                n = self._continue_layerwise(seq, budget, out)
            else:
                n = self._continue_on_device(seq, budget, out)
            if n is None:  # it left `running`
                continue
            budget -= n
            i += 1
        for seq in self.running[i:]:  # out of budget this step: their drafts would go stale
            seq.pop_spec_tokens()
        return budget

    def _continue_on_device(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int | None:
        """Schedule a running sequence whose K/V is on the device. Drafts run whole or not at
        all, and go before anyone is preempted; when blocks run out, the newest running
        sequence is preempted, by swap or by recompute.

        Returns:
            the tokens scheduled, or None when `seq` itself was preempted.
        """
        n = self._missing(seq, budget)
        if seq.num_spec_tokens and seq.num_computed_tokens + n < seq.num_tokens:
            seq.pop_spec_tokens()
            n = self._missing(seq, budget)
        while not self.block_manager.allocate_slots(seq, n):
            if seq.num_spec_tokens:  # optional work: drop it before preempting anyone
                seq.pop_spec_tokens()
                n = self._missing(seq, budget)
                continue
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return None
        out.scheduled.append(ScheduledSeq(seq, n, seq.num_spec_tokens))
        return n

    def _continue_layerwise(self, seq: Sequence, budget: int, out: SchedulerOutput
                            ) -> int | None:
        """Schedule a running sequence whose K/V tail is in host memory: back to the device
        whole when there is room; else its next prompt chunk layer by layer.

        Returns:
            the tokens scheduled (0: none this step), or None when it moved to `swapped` to
            wait for room to decode.
        """
        seq.pop_spec_tokens()  # no drafts before its K/V is back
        remaining = seq.num_tokens - seq.num_computed_tokens
        n = min(remaining, budget)
        # back whole only if no one waits in `swapped` before it (they come back in order)
        if (not self.swapped
                and self.block_manager.can_swap_in(seq, n, watermark=len(self.running) > 1)):
            self._swap_in(seq, n, out)
            return n
        if remaining == 1 and seq.num_output_tokens:  # a decode step: it needs its K/V back
            self.running.remove(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            return None
        if (n < remaining and not self.config.enable_chunked_prefill) or not self._stage(seq, n):
            return 0
        out.scheduled.append(ScheduledSeq(seq, n, layerwise=True))
        return n

    def _resume_swapped(self, budget: int, out: SchedulerOutput) -> int:
        """Swapped sequences come back, in order, before anything new is admitted, unless this
        step preempted someone. Returns the budget left."""
        while self.swapped and not out.num_preempted and budget > 0:
            seq = self.swapped[0]
            n = self._missing(seq, budget)
            if (len(self.running) >= self.config.max_num_seqs or not
                    self.block_manager.can_swap_in(seq, n, watermark=bool(self.running))):
                break
            self.swapped.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._swap_in(seq, n, out)
            budget -= n
        return budget

    def _swap_in(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        """Bring all of a sequence's K/V back to the device and schedule `n` of its tokens
        (the caller checked can_swap_in)."""
        bm = self.block_manager
        out.swap_in.extend(bm.swap_in(seq))
        ok = bm.allocate_slots(seq, n)
        assert ok
        out.scheduled.append(ScheduledSeq(seq, n))

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        """New (or recompute-preempted) sequences, in arrival order, unless this step
        preempted someone; while others wait in `swapped`, only layer-wise ones, which take
        no device blocks beyond this step."""
        while self.waiting and not out.num_preempted and budget > 0:
            if (len(self.running) >= self.config.max_num_seqs
                    or self.swapped and self.staging_plan is None):
                break
            seq = self.waiting[0]
            s = self._admission(seq, budget)
            if s is None:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                self.num_prefix_hit_tokens += seq.num_cached_tokens
            self.running.append(seq)
            out.scheduled.append(s)
            budget -= s.num_new_tokens

    def _admission(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        """Blocks for a waiting sequence: its prefix-cache hits, then device blocks for what it
        computes this step, or else host blocks and staging to compute it layer by layer.

        Returns:
            its work this step, or None (holding nothing) when it cannot start now.
        """
        bm = self.block_manager
        if not bm.block_table(seq.seq_id):
            # a cached prefix would skip positions whose prompt logprobs or hidden states
            # are still wanted
            seq.num_computed_tokens = 0 if seq.needs_every_position else bm.match_prefix(seq)
            if seq.first_scheduled_time is None:
                seq.num_cached_tokens = seq.num_computed_tokens
        remaining = seq.num_tokens - seq.num_computed_tokens
        n = min(remaining, budget)
        if n < remaining and not self.config.enable_chunked_prefill:
            if self.running:
                self._undo_prefix(seq)
                return None
            n = remaining  # a lone prompt larger than the budget still has to run
        if not self.swapped and bm.allocate_slots(seq, n, watermark=bool(self.running)):
            return ScheduledSeq(seq, n)
        # n > 1 samples fork off the prompt's device blocks, so they start in full
        if self.staging_plan is not None and not seq.num_forks and self._stage(seq, n):
            self.num_layerwise_admits += 1
            return ScheduledSeq(seq, n, layerwise=True)
        self._undo_prefix(seq)
        return None

    def _stage(self, seq: Sequence, n: int) -> bool:
        """Host blocks for `n` more tokens of a layer-wise prefill, and the staging blocks to
        compute them through, all or nothing (host blocks already taken are kept)."""
        bm = self.block_manager
        if not bm.allocate_host_slots(seq, n):
            return False
        staged = self._staged_blocks + len(bm.host_block_table(seq.seq_id))
        if not bm.take_staging(self.staging_plan.blocks_for(staged) - len(bm.staging)):
            return False
        self._staged_blocks = staged
        return True

    def _undo_prefix(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.pop_spec_tokens()
        self.running.remove(seq)
        self.num_preemptions += 1
        out.num_preempted += 1
        bm = self.block_manager
        if self.config.preemption_mode == "swap" and bm.can_swap_out(seq):
            out.swap_out.extend(bm.swap_out(seq))
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            self.num_swap_outs += 1
        else:
            bm.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
            self.num_recomputes += 1

    def postprocess(self, out: SchedulerOutput) -> list[Sequence]:
        """Advance computed counts after the forward pass.

        Returns:
            the sequences that are now level with their tokens and need a sampled token. An
            embedding request level with its prompt is finished here instead.
        """
        self.block_manager.release_staging()  # the runner waited for the copies out of them
        to_sample = []
        for s in out.scheduled:
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if s.num_spec_tokens:  # the engine verifies them, then calls accept_spec_tokens
                s.spec_token_ids, s.spec_probs = seq.pop_spec_tokens()
            seq.num_computed_tokens += s.num_new_tokens - s.num_spec_tokens
            self.block_manager.commit_computed_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                if seq.pooling is None:
                    to_sample.append(seq)
                else:
                    self.finish(seq, "stop")
        return to_sample

    def accept_spec_tokens(self, seq: Sequence, num_accepted: int) -> None:
        """After verification: the first `num_accepted` draft tokens (now ordinary tokens of
        `seq`, followed by the target's own next token) keep the K/V this step computed for
        them; the blocks that only rejected drafts used go back to the pool."""
        assert seq.num_computed_tokens + num_accepted < seq.num_tokens
        seq.num_computed_tokens += num_accepted
        self.block_manager.commit_computed_blocks(seq)
        self.block_manager.trim(seq)
