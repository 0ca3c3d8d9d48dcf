"""A sequence: one sample of one request, and the state the scheduler keeps for it.

There are no prefill and decode phases. A sequence knows `num_tokens` (prompt + output so far)
and `num_computed_tokens` (how many of them have K/V in the cache). Each step the scheduler
picks how many of the missing tokens to compute; a sequence whose computed count reaches its
token count gets one new token sampled. Chunked prefill, prefix-cache hits and recompute after
preemption are all just different starting points for that one rule.

Speculative decoding rides on the same rule: a draft's proposals are appended to `token_ids`
as provisional tokens (the last `num_spec_tokens` of them), so the target computes them in the
step that verifies them; the scheduler takes them off again after the forward pass.
"""
from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from qserve.engine.detokenizer import IncrementalDetokenizer
    from qserve.pooling_params import PoolingParams
    from qserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    """Token ids, computed count and stop state of one sample (its blocks are the block
    manager's, by seq_id)."""

    def __init__(self, request_id: str, index: int, token_ids: list[int], num_prompt_tokens: int,
                 params: SamplingParams, arrival_time: float | None = None):
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n samples
        self.token_ids = token_ids  # prompt followed by output
        self.num_prompt_tokens = num_prompt_tokens
        self.params = params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache on first admission
        self.num_forks = 0  # siblings still to fork off this sequence once its prompt is computed
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.generator: torch.Generator | None = None
        self.detokenizer: IncrementalDetokenizer | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        # SamplingParams.prompt_logprobs: one entry per prompt token recorded so far, the
        # first None (no distribution precedes it); the model runner appends the rest in order
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        # an embedding request (its pooling resolved): it ends once its prompt is computed,
        # sampling nothing; the model runner pools the prompt's hidden states into `pooled`
        self.pooling: PoolingParams | None = None
        self.pooled: torch.Tensor | None = None  # (hidden,) fp32: a sum while "mean" runs
        self.first_token_time: float | None = None
        self.first_scheduled_time: float | None = None
        self.num_spec_tokens = 0  # provisional draft tokens at the end of token_ids
        self.spec_probs: torch.Tensor | None = None  # (num_spec_tokens, V); None: one-hot
        self.spec_draft_tokens = 0  # draft tokens verified over the sequence's life
        self.spec_accepted_tokens = 0  # of which the target accepted
        self.spec_steps = 0  # steps that verified at least one draft token

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether prompt tokens still lack their logprobs (SamplingParams.prompt_logprobs)."""
        return (self.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens)

    @property
    def needs_every_position(self) -> bool:
        """Whether each prompt position must run here rather than come from the prefix
        cache: its prompt logprobs are still wanted, or it pools more than the last token."""
        return self.wants_prompt_logprobs or (self.pooling is not None
                                              and self.pooling.pooling != "last")

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def add_spec_tokens(self, token_ids: list[int]) -> None:
        """Append draft tokens provisionally (a proposer sets spec_probs when they were
        sampled rather than chosen deterministically)."""
        self.token_ids.extend(token_ids)
        self.num_spec_tokens += len(token_ids)

    def pop_spec_tokens(self) -> tuple[list[int], torch.Tensor | None]:
        """Take the provisional draft tokens off again: (their ids, their draft probs)."""
        k = self.num_spec_tokens
        if not k:
            return [], None
        ids, probs = self.token_ids[-k:], self.spec_probs
        del self.token_ids[-k:]
        self.num_spec_tokens, self.spec_probs = 0, None
        return ids, probs

    def fork(self, index: int) -> Sequence:
        """A sibling sample sharing everything computed so far (the block manager shares the
        blocks themselves)."""
        assert not self.num_spec_tokens
        child = Sequence(self.request_id, index, list(self.token_ids), self.num_prompt_tokens,
                         self.params, self.arrival_time)
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.first_scheduled_time = self.first_scheduled_time
        child.prompt_logprobs = self.prompt_logprobs  # recorded once, for the request
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")
