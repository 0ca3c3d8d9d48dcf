"""Throughput and latency of one engine on random prompts: the measurement behind `qserve bench`,
importable by scripts that put qserve beside its peers.

For each batch size B, B prompts of `input_len` random ordinary tokens are queued at once and
run greedily, ignoring EOS, for exactly `output_len` tokens each:

    t0 ──prefill──> t_first (every request has its first token) ──decode──> t_end

    prefill tok/s = B * input_len / (t_first - t0)
    decode tok/s  = tokens generated after t_first / (t_end - t_first)
    TTFT          = first_token_time - arrival_time, per request (mean, p50)
    TPOT          = (finished_time - first_token_time) / (output_len - 1), per request (mean)

With speculative decoding on, each row also reports the acceptance rate (accepted / proposed
draft tokens) and the mean accepted drafts per verifying step, over that row's run.
"""
from __future__ import annotations

import random
import statistics
import sys
import time

from qserve.engine.cache_engine import dtype_name
from qserve.errors import QServeError
from qserve.sampling_params import SamplingParams


def _check_fits(engine, input_len: int, output_len: int) -> None:
    """Refuse lengths the engine would cut short, before any time is spent."""
    if input_len + output_len > engine.max_model_len:
        raise QServeError(
            f"--input-len {input_len} + --output-len {output_len} exceeds --max-model-len "
            f"{engine.max_model_len}; lower them or raise --max-model-len")


def run_bench(engine, batch_sizes: list[int], input_len: int = 128, output_len: int = 128,
              seed: int = 0, warmup: bool = True, progress: bool = False) -> list[dict]:
    """Measure `engine` (an idle LLMEngine) at each batch size; with `progress`, a bar of the
    tokens generated so far on a terminal's stderr (qserve/progress.py).

    Returns:
        one dict per batch size: batch_size, input_len, output_len, prefill_tokens_per_s,
        decode_tokens_per_s, ttft_mean_s, ttft_p50_s, tpot_mean_s, total_s, peak_rss_mib,
        peak_gpu_mib (None off CUDA), preemptions; spec_acceptance_rate and
        spec_mean_accepted_tokens with speculative decoding. A rate is None when its interval
        is empty (e.g. decode with output_len 1).
    """
    from qserve.progress import bar

    _check_fits(engine, input_len, output_len)
    rng = random.Random(seed)
    vocab = _ordinary_tokens(engine)
    warm_len = min(output_len, 2)
    total = sum(batch_sizes) * output_len + (max(batch_sizes) * warm_len if warmup else 0)
    with bar(total, "bench", unit="tok", disable=not progress) as shown:
        if warmup:  # first-call costs (allocation, kernel compilation) at the largest shape
            _run_batch(engine, rng, vocab, max(batch_sizes), input_len, warm_len, "warmup",
                       shown.update)
        rows = []
        for b in batch_sizes:
            shown.set_postfix_str(f"batch {b}")
            rows.append(_run_batch(engine, rng, vocab, b, input_len, output_len, f"b{b}",
                                   shown.update))
    return rows


def _ordinary_tokens(engine) -> list[int]:
    """Token ids a random prompt may use: none special, none that ends generation."""
    tok = engine.tokenizer
    banned = set(tok.all_special_ids) | set(engine.arch.eos_token_ids) | tok.eos_token_ids
    if engine.arch.bos_token_id is not None:
        banned.add(engine.arch.bos_token_id)
    return [t for t in range(min(engine.arch.vocab_size, tok.vocab_size)) if t not in banned]


