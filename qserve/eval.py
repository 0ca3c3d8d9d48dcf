"""Quality evaluation through the real engine path: perplexity of a model over a text, and with
a reference model, the mean KL divergence of the next-token distributions and top-1 agreement.

Every log-prob comes from the engine itself: the text is scheduled as a sequence, computed
chunk by chunk (--max-num-batched-tokens) into paged KV blocks of the engine's --kv-dtype, so
quantized weights and quantized KV are measured exactly as they serve.

The text is tokenized once (no BOS) and cut into non-overlapping windows of `context` tokens;
each window starts from an empty cache and predicts its tokens 2..n, so

    PPL   = exp(mean over predicted tokens of -log p(token | window so far))
    KL    = mean over predicted positions of sum_v p_ref(v) (log p_ref(v) - log p(v))
    top-1 = fraction of positions where argmax p == argmax p_ref
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from qserve.engine.cache_engine import dtype_name
from qserve.engine.llm_engine import LLMEngine
from qserve.engine.sequence import Sequence
from qserve.errors import QServeError
from qserve.quant.calibration import default_text  # noqa: F401  (eval's default text)
from qserve.sampling_params import SamplingParams


def score(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """Log-probs of the next token at every position of `token_ids`, through the engine's
    scheduler, KV blocks and model runner; the blocks are freed afterwards.

    Args:
        engine: an idle engine with prefix caching off (a cached prefix would skip positions).
        token_ids: (n,) tokens, n <= the engine's max_model_len.
    Returns:
        (n, vocab) fp32 log-probs; row i is the distribution of token i + 1.
    """
    sched = engine.scheduler
    assert not sched.has_unfinished(), "score() needs an engine with no requests in flight"
    assert not engine.block_manager.enable_prefix_caching, "score() needs prefix caching off"
    seq = Sequence("eval", 0, list(token_ids), len(token_ids), SamplingParams(max_tokens=1))
    sched.add(seq)
    rows = []
    try:
        while seq.num_computed_tokens < seq.num_tokens:
            out = sched.schedule()
            assert [s.seq for s in out.scheduled] == [seq]
            rows.append(torch.log_softmax(engine.runner.run_all_positions(out), dim=-1))
            sched.postprocess(out)
    finally:
        sched.finish(seq, "length")
    return torch.cat(rows)  # (n, vocab)


@dataclass
class Scorer:
    """Anything else to evaluate beside engines (a peer library's model, say): `fn` maps a
    window (n,) of token ids to (n, vocab) log-probs, as score() does."""

    name: str
    kv_dtype: str
    fn: Callable[[list[int]], torch.Tensor]


@dataclass
class EvalResult:
    model: str
    kv_dtype: str  # the KV storage dtype the engine used (never "auto")
    num_tokens: int  # tokens evaluated (predicted), over all windows
    num_windows: int
    context: int
    ppl: float
    nll: float  # mean negative log-likelihood, nats per token
    ref: str | None = None
    ref_ppl: float | None = None
    kl: float | None = None  # mean KL(ref || model), nats
    top1: float | None = None  # top-1 agreement with the reference, in [0, 1]
    dtype: str | None = None  # the engine's activation dtype (None for a Scorer)

    def to_dict(self) -> dict:
        return asdict(self)


def windows(token_ids: list[int], context: int) -> list[list[int]]:
    """Non-overlapping windows of `context` tokens; a last window shorter than 2 is dropped
    (it would predict nothing)."""
    out = [token_ids[i:i + context] for i in range(0, len(token_ids), context)]
    return [w for w in out if len(w) >= 2]


@torch.inference_mode()
def evaluate(engine: LLMEngine, token_ids: list[int], context: int,
             ref_engine: LLMEngine | None = None, progress: bool = False) -> EvalResult:
    """Perplexity of `engine` over `token_ids` in windows of `context`; with `ref_engine`,
    KL(ref || model) and top-1 agreement as well (both engines see the same windows)."""
    return evaluate_all([engine], token_ids, context, ref_engine, progress)[0]


@torch.inference_mode()
def evaluate_all(engines: list[LLMEngine | Scorer], token_ids: list[int], context: int,
                 ref_engine: LLMEngine | None = None, progress: bool = False
                 ) -> list[EvalResult]:
    """evaluate() for several engines (or Scorers) over the same windows, scoring the reference
    once per window (a window's log-probs, (context, vocab) fp32, are too big to keep for a
    whole text). `progress`: a bar over the windows on a terminal's stderr."""
    from qserve.progress import bar

    wins = windows(token_ids, context)
    if not wins:
        raise QServeError("the text has fewer than 2 tokens; give a longer text")
    m = len(engines)
    nll, kl, agree = [0.0] * m, [0.0] * m, [0] * m
    ref_nll = 0.0
    for w in bar(len(wins), "eval", unit="window", disable=not progress, iterable=wins):
        target = torch.tensor(w[1:]).unsqueeze(1)  # (n - 1, 1)
        ref_lp = None
        if ref_engine is not None:
            ref_lp = score(ref_engine, w)[:-1]  # (n - 1, vocab): the last row predicts past w
            ref_nll -= ref_lp.gather(1, target).sum().item()
            ref_p = ref_lp.exp()
        for i, engine in enumerate(engines):
            if engine is ref_engine:
                lp = ref_lp
            else:
                lp = (engine.fn(w) if isinstance(engine, Scorer) else score(engine, w))[:-1]
            nll[i] -= lp.gather(1, target).sum().item()
            if ref_lp is not None:
                kl[i] += (ref_p * (ref_lp - lp)).sum().item()
                agree[i] += (ref_lp.argmax(-1) == lp.argmax(-1)).sum().item()
    n = sum(len(w) - 1 for w in wins)
    results = []
    for i, engine in enumerate(engines):
        name, kv, dtype = ((engine.name, engine.kv_dtype, None) if isinstance(engine, Scorer)
                           else (str(engine.model_path), dtype_name(engine.kv_dtype),
                                 dtype_name(engine.dtype)))
        res = EvalResult(model=name, kv_dtype=kv, dtype=dtype, num_tokens=n,
                         num_windows=len(wins),
                         context=context, ppl=math.exp(nll[i] / n), nll=nll[i] / n)
        if ref_engine is not None:
            res.ref = str(ref_engine.model_path)
            res.ref_ppl = math.exp(ref_nll / n)
            res.kl, res.top1 = kl[i] / n, agree[i] / n
        results.append(res)
    return results


def eval_engine(model: str | None, context: int, loaded=None, **engine) -> LLMEngine:
    """An engine sized for scoring windows of `context` tokens: max_model_len = context,
    prefix caching off, no watermark, and (unless given) a KV budget of one window's blocks."""
    from qserve.config import engine_config
    from qserve.engine.cache_engine import bytes_per_block
    from qserve.engine.memory_plan import resolve_kv_dtype
    from qserve.loader import load_arch, resolve_model

    engine = {**engine, "max_model_len": context, "enable_prefix_caching": False,
              "watermark": 0.0}
    config = engine_config(model, **engine)
    if config.cache.kv_cache_memory is None:
        path = loaded.path if loaded is not None else resolve_model(model)
        arch = loaded.arch if loaded is not None else load_arch(path)
        kv_dtype = resolve_kv_dtype(path, arch, config, loaded)
        bs = config.cache.block_size
        config.cache.kv_cache_memory = -(-context // bs) * bytes_per_block(arch, bs, kv_dtype)
    from qserve.llm import make_engine

    return make_engine(config, loaded=loaded)


def tokenize_for_eval(engine: LLMEngine, text: str, max_tokens: int | None,
                      ref_engine: LLMEngine | None = None) -> list[int]:
    """The text's tokens (no special tokens), cut to `max_tokens`; a reference model must
    tokenize it the same way, or KL and top-1 would compare different positions."""
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if ref_engine is not None:
        ref_ids = ref_engine.tokenizer.encode(text, add_special_tokens=False)[:len(ids)]
        if ref_ids != ids or ref_engine.arch.vocab_size != engine.arch.vocab_size:
            raise QServeError(
                f"--ref {ref_engine.model_path} tokenizes the text differently from "
                f"{engine.model_path}; KL and top-1 need a reference with the same tokenizer")
    return ids
