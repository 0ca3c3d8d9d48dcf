"""LLM: the offline Python API. Build once, then `generate` batches of prompts to completion."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq

from qserve.config import EngineConfig, engine_config
from qserve.engine.llm_engine import LLMEngine
from qserve.errors import QServeError
from qserve.outputs import RequestOutput
from qserve.pooling_params import PoolingParams
from qserve.sampling_params import SamplingParams


def make_engine(config: EngineConfig, loaded=None) -> LLMEngine:
    """The engine for `config`. A self-draft (--draft self:RECIPE) is the target's weights
    quantized with RECIPE: made here, above the engine, which runs weights and never makes
    them. Every command and the Python API build their engine through this."""
    spec, draft_weights = config.speculative, None
    if spec is not None and spec.kind == "self":
        from qserve.loader import load_model
        from qserve.quant.self_draft import self_draft_weights, self_recipe

        self_recipe(spec.draft[5:])  # a bad recipe fails before any weights are read
        if loaded is None:
            loaded = load_model(config.model, native=config.weights == "native")
        draft_weights = self_draft_weights(spec.draft[5:], loaded)
    return LLMEngine(config, loaded=loaded, draft_weights=draft_weights)


class LLM:
    """`LLM(model, **engine_options)`; options are CacheConfig / SchedulerConfig /
    SpeculativeConfig / EngineConfig field names, e.g. `LLM(kv_cache_memory="512MiB",
    max_num_seqs=32)` or `LLM(draft="ngram", num_speculative_tokens=4)`. `model=None` is the
    default model, pulled on first use."""

    def __init__(self, model: str | None = None, *, loaded=None, **options):
        self.engine = make_engine(engine_config(model, **options), loaded=loaded)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run every prompt to completion through continuous batching.

        Args:
            prompts: a string, a list of strings, or a list of token-id lists.
            sampling_params: one for all prompts, or one per prompt.
        Returns:
            one finished RequestOutput per prompt, in the prompts' order.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, Seq):
            if len(params) != len(prompts):
                raise QServeError(f"{len(params)} sampling params for {len(prompts)} prompts")
        else:
            params = [params] * len(prompts)
        # only the finished outputs are kept: the engine builds no others (at 32 sequences of
        # 2,000 tokens, copying each one's ids every step was ~0.4 ms of host time a step)
        return self._run(prompts, [dataclasses.replace(p, output_kind="final_only")
                                   for p in params])

    def embed(self, prompts: str | list[str] | list[list[int]],
              pooling_params: PoolingParams | None = None) -> list[RequestOutput]:
        """Embed every prompt: its final hidden states pooled (PoolingParams: the model's
        pooling, else the last token's; unit length unless normalize=False), batched like
        generation. Returns one finished RequestOutput per prompt, in order, its vector in
        `.embedding`."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run(prompts, [pooling_params or PoolingParams()] * len(prompts))

    def _run(self, prompts, params: list) -> list[RequestOutput]:
        """Add every prompt with its params, step until all have finished."""
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = str(next(self._ids))
                if isinstance(prompt, str):
                    self.engine.add_request(rid, prompt, p)
                else:
                    self.engine.add_request(rid, None, p, prompt_token_ids=list(prompt))
                ids.append(rid)
            finished: dict[str, RequestOutput] = {}
            while len(finished) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
        finally:
            for rid in ids:  # on an error or Ctrl-C, leave no request holding blocks
                self.engine.abort(rid)
        return [finished[rid] for rid in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True)
                   for c in convs]
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(ids, sampling_params)
