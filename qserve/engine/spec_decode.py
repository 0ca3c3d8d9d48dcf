"""Speculative decoding: a cheap draft proposes up to K tokens, the target checks them all in one
forward pass, and rejection sampling keeps the output distributed exactly as the target's.

    propose   the draft appends up to K provisional tokens to each sequence that may speculate
    schedule  the target computes them with the sequence's last token: K + 1 positions at once
    verify    rejection_sample keeps a prefix of the drafts and adds one token of the target's
    accept    the kept drafts count as computed; blocks only rejected drafts used are freed

A step that keeps m drafts emits m + 1 tokens for one read of the target's weights, which is
what decoding at small batch is bound by. Under greedy sampling the output is token for token
the target's own. The proposers (a draft model, the target's own weights quantized, n-gram
prompt lookup) are in proposer.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qserve.config import SpeculativeConfig
from qserve.engine.sampler import sampling_probs
from qserve.engine.sequence import Sequence


def rejection_sample(draft_ids: list[int], q: torch.Tensor, p: torch.Tensor,
                     generator: torch.Generator | None = None) -> list[int]:
    """Verify K draft tokens against the target (Leviathan et al. 2023, Chen et al. 2023).

    Args:
        draft_ids: the K tokens the draft proposed, x_1 .. x_K.
        q: (K, V) the draft's distributions they were drawn from (one-hot for a deterministic
            draft).
        p: (K + 1, V) the target's distributions at the same positions, and one more after x_K.
        generator: the sequence's own random source, when it is seeded.
    Returns:
        the accepted drafts followed by one token of the target's: 1 to K + 1 token ids.
    """
    # Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), for i = 1 .. K in order.
    # At the first rejection draw from normalize(max(0, p_i - q_i)) instead, and stop there.
    # If all K are accepted, draw a bonus token from p_{K+1}. Each token then follows p exactly.
    K, device = len(draft_ids), p.device
    if generator is not None and generator.device != device:
        p, q, device = p.to(generator.device), q.to(generator.device), generator.device
    i = torch.arange(K, device=device)
    x = torch.tensor(draft_ids, device=device)
    u = torch.rand(K, generator=generator, device=device)  # (K,) in [0, 1)
    # u < p / q, written without the division; q(x) > 0 because x was drawn from q
    rejected = (u * q[i, x] >= p[i, x]).nonzero()
    if len(rejected) == 0:
        return draft_ids + [_draw(p[K], generator)]
    r = int(rejected[0])
    # p(x_r) < q(x_r) here, so max(0, p - q) has positive mass
    return draft_ids[:r] + [_draw((p[r] - q[r]).clamp_(min=0), generator)]


def _constrain(logits: torch.Tensor, drafts: list) -> torch.Tensor:
    """logits (sum of K_i + 1, V) -> the same, masked by each sequence's grammar (its
    params.constraint) at each of its positions: after output O the rows see O, O + x_1, ...,
    O + x_1..x_K. A draft the grammar forbids has p = 0 there, so it is rejected and the token
    drawn in its place is one the grammar allows; the drafts themselves need not know it."""
    if all(seq.params.constraint is None for seq, _, _ in drafts):
        return logits
    logits, start = logits.clone(), 0
    for seq, ids, _ in drafts:
        end = start + len(ids) + 1
        if seq.params.constraint is not None:
            out, rows = seq.output_token_ids, logits[start:end].clone()
            seq.params.constraint.mask(rows, [out + ids[:j] for j in range(len(ids) + 1)])
            logits[start:end] = rows
        start = end
    return logits


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One id drawn with probability proportional to weights (V,), never a zero-weight one
    (so a one-hot row, a greedy target's, always gives its argmax)."""
    return int(torch.multinomial(weights, 1, generator=generator))


@dataclass
class _Backoff:
    """One sequence's recent acceptance and how long it sits out."""

    acceptance: float = 1.0  # exponential average of accepted / proposed
    skip: int = 0  # steps left without speculation
    wait: int = 1  # how long the next back-off lasts


