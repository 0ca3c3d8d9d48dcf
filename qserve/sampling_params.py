"""How to pick the next tokens of one request, and when to stop. Ranges follow vLLM / OpenAI."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

from qserve.errors import QServeError

MAX_LOGPROBS = 20
# Below this temperature a row samples greedily: the argmax is the limit as T -> 0, and dividing
# fp32 logits by a smaller T (1e-300 is 0 in fp32) would give inf / nan. vLLM's _SAMPLING_EPS.
GREEDY_TEMPERATURE = 1e-5
# repetition_penalty divides or multiplies fp32 logits; outside this range it over- or
# underflows them (1e-308 is 0 in fp32: logits / 0 = inf).
REPETITION_PENALTY_RANGE = (0.01, 100.0)
OUTPUT_KINDS = ("cumulative", "delta", "final_only")  # SamplingParams.output_kind


class SamplingParamsError(QServeError):
    """A bad sampling setting; `param` names the field (the HTTP error's `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class TokenConstraint(Protocol):
    """Which tokens may come next, for the sequences of one request (a compiled grammar, say).

    Handed down as data: the sampler calls `mask` before it samples, with every row of the
    step that carries this constraint. It keeps whatever per-sequence state it needs, keyed by
    the output so far, which survives preemption (a recomputed or swapped sequence keeps its
    tokens) and lets n > 1 samples diverge.
    """

    def mask(self, logits: torch.Tensor, outputs: list[list[int]]) -> None:
        """logits (R, V): in place, -inf on each row's tokens that may not follow outputs[r]
        (that row's output token ids so far); a row may be left untouched."""

    # Optional: `allows(outputs, tokens) -> list[bool]`, whether tokens[r] may follow
    # outputs[r]. A constraint that has it lets the sampler draw greedy and temperature-only
    # rows first and mask only those it refuses (engine/sampler.py).


@dataclass
class SamplingParams:
    """Per-request sampling settings, validated on construction."""

    n: int = 1  # samples per prompt
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = off
    min_p: float = 0.0  # drop tokens less likely than min_p * (probability of the likeliest)
    repetition_penalty: float = 1.0  # HF-style, over prompt + output tokens; 1 = off
    presence_penalty: float = 0.0  # OpenAI-style, over output tokens; 0 = off
    frequency_penalty: float = 0.0  # OpenAI-style, over output tokens; 0 = off
    seed: int | None = None  # makes this request's samples reproducible
    stop: list[str] = field(default_factory=list)  # a str is accepted and wrapped in a list
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # keep generating past EOS
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    logprobs: int | None = None  # return the logprobs of the chosen token and of the top-N
    # return each prompt token's logprob and the top-N at its position (the first token has
    # none: nothing precedes it); the prompt is then computed whole, not from the prefix cache
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # What engine.step() returns for this request (vLLM's RequestOutputKind): "cumulative",
    # a RequestOutput every step it runs, with everything so far (token ids copied each
    # time); "delta", one every step with only the new tokens, logprobs and text (what the
    # server streams); "final_only", one when it finishes (what LLM.generate asks for).
    output_kind: str = "cumulative"
    # Constrained decoding (a grammar's token mask), shared by the request's samples. Such a
    # row's stop tokens are the constraint's to allow: min_tokens does not mask them.
    constraint: TokenConstraint | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check(self.n >= 1, f"n={self.n} must be at least 1", "n")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value):
                shown = value if isinstance(value, float) else f"{str(value)[:8]}...(huge)"
                raise SamplingParamsError(f"{name}={shown} must be a finite number", name)
        _check(self.temperature >= 0, f"temperature={self.temperature} must be >= 0",
               "temperature")
        _check(0 < self.top_p <= 1, f"top_p={self.top_p} must be in (0, 1]", "top_p")
        _check(self.top_k >= -1,
               f"top_k={self.top_k} must be -1 or 0 (off) or a positive number of tokens", "top_k")
        _check(0 <= self.min_p <= 1, f"min_p={self.min_p} must be in [0, 1]", "min_p")
        _check(self.repetition_penalty > 0,
               f"repetition_penalty={self.repetition_penalty} must be > 0 (1 = off)",
               "repetition_penalty")
        low, high = REPETITION_PENALTY_RANGE
        _check(low <= self.repetition_penalty <= high,
               f"repetition_penalty={self.repetition_penalty} must be in [{low}, {high:g}] "
               f"(1 = off)", "repetition_penalty")
        _check(-2 <= self.presence_penalty <= 2,
               f"presence_penalty={self.presence_penalty} must be in [-2, 2]", "presence_penalty")
        _check(-2 <= self.frequency_penalty <= 2,
               f"frequency_penalty={self.frequency_penalty} must be in [-2, 2]",
               "frequency_penalty")
        _check(self.max_tokens >= 1, f"max_tokens={self.max_tokens} must be at least 1",
               "max_tokens")
        _check(0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens={self.min_tokens} must be in [0, max_tokens={self.max_tokens}]",
               "min_tokens")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
               f"logprobs={self.logprobs} must be in [0, {MAX_LOGPROBS}] or None", "logprobs")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
               f"prompt_logprobs={self.prompt_logprobs} must be in [0, {MAX_LOGPROBS}] or None",
               "prompt_logprobs")
        for s in self.stop:
            _check(isinstance(s, str) and s != "", f"stop={s!r} must be a non-empty string",
                   "stop")
        _check(self.output_kind in OUTPUT_KINDS,
               f"output_kind={self.output_kind!r} must be one of {', '.join(OUTPUT_KINDS)}",
               "output_kind")
        for t in self.stop_token_ids:
            _check(isinstance(t, int) and not isinstance(t, bool) and t >= 0,
                   f"stop_token_ids entry {t!r} must be a token id >= 0", "stop_token_ids")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: temperature 0 (or below GREEDY_TEMPERATURE),
        or only one token kept."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0)


def _finite(x) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise SamplingParamsError(message, param)
