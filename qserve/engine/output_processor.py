"""OutputProcessor: token ids -> text and stop strings, outside the engine step.

In token-only mode (`LLMEngine.detokenize = False`, what the server runs) the engine reports
token ids and finishes samples on EOS, stop token ids and length only. This turns its
RequestOutputs into what the caller sees, with the same IncrementalDetokenizer the engine runs
inline otherwise, so the text is the same either way. A stop string ends its sample here: text,
token ids and logprobs are cut where it matched, and `process` names the sample so that the
caller tells the engine to drop it. By then the engine may have computed a token or two past
the stop; they never reach the caller.

The engine runs a request with `engine_params(params)`: it reports only what is new each
step (output_kind "delta"), so neither side copies a long output every step, and this keeps
each sample's ids and logprobs once, handing the caller the output_kind it asked for.
"""
from __future__ import annotations

import dataclasses
import time

from qserve.engine.detokenizer import IncrementalDetokenizer
from qserve.outputs import CompletionOutput, RequestOutput
from qserve.pooling_params import PoolingParams
from qserve.sampling_params import SamplingParams


@dataclasses.dataclass
class _Sample:
    detokenizer: IncrementalDetokenizer
    num_tokens: int = 0  # output tokens kept (fed to the detokenizer, or cut at a stop string)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)  # the kept ids
    logprobs: list | None = None  # theirs, where the request asked for logprobs


@dataclasses.dataclass
class _Request:
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # as the caller asked (its output_kind, not the
    # engine's)
    samples: dict[int, _Sample] = dataclasses.field(default_factory=dict)
    prompt_logprobs: list | None = None  # the engine hands them out once (its "delta")


def engine_params(params: SamplingParams | PoolingParams) -> SamplingParams | PoolingParams:
    """What the engine runs a request added here with: the same, reporting deltas. A
    final_only caller too: a stop string must be seen in the step it appears. (An embedding
    request has one output, its last.)"""
    if isinstance(params, PoolingParams):
        return params
    return dataclasses.replace(params, output_kind="delta")


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}

    def add(self, request_id: str, prompt_token_ids: list[int],
            params: SamplingParams | PoolingParams) -> None:
        """params: as the caller asked; the engine runs engine_params(params)."""
        self.requests[request_id] = _Request(list(prompt_token_ids), params)

    def drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def histories(self, out: RequestOutput) -> list[list[int]]:
        """The output ids of out's unfinished samples once out (an engine output not yet
        processed) is added: what a grammar must have accepted before their next token."""
        req = self.requests.get(out.request_id)
        if req is None:
            return []
        kept = {i: s.token_ids for i, s in req.samples.items() if s.finish_reason is None}
        return [kept.get(c.index, []) + c.token_ids for c in out.outputs
                if c.finish_reason is None and (c.index in kept or c.index not in req.samples)]

    def process(self, out: RequestOutput) -> tuple[RequestOutput | None, list[int]]:
        """Fill in one engine output's text (the engine's output_kind "delta").

        Returns:
            the output as the caller should see it, in the output_kind it asked for (None for
            a request unknown here or already finished here, and for a final_only request
            until it finishes), and the indexes of the samples a stop string just ended.
        """
        req = self.requests.get(out.request_id)
        if req is None:
            return None, []
        if isinstance(req.params, PoolingParams):  # an embedding: no text, one output
            del self.requests[out.request_id]
            return out, []
        kind = req.params.output_kind
        if out.prompt_logprobs is not None:
            req.prompt_logprobs = out.prompt_logprobs
        stopped = []
        completions = []
        for c in out.outputs:
            sample = req.samples.get(c.index)
            if sample is None:
                sample = req.samples[c.index] = _Sample(IncrementalDetokenizer(
                    self.tokenizer, req.prompt_token_ids, req.params))
                if c.logprobs is not None:
                    sample.logprobs = []
            before, delta = sample.num_tokens, ""
            if sample.finish_reason is None:
                delta = self._feed(sample, c)
                if sample.finish_reason == "stop" and isinstance(sample.stop_reason, str):
                    stopped.append(c.index)
            kept = sample.num_tokens - before  # c's ids before any stop string
            ids = c.token_ids[:kept]
            lps = None if c.logprobs is None else c.logprobs[:kept]
            sample.token_ids += ids
            if lps is not None and sample.logprobs is not None:
                sample.logprobs += lps
            if kind != "delta":  # everything so far
                ids = list(sample.token_ids)
                lps = None if sample.logprobs is None else list(sample.logprobs)
            completions.append(dataclasses.replace(
                c, text=delta if kind == "delta" else sample.detokenizer.text,
                delta_text=delta if kind != "final_only" else sample.detokenizer.text,
                token_ids=ids, logprobs=lps, num_tokens=sample.num_tokens,
                finish_reason=sample.finish_reason, stop_reason=sample.stop_reason))
        finished = out.finished or (len(req.samples) == req.params.n and all(
            s.finish_reason is not None for s in req.samples.values()))
        if kind == "final_only" and not finished:
            return None, stopped
        metrics = out.metrics
        if finished:
            del self.requests[out.request_id]
            if metrics.finished_time is None:
                metrics = dataclasses.replace(metrics, finished_time=time.monotonic())
        return dataclasses.replace(
            out, outputs=completions, finished=finished, metrics=metrics,
            prompt_logprobs=out.prompt_logprobs if kind == "delta" else req.prompt_logprobs
        ), stopped

    def _feed(self, sample: _Sample, c: CompletionOutput) -> str:
        """Detokenize a sample's new tokens (c.token_ids, a delta) as LLMEngine._append does
        inline; a stop string ends the sample where it matched."""
        new = c.token_ids
        if c.finish_reason == "stop":
            # token-only, the engine stops a sample only on EOS or a stop token id: its last
            # token, which has no text
            new = new[:-1]
        delta = []
        for token in new:
            sample.num_tokens += 1
            text, stop = sample.detokenizer.add_tokens([token])
            delta.append(text)
            if stop is not None:
                sample.finish_reason, sample.stop_reason = "stop", stop
                return "".join(delta)
        if c.finish_reason is not None:
            sample.num_tokens += len(c.token_ids) - len(new)  # the stop token kept too
            delta.append(sample.detokenizer.flush())  # release text held back for a stop string
            sample.finish_reason, sample.stop_reason = c.finish_reason, c.stop_reason
        return "".join(delta)