class Speculator:
    """Chooses who speculates how far, runs the proposer, verifies, and keeps the counts.

    A sequence speculates when one token is all it has left to compute (it is decoding, or its
    prompt came from the prefix cache), with plain sampling settings
    (no penalties, logprobs or pending min_tokens, which would make the target's distribution
    depend on the drafts themselves), while at most
    `spec_max_batch_size` sequences run. One whose acceptance average drops below
    `spec_min_acceptance` sits out 2, 4, ... 32 steps.
    """

    EWMA = 0.3  # weight of the newest step in the acceptance average
    MAX_WAIT = 32

    def __init__(self, config: SpeculativeConfig, proposer, max_model_len: int):
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.backoff: dict[int, _Backoff] = {}  # seq_id -> state, running sequences only
        self.num_steps = 0  # sequence-steps that verified drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def propose(self, running: list[Sequence]) -> None:
        """Append provisional draft tokens to the running sequences that should speculate."""
        live = {seq.seq_id for seq in running}
        self.backoff = {i: b for i, b in self.backoff.items() if i in live}
        self.proposer.release(live)  # a preempted sequence's draft KV goes with its target KV
        if len(running) > self.config.spec_max_batch_size:
            return
        want = {}
        for seq in running:
            k = self._num_to_propose(seq)
            if k:
                want[seq] = k
        if want:
            self.proposer.propose(want)

    def _num_to_propose(self, seq: Sequence) -> int:
        p = seq.params
        if (seq.num_computed_tokens != seq.num_tokens - 1 or seq.num_spec_tokens
                or seq.num_forks or p.has_penalties
                or p.logprobs is not None or seq.num_output_tokens < p.min_tokens):
            return 0
        b = self.backoff.setdefault(seq.seq_id, _Backoff())
        if b.skip:
            b.skip -= 1
            return 0
        # the drafts' positions must exist, and the step emits up to k + 1 tokens
        room = min(self.max_model_len - seq.num_tokens, p.max_tokens - seq.num_output_tokens - 1)
        return max(0, min(self.config.num_speculative_tokens, room))

    def verify(self, logits: torch.Tensor,
               drafts: list[tuple[Sequence, list[int], torch.Tensor | None]]) -> list[list[int]]:
        """Rejection-sample every sequence's drafts.

        Args:
            logits: (sum of K_i + 1, V) the target's logits, grouped by sequence, in order.
            drafts: per sequence, its K_i draft ids and their draft probs (None: one-hot).
        Returns:
            per sequence, its accepted drafts and the target's next token.
        """
        params = [seq.params for seq, ids, _ in drafts for _ in range(len(ids) + 1)]
        p = sampling_probs(_constrain(logits, drafts), params)  # (R, V)
        out, start = [], 0
        for seq, ids, q in drafts:
            k = len(ids)
            if q is None:
                q = torch.zeros((k, p.shape[1]), device=p.device)
                q[torch.arange(k), torch.tensor(ids)] = 1.0
            tokens = rejection_sample(ids, q.to(p.device), p[start:start + k + 1], seq.generator)
            start += k + 1
            self._record(seq, k, len(tokens) - 1)
            out.append(tokens)
        return out

    def _record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        self.num_steps += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        seq.spec_steps += 1
        seq.spec_draft_tokens += proposed
        seq.spec_accepted_tokens += accepted
        b = self.backoff.setdefault(seq.seq_id, _Backoff())
        b.acceptance += self.EWMA * (accepted / proposed - b.acceptance)
        if b.acceptance >= self.config.spec_min_acceptance:
            b.wait = 1
            return
        b.wait = min(2 * b.wait, self.MAX_WAIT)
        b.skip = b.wait
        b.acceptance = self.config.spec_min_acceptance  # the next probe alone decides

    def stats(self) -> dict:
        steps, drafts = self.num_steps, self.num_draft_tokens
        return {
            "spec_steps": steps, "spec_draft_tokens": drafts,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.num_accepted_tokens / drafts if drafts else None,
            # accepted drafts per verifying step; the step also adds one target token
            "spec_mean_accepted_tokens": self.num_accepted_tokens / steps if steps else None,
        }
