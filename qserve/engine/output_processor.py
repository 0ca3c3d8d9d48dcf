"""OutputProcessor: token ids -> text and stop strings, outside the engine step.

In token-only mode (`LLMEngine.detokenize = False`, what the server runs) the engine reports
token ids and finishes samples on EOS, stop token ids and length only. This turns its
RequestOutputs into what the caller sees, with the same IncrementalDetokenizer the engine runs
inline otherwise, so the text is the same either way. A stop string ends its sample here: text,
token ids and logprobs are cut where it matched, and `process` names the sample so that the
caller tells the engine to drop it. By then the engine may have computed a token or two past
the stop; they never reach the caller.
"""
from __future__ import annotations

import dataclasses
import time

from qserve.engine.detokenizer import IncrementalDetokenizer
from qserve.outputs import CompletionOutput, RequestOutput
from qserve.sampling_params import SamplingParams


@dataclasses.dataclass
class _Sample:
    detokenizer: IncrementalDetokenizer
    num_tokens: int = 0  # output tokens fed to the detokenizer (or cut at a stop string)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclasses.dataclass
class _Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: dict[int, _Sample] = dataclasses.field(default_factory=dict)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.requests[request_id] = _Request(list(prompt_token_ids), params)

    def drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, out: RequestOutput) -> tuple[RequestOutput | None, list[int]]:
        """Fill in one engine output's text.

        Returns:
            the output as the caller should see it (None for a request unknown here, or one
            already finished here), and the indexes of the samples a stop string just ended.
        """
        req = self.requests.get(out.request_id)
        if req is None:
            return None, []
        stopped = []
        completions = []
        for c in out.outputs:
            sample = req.samples.get(c.index)
            if sample is None:
                sample = req.samples[c.index] = _Sample(IncrementalDetokenizer(
                    self.tokenizer, req.prompt_token_ids, req.params))
            delta = ""
            if sample.finish_reason is None:
                delta = self._feed(sample, c)
                if sample.finish_reason == "stop" and isinstance(sample.stop_reason, str):
                    stopped.append(c.index)
            n = sample.num_tokens
            completions.append(dataclasses.replace(
                c, text=sample.detokenizer.text, delta_text=delta, token_ids=c.token_ids[:n],
                logprobs=None if c.logprobs is None else c.logprobs[:n],
                finish_reason=sample.finish_reason, stop_reason=sample.stop_reason))
        finished = out.finished or (len(req.samples) == req.params.n and all(
            s.finish_reason is not None for s in req.samples.values()))
        metrics = out.metrics
        if finished:
            del self.requests[out.request_id]
            if metrics.finished_time is None:
                metrics = dataclasses.replace(metrics, finished_time=time.monotonic())
        return dataclasses.replace(out, outputs=completions, finished=finished,
                                   metrics=metrics), stopped

    def _feed(self, sample: _Sample, c: CompletionOutput) -> str:
        """Detokenize a sample's new tokens as LLMEngine._append does inline; a stop string
        ends the sample where it matched."""
        new = c.token_ids[sample.num_tokens:]
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
            sample.num_tokens = len(c.token_ids)
            delta.append(sample.detokenizer.flush())  # release text held back for a stop string
            sample.finish_reason, sample.stop_reason = c.finish_reason, c.stop_reason
        return "".join(delta)