def _run_batch(engine, rng: random.Random, vocab: list[int], batch: int, input_len: int,
               output_len: int, tag: str, on_tokens=None) -> dict:
    """One row; `on_tokens(n)` hears of each step's n newly generated tokens."""
    cuda = engine.device.type == "cuda"
    if cuda:
        import torch

        torch.cuda.reset_peak_memory_stats(engine.device)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    rids = [f"bench-{tag}-{i}" for i in range(batch)]
    before = engine.stats()
    metrics, tokens = {}, {}  # request id -> RequestMetrics, generated token count
    done = set()
    t_first = generated_at_first = None
    try:
        t0 = time.monotonic()
        for rid in rids:
            prompt = [rng.choice(vocab) for _ in range(input_len)]
            engine.add_request(rid, None, params, prompt_token_ids=prompt, arrival_time=t0)
        while len(done) < batch:
            so_far = sum(tokens.values()) if on_tokens is not None else 0
            for out in engine.step():
                metrics[out.request_id] = out.metrics
                tokens[out.request_id] = len(out.outputs[0].token_ids)
                if out.finished:
                    done.add(out.request_id)
            if on_tokens is not None:
                on_tokens(sum(tokens.values()) - so_far)
            if t_first is None and len(metrics) == batch:
                t_first, generated_at_first = time.monotonic(), sum(tokens.values())
        t_end = time.monotonic()
    finally:
        for rid in rids:
            engine.abort(rid)
    ms = [metrics[r] for r in rids]
    ttft = [m.first_token_time - m.arrival_time for m in ms]
    tpot = [(m.finished_time - m.first_token_time) / (output_len - 1)
            for m in ms if output_len > 1]
    decoded = batch * output_len - generated_at_first
    return {
        "batch_size": batch, "input_len": input_len, "output_len": output_len,
        "prefill_tokens_per_s": batch * input_len / (t_first - t0),
        "decode_tokens_per_s": decoded / (t_end - t_first) if decoded and t_end > t_first else None,
        "ttft_mean_s": statistics.fmean(ttft), "ttft_p50_s": statistics.median(ttft),
        "tpot_mean_s": statistics.fmean(tpot) if tpot else None,
        "total_s": t_end - t0,
        "peak_rss_mib": peak_rss_bytes() / 2**20,
        "peak_gpu_mib": _peak_gpu_bytes(engine.device) / 2**20 if cuda else None,
        "preemptions": engine.stats()["preemptions"] - before["preemptions"],
        "dtype": dtype_name(engine.dtype), "kv_dtype": dtype_name(engine.kv_dtype),
    } | spec_row_stats(before, engine.stats())


def spec_row_stats(before: dict, after: dict) -> dict:
    """Acceptance between two engine.stats() snapshots ({} without speculative decoding)."""
    if "spec_steps" not in after:
        return {}
    steps, drafts, accepted = (after[k] - before[k] for k in (
        "spec_steps", "spec_draft_tokens", "spec_accepted_tokens"))
    return {"spec_acceptance_rate": accepted / drafts if drafts else None,
            "spec_mean_accepted_tokens": accepted / steps if steps else None}


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far (it never goes down between rows)."""
    try:
        import resource
    except ImportError:  # not Unix
        import psutil

        mem = psutil.Process().memory_info()
        return getattr(mem, "peak_wset", mem.rss)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # macOS: bytes, Linux: KiB


def _peak_gpu_bytes(device) -> int:
    import torch

    return torch.cuda.max_memory_allocated(device)


_MS = 1000.0
_COLUMNS = [  # (key, header, format, scale)
    ("batch_size", "batch", "{:d}", 1), ("input_len", "in", "{:d}", 1),
    ("output_len", "out", "{:d}", 1), ("prefill_tokens_per_s", "prefill tok/s", "{:,.0f}", 1),
    ("decode_tokens_per_s", "decode tok/s", "{:,.1f}", 1),
    ("ttft_mean_s", "TTFT mean ms", "{:.1f}", _MS), ("ttft_p50_s", "TTFT p50 ms", "{:.1f}", _MS),
    ("tpot_mean_s", "TPOT ms", "{:.1f}", _MS), ("peak_rss_mib", "peak RSS MiB", "{:,.0f}", 1),
    ("peak_gpu_mib", "peak GPU MiB", "{:,.0f}", 1), ("preemptions", "preempt", "{:d}", 1),
    ("spec_acceptance_rate", "accept %", "{:.1f}", 100),
    ("spec_mean_accepted_tokens", "accepted/step", "{:.2f}", 1),
]


def format_table(rows: list[dict]) -> str:
    """The rows as an aligned text table; times in milliseconds."""
    cols = [c for c in _COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    cells = [[header for _, header, _, _ in cols]]
    for r in rows:
        cells.append(["-" if r.get(key) is None else fmt.format(r[key] * scale)
                      for key, _, fmt, scale in cols])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
