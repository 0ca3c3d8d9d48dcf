"""What the engine hands back to callers, one object per request per step."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One of a request's n samples."""

    # text, token_ids and logprobs hold everything so far, or with SamplingParams.output_kind
    # "delta" only what is new since the request's previous output
    index: int
    text: str  # generated text (stop string excluded)
    token_ids: list[int]  # generated ids
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    delta_text: str = ""  # text new since the previous RequestOutput for this request
    logprobs: list[dict[int, float]] | None = None  # per generated token: {id: logprob}, top-N + chosen
    num_tokens: int = 0  # ids generated so far, in every kind (len(token_ids) unless "delta")
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    # speculative decoding: steps that verified drafts, drafts verified, drafts accepted
    spec_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        drafts = self.spec_draft_tokens
        return self.spec_accepted_tokens / drafts if drafts else None

    @property
    def spec_mean_accepted_tokens(self) -> float | None:
        """Accepted drafts per verifying step (each such step also adds one target token)."""
        return self.spec_accepted_tokens / self.spec_steps if self.spec_steps else None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # SamplingParams.prompt_logprobs: per prompt token {id: logprob}, top-N + the token itself,
    # the first None; set once the whole prompt is computed ("delta": in that output only)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # an embedding request (PoolingParams): the prompt's pooled vector, once finished
    # (`outputs` is then empty)
    embedding: list[float] | None = None
    extra: dict = field(default_factory=dict)
