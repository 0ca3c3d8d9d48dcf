"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time.

    out = scheduler.schedule()            which sequences compute how many tokens
    logits = runner.run(out)              block copies, then one flat forward pass
    seqs = scheduler.postprocess(out)     advance computed counts; who needs a token
    ... sample, detokenize, stop         then free what finished

With speculative decoding (spec_decode.py) a proposer first appends draft tokens to the
sequences that may speculate; the runner returns logits at each of their positions, and the
drafts are verified and accepted or rolled back before the ordinary sampling of the rest.

The server drives `add_request` / `step` / `abort` from its loop; `LLM` drives them to completion.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from qserve.config import EngineConfig
from qserve.engine.block_manager import BlockManager
from qserve.engine.cache_engine import (CacheEngine, DTYPES, bytes_per_block, fit_context,
                                        kv_budget_bytes, plan_num_blocks)
from qserve.engine.detokenizer import IncrementalDetokenizer
from qserve.engine.memory_plan import plan_memory, resolve_kv_dtype
from qserve.engine.model_runner import ModelRunner
from qserve.engine.proposer import build_proposer, draft_arch
from qserve.engine.sampler import Sampler
from qserve.engine.scheduler import Scheduler, SchedulerOutput, StagingPlan
from qserve.engine.sequence import Sequence
from qserve.engine.spec_decode import Speculator
from qserve.errors import ConfigError, QServeError, QueueFullError
from qserve.heap import keep_step_buffers, trim_heap
from qserve.models.build import build_model
from qserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from qserve.engine import kv_codebook
from qserve.pooling_params import POOLING_TYPES, PoolingParams
from qserve.sampling_params import SamplingParams


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    # sample index -> (output tokens, detokenizer deltas) already handed out
    sent: dict[int, tuple[int, int]]
    prompt_logprobs_sent: bool = False  # "delta" hands them out once

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded=None, draft_weights=None):
        """loaded: a LoadedModel (else the engine loads config.model); draft_weights: a
        self-draft's quantized weights (qserve.llm.make_engine makes them)."""
        self.config = config
        from qserve.loader import load_arch, resolve_model

        # Plan the KV pools from the architecture alone, so a budget too small for one
        # sequence is refused before any weights are read.
        arch = loaded.arch if loaded is not None else load_arch(config.model)
        self.device = torch.device(config.resolved_device())
        self.dtype = DTYPES[config.resolved_dtype()]
        sched = config.scheduler
        if (sched.max_model_len or 0) > arch.max_position_embeddings:
            raise ConfigError(
                f"--max-model-len {sched.max_model_len} exceeds the model's context length "
                f"{arch.max_position_embeddings}; use at most that")
        # --kv-dtype auto: a qserve checkpoint's recipe names the KV dtype to use
        path = loaded.path if loaded is not None else resolve_model(config.model)
        self.kv_dtype = resolve_kv_dtype(path, arch, config, loaded)
        spec = config.speculative
        d_arch = draft_arch(spec, arch) if spec is not None else None
        cache = config.cache
        t_block = bytes_per_block(arch, cache.block_size, self.kv_dtype)
        d_block = 0 if d_arch is None else bytes_per_block(d_arch, cache.block_size, self.kv_dtype)
        self.max_model_len = sched.max_model_len
        if self.max_model_len is None:  # the model's context, or as much of it as fits
            context = min(a.max_position_embeddings for a in (arch, d_arch) if a is not None)
            self.max_model_len, cache = fit_context(context, cache, t_block + d_block,
                                                    self.device, sched.max_num_seqs)
        if d_arch is not None:  # a draft model's cache holds as many tokens, from one budget
            seq_blocks = -(-self.max_model_len // cache.block_size)
            want = sched.max_num_seqs * seq_blocks * (t_block + d_block)
            budget = kv_budget_bytes(cache, self.device, want) * t_block // (t_block + d_block)
            cache = dataclasses.replace(cache, kv_cache_memory=budget)
        num_blocks, num_host_blocks = plan_num_blocks(
            arch, cache, self.kv_dtype, self.device, self.max_model_len, sched.max_num_seqs,
            requested=sched.max_model_len is not None)
        loaded = self._load(loaded, path, arch, cache.block_size, num_blocks, num_host_blocks)
        self.arch, self.tokenizer = loaded.arch, loaded.tokenizer
        self.model_path = loaded.path
        self.pooling = loaded.pooling  # what an embedding model declares (None: "last")

        self.model = build_model(self.arch, loaded.weights, self.max_model_len, self.dtype,
                                 self.device)
        trim_heap()  # the load's freed temporaries, back to the OS
        if self.device.type == "cpu":
            keep_step_buffers()  # and from here each step's, kept for the next
        codebook = kv_codebook.for_cache(self.model, self.tokenizer, self.kv_dtype)
        self.cache_engine = CacheEngine(self.arch, config.cache, num_blocks, num_host_blocks,
                                        self.device, self.kv_dtype, codebook)
        self._build_scheduler(num_blocks, num_host_blocks)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids)
        self.speculator = None
        if spec is not None:
            proposer = build_proposer(spec, loaded, max_model_len=self.max_model_len,
                                      dtype=self.dtype, device=self.device, cache=config.cache,
                                      kv_dtype=self.kv_dtype, num_blocks=num_blocks,
                                      draft_weights=draft_weights)
            self.speculator = Speculator(spec, proposer, self.max_model_len)
        self.requests: dict[str, _Request] = {}
        # False: token ids only; text and stop strings are the caller's (OutputProcessor), so
        # a step never waits on detokenizing. Set before the first request.
        self.detokenize = True
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0

    def _load(self, loaded, path, arch, block_size: int, num_blocks: int,
              num_host_blocks: int):
        """Check the memory plan of the model at `path` (when the weights are still to be
        read), then load the model unless the caller did. Returns the LoadedModel."""
        from qserve.loader import load_model
        from qserve.loader.weights import LazyWeights

        config, native = self.config, self.config.weights == "native"
        self.memory_plan = None
        if loaded is None or isinstance(loaded.weights, LazyWeights):  # nothing read yet
            per_block = bytes_per_block(arch, block_size, self.kv_dtype)
            self.memory_plan = plan_memory(
                path, arch, config, device=self.device, dtype=self.dtype,
                kv_bytes=num_blocks * per_block, host_kv_bytes=num_host_blocks * per_block,
                max_model_len=self.max_model_len)
            self.memory_plan.check()  # before any weight is read
        return loaded if loaded is not None else load_model(config.model, native=native)

    def _build_scheduler(self, num_blocks: int, num_host_blocks: int) -> None:
        """The block manager over the KV pool, the scheduler that owns it, and the runner
        that reads its block tables."""
        cache = self.config.cache
        watermark, staging = cache.watermark, None
        if cache.kv_offload == "layerwise":
            staging = StagingPlan(self.arch.num_layers, cache.kv_offload_lookahead)
            watermark = max(watermark, cache.kv_offload_reserve)
        self.block_manager = BlockManager(num_blocks, cache.block_size, num_host_blocks,
                                          watermark, cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.config.scheduler, self.block_manager,
                                   self.max_model_len, staging)
        self.runner = ModelRunner(self.model, self.cache_engine, self.block_manager, self.device,
                                  staging, max_num_seqs=self.config.scheduler.max_num_seqs)

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None = None,
                    params: SamplingParams | PoolingParams | None = None,
                    prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request: a generation (SamplingParams), or an embedding of the prompt
        (PoolingParams), which ends once its prompt is computed. Raises QServeError (a
        ValueError) for input that can never run."""
        pooling = None
        if isinstance(params, PoolingParams):
            pooling = self._resolve_pooling(params)
            params = SamplingParams(temperature=0, max_tokens=1, output_kind="final_only")
        elif not self.arch.generates:
            raise QServeError("this model was saved without its output layer (an embedding "
                              "model): it serves embeddings (LLM.embed, POST /v1/embeddings), "
                              "not generation")
        params = params or SamplingParams()
        if request_id in self.requests:
            raise QServeError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if not prompt:
                raise QServeError("the prompt is empty; give at least one token of text")
            prompt_token_ids = self.tokenizer.encode(prompt)
        if not prompt_token_ids:
            raise QServeError("the prompt is empty; give at least one token of text")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise QServeError(f"prompt token id {bad[0]} is outside the vocabulary "
                              f"[0, {self.arch.vocab_size})")
        # the n - 1 forks join the running batch at once, so they must fit it (10**20 of
        # them had looped forking)
        if params.n > self.config.scheduler.max_num_seqs:
            raise QServeError(f"n={params.n} is more than --max-num-seqs="
                              f"{self.config.scheduler.max_num_seqs}: a request's samples run "
                              f"in one batch")
        if len(prompt_token_ids) >= self.max_model_len:
            raise QServeError(
                f"the prompt has {len(prompt_token_ids)} tokens but --max-model-len is "
                f"{self.max_model_len}; shorten it to at most {self.max_model_len - 1} tokens")
        if (self.config.scheduler.max_waiting is not None
                and len(self.scheduler.waiting) >= self.config.scheduler.max_waiting):
            raise QueueFullError("the waiting queue is full; try again later")
        now = time.monotonic() if arrival_time is None else arrival_time
        seq = Sequence(request_id, 0, list(prompt_token_ids), len(prompt_token_ids), params, now)
        seq.num_forks = params.n - 1
        seq.pooling = pooling
        self._init_seq(seq)
        self.requests[request_id] = _Request(request_id, prompt, list(prompt_token_ids), params,
                                             [seq], RequestMetrics(arrival_time=now), {})
        self.scheduler.add(seq)
        self.num_prompt_tokens += len(prompt_token_ids)

    def _resolve_pooling(self, params: PoolingParams) -> PoolingParams:
        """params with its pooling decided: the request's, else the model's, else "last"."""
        kind = params.pooling or self.pooling or "last"
        if kind not in POOLING_TYPES:
            raise QServeError(f"this model pools its embeddings by {kind!r}, which qserve does "
                              f"not; ask for one of {', '.join(POOLING_TYPES)}")
        if params.dimensions is not None and params.dimensions > self.arch.hidden_size:
            raise QServeError(f"dimensions={params.dimensions} is more than the model's "
                              f"{self.arch.hidden_size}")
        return dataclasses.replace(params, pooling=kind)

    def _init_seq(self, seq: Sequence) -> None:
        if seq.pooling is not None:
            return  # nothing is sampled or detokenized
        if seq.params.seed is not None:
            seq.generator = torch.Generator(device=self.device)  # where the logits are
            seq.generator.manual_seed(hash((seq.params.seed, seq.index)) & (2**63 - 1))
        if self.detokenize:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids,
                                                     seq.params)

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            self.scheduler.finish(seq, "abort")

    def finish_sample(self, request_id: str, index: int) -> None:
        """End one sample that the caller found finished (a stop string, in token-only mode)."""
        req = self.requests.get(request_id)
        if req is None:
            return
        for seq in req.seqs:
            if seq.index == index:
                self.scheduler.finish(seq, "stop")
        if req.finished:
            del self.requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step. Returns a RequestOutput for each request the step ran
        (SamplingParams.output_kind "cumulative" or "delta"), or finished (every kind)."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        sampling = [s for s in out.scheduled if s.samples]  # before postprocess moves counts
        speculating = any(s.num_spec_tokens for s in sampling)
        # (S, vocab); with drafts, 1 + num_spec_tokens rows per sampling sequence
        logits = self.runner.run_speculative(out) if speculating else self._run(out)
        seqs = self.scheduler.postprocess(out)
        # embedding requests whose prompts this step finished (postprocess ended them)
        pooled = [s.seq for s in out.scheduled if s.seq.pooling is not None
                  and s.seq.is_finished and s.seq.request_id in self.requests]
        # (seq, its new tokens, their logprobs, whether they are verified drafts + one)
        new_tokens: list[tuple[Sequence, list[int], list, bool]] = []
        if speculating:
            seqs, logits = self._verify_drafts(sampling, logits, new_tokens)
        seqs, rows = self._fork_new_samples(seqs)
        if seqs:
            if len(rows) != logits.shape[0]:
                logits = logits[torch.tensor(rows)]
            sampled = self.sampler(logits, seqs)  # Sequences are SamplingRows (sampler.py)
            new_tokens += [(seq, [token], [lp], False) for seq, token, lp
                           in zip(seqs, sampled.token_ids, sampled.logprobs)]
        now = time.monotonic()
        touched: dict[str, _Request] = {}
        for seq in pooled:
            req = touched[seq.request_id] = self.requests[seq.request_id]
            req.metrics.first_token_time = now  # its one result
        for seq, tokens, lps, speculated in new_tokens:
            req = self.requests[seq.request_id]
            touched[req.request_id] = req
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            for token, lp in zip(tokens, lps):
                self._append(seq, token, lp)
                self.num_generated_tokens += 1
                if seq.is_finished:  # a stop inside an accepted run ends it there
                    break
            if speculated and not seq.is_finished:
                self.scheduler.accept_spec_tokens(seq, len(tokens) - 1)
        outputs = []
        for req in touched.values():
            finished = req.finished
            if finished or req.params.output_kind != "final_only":
                outputs.append(self._output(req, now, finished))
            if finished:
                del self.requests[req.request_id]
        return outputs

    def _run(self, out: SchedulerOutput) -> torch.Tensor:
        """The step's forward pass: (S, vocab) logits of its sampling sequences, in order.

        On a CPU a step that mixes one-token decodes with prompt chunks runs as two passes,
        the decodes first (with the step's block copies), then the chunks. One mixed pass
        would take every row through the prompt path (dequantized GEMMs, attention layer by
        layer) instead of the fused decode kernel, and a server admitting a prompt nearly
        every step would pay it for its whole batch (1 thread, 63 decodes + a 144-token
        prompt: 818 ms CPU mixed, 479 ms as decode 257 + prompt 222)."""
        decode = [s.num_new_tokens == 1 for s in out.scheduled]
        if self.device.type != "cpu" or out.staging or all(decode) or not any(decode):
            return self.runner.run(out)
        first = dataclasses.replace(out, scheduled=[s for s, d in zip(out.scheduled, decode)
                                                    if d])
        second = SchedulerOutput(scheduled=[s for s, d in zip(out.scheduled, decode) if not d])
        logits = torch.cat([self.runner.run(first), self.runner.run(second)])  # (S, vocab)
        # rows back in the step's order: the sampling decodes came first, then the chunks
        sampling = [d for s, d in zip(out.scheduled, decode) if s.samples]
        decodes, chunks = iter(range(sum(sampling))), iter(range(sum(sampling), len(sampling)))
        order = [next(decodes) if d else next(chunks) for d in sampling]
        if order != list(range(len(order))):
            logits = logits[torch.tensor(order, device=logits.device)]
        return logits

    def _verify_drafts(self, sampling: list, logits: torch.Tensor, new_tokens: list
                       ) -> tuple[list[Sequence], torch.Tensor]:
        """Verify the drafts of the sampling sequences that carried them, adding their tokens
        to new_tokens. Returns the other sampling sequences and their logits rows (S', vocab)."""
        drafts, rows, plain, plain_rows, start = [], [], [], [], 0
        for s in sampling:
            if s.num_spec_tokens:
                drafts.append((s.seq, s.spec_token_ids, s.spec_probs))
                rows.extend(range(start, start + 1 + s.num_spec_tokens))
            else:
                plain.append(s.seq)
                plain_rows.append(start)
            start += 1 + s.num_spec_tokens
        idx = lambda r: torch.tensor(r, dtype=torch.long, device=logits.device)  # noqa: E731
        verified = self.speculator.verify(logits[idx(rows)], drafts)
        new_tokens += [(seq, tokens, [None] * len(tokens), True)
                       for (seq, _, _), tokens in zip(drafts, verified)]
        return plain, logits[idx(plain_rows)]

    def _fork_new_samples(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """A request with n > 1 runs its prompt once; when the prompt is done, its n - 1
        siblings fork off it and sample from the same logits row."""
        all_seqs, rows = [], []
        for row, seq in enumerate(seqs):
            all_seqs.append(seq)
            rows.append(row)
            if seq.num_forks:
                req = self.requests[seq.request_id]
                for _ in range(seq.num_forks):
                    child = seq.fork(len(req.seqs))
                    self._init_seq(child)
                    self.scheduler.fork(seq, child)
                    req.seqs.append(child)
                    all_seqs.append(child)
                    rows.append(row)
                seq.num_forks = 0
        return all_seqs, rows

    def _append(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> None:
        p = seq.params
        seq.append_token(token)
        if seq.logprobs is not None:
            seq.logprobs.append(logprobs)
        reason = stop = None
        if token in self.eos_token_ids and not p.ignore_eos:
            reason = "stop"
        elif token in p.stop_token_ids:
            reason, stop = "stop", token
        elif seq.detokenizer is not None:
            _, stop = seq.detokenizer.add_tokens([token])
            if stop is not None:
                reason = "stop"
        if reason is None and (seq.num_output_tokens >= p.max_tokens
                               or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            if seq.detokenizer is not None and (stop is None or isinstance(stop, int)):
                seq.detokenizer.flush()  # release text held back for a stop string
            seq.stop_reason = stop
            self.scheduler.finish(seq, reason)

    def _output(self, req: _Request, now: float, finished: bool) -> RequestOutput:
        """The request's output as its output_kind asks: "delta" holds only the tokens,
        logprobs and text new since its previous output (nothing copied that was sent
        before); the other kinds everything so far. An embedding request's has no
        completions and, finished, its vector."""
        first = req.seqs[0]
        if finished:
            req.metrics.finished_time = now
        req.metrics.first_scheduled_time = first.first_scheduled_time
        if first.pooling is not None:
            return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [], finished,
                                 req.metrics, num_cached_tokens=first.num_cached_tokens,
                                 embedding=_embedding(first) if finished else None)
        delta = req.params.output_kind == "delta"
        completions = []
        for seq in req.seqs:
            tokens, pieces = req.sent.get(seq.index, (0, 0))
            new_text = ""
            if seq.detokenizer is not None:
                new_text, pieces = seq.detokenizer.text_since(pieces)
            n = seq.num_output_tokens
            req.sent[seq.index] = (n, pieces)
            if delta:
                ids, text = seq.token_ids[seq.num_prompt_tokens + tokens:], new_text
                logprobs = None if seq.logprobs is None else seq.logprobs[tokens:]
            else:
                ids, logprobs = seq.output_token_ids, seq.logprobs
                text = seq.detokenizer.text if seq.detokenizer is not None else ""
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=ids, num_tokens=n,
                finish_reason=seq.finish_reason, delta_text=new_text,
                logprobs=logprobs, stop_reason=seq.stop_reason,
                spec_steps=seq.spec_steps, spec_draft_tokens=seq.spec_draft_tokens,
                spec_accepted_tokens=seq.spec_accepted_tokens))
        prompt_logprobs = None
        if (first.prompt_logprobs is not None and not first.wants_prompt_logprobs
                and not (delta and req.prompt_logprobs_sent)):
            prompt_logprobs, req.prompt_logprobs_sent = first.prompt_logprobs, True
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions,
                             finished, req.metrics, num_cached_tokens=first.num_cached_tokens,
                             prompt_logprobs=prompt_logprobs)

    # ---- introspection -----------------------------------------------------------------
    def stats(self) -> dict:
        s, bm, ce = self.scheduler, self.block_manager, self.cache_engine
        return {
            "running": len(s.running), "waiting": len(s.waiting), "swapped": len(s.swapped),
            "kv_blocks_total": bm.num_blocks, "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_free": bm.num_free_blocks, "host_blocks_free": bm.num_free_host_blocks,
            "preemptions": s.num_preemptions, "swap_outs": s.num_swap_outs,
            "recomputes": s.num_recomputes,
            "prefix_cache_hit_blocks": s.num_prefix_hit_tokens // bm.block_size,
            "layerwise_admits": s.num_layerwise_admits,
            "kv_bytes_swapped_out": ce.bytes_swapped_out, "kv_bytes_swapped_in": ce.bytes_swapped_in,
            "kv_bytes_offloaded": ce.bytes_offloaded, "kv_bytes_fetched": ce.bytes_fetched,
            "prompt_tokens": self.num_prompt_tokens,
            "generated_tokens": self.num_generated_tokens,
        } | (self.speculator.stats() if self.speculator is not None else {})


def _embedding(seq: Sequence) -> list[float] | None:
    """A finished embedding request's vector: the pooled hidden state, its first
    `dimensions` values, scaled to unit length unless asked not to (None: aborted)."""
    if seq.pooled is None or seq.finish_reason == "abort":
        return None
    v = seq.pooled[:seq.pooling.dimensions]  # (hidden,) or its first `dimensions`
    if seq.pooling.normalize:
        v = torch.nn.functional.normalize(v, dim=0)
    return v.tolist()
