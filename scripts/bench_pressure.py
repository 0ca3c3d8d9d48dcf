"""Memory pressure: time to first token and throughput under Poisson arrivals against a small
device KV pool, for four ways of running out of blocks, measured in the same run.

    python scripts/bench_pressure.py                           # the issue's workload
    python scripts/bench_pressure.py --scale 0.25 --rates 0.15,0.3,0.45 --requests 24

Modes (all on the same model, pool, arrivals and outputs):
    baseline    request-level admission: a prompt starts only when device blocks for all of it
                are free (no chunked prefill); recompute preemption
    recompute   chunked prefill (a prompt starts when its first chunk fits); recompute
    swap        chunked prefill; preemption by swapping blocks to host memory
    layerwise   chunked prefill; --kv-offload layerwise: a prompt starts with staging blocks
                for a few layers and keeps its K/V in host memory until it can decode;
                layerwise@R sets its --kv-offload-reserve to R

Workload: request i arrives after an exponential gap (mean 1 / rate, seeded, the same arrival
times for every mode); prompt lengths uniform in [256, 2048] tokens, outputs in [64, 512]
(times --scale), greedy with ignore_eos so every mode does the same work. Prompts are
distinct slices of Python's own documentation text (pydoc_data), so the prefix cache does not
help. The engine runs in this process in real time: a request is added when its arrival time
comes, and steps run while there is work.

Per request: TTFT = first token - arrival; TPOT = (finish - first token) / (output tokens - 1).
Throughput = output tokens / (last finish - first arrival). A mode "keeps up" at a rate when
its last request finishes within --drain seconds of the last arrival. With --repeats N each
cell is the median of N runs (the same arrivals each time). The verdict compares each layerwise
mode with baseline at the highest rate where baseline keeps up: TTFT p99 at least 5x lower,
throughput within 5%.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("QSERVE_HOME", str(REPO / ".cache" / "qserve"))

MODES = {
    "baseline": dict(enable_chunked_prefill=False, preemption_mode="recompute"),
    "recompute": dict(preemption_mode="recompute"),
    "swap": dict(preemption_mode="swap"),
    "layerwise": dict(preemption_mode="recompute", kv_offload="layerwise"),
}


def workload(tokens: list[int], n: int, rate: float, scale: float, seed: int
             ) -> list[tuple[float, list[int], int]]:
    """(arrival offset s, prompt ids, output tokens) per request."""
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        plen = int(rng.randint(256, 2048) * scale)
        start = rng.randrange(0, len(tokens) - plen)
        reqs.append((t, tokens[start:start + plen], int(rng.randint(64, 512) * scale)))
    return reqs


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run(engine, reqs, drain: float) -> dict:
    from qserve import SamplingParams

    pending = list(reqs)
    t0 = time.monotonic()
    done: dict[str, object] = {}
    last_arrival = t0 + reqs[-1][0]
    stats0 = engine.stats()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic()
        while pending and t0 + pending[0][0] <= now:
            offset, ids, out_len = pending.pop(0)
            engine.add_request(f"r{len(reqs) - len(pending)}", prompt_token_ids=ids,
                               params=SamplingParams(temperature=0, max_tokens=out_len,
                                                     ignore_eos=True),
                               arrival_time=t0 + offset)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, t0 + pending[0][0] - time.monotonic()))
            continue
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if time.monotonic() > last_arrival + drain:  # fell behind: stop, report what finished
            for rid in list(engine.requests):
                engine.abort(rid)
            break
    end = time.monotonic()
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in done.values()]
    tpot = [(o.metrics.finished_time - o.metrics.first_token_time)
            / max(1, len(o.outputs[0].token_ids) - 1) for o in done.values()]
    tokens = sum(len(o.outputs[0].token_ids) for o in done.values())
    stats = engine.stats()
    finish = max((o.metrics.finished_time for o in done.values()), default=end)
    return {
        "completed": len(done), "requests": len(reqs), "kept_up": len(done) == len(reqs),
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "ttft_p99_s": pct(ttft, 0.99) if ttft else None,
        "tpot_p50_s": statistics.median(tpot) if tpot else None,
        "throughput_tok_s": tokens / (finish - t0 - reqs[0][0]) if done else 0.0,
        "preemptions": stats["preemptions"] - stats0["preemptions"],
        "layerwise_admits": stats["layerwise_admits"] - stats0["layerwise_admits"],
        "offloaded_mib": (stats["kv_bytes_offloaded"] - stats0["kv_bytes_offloaded"]) / 2**20,
        "swapped_mib": (stats["kv_bytes_swapped_out"] - stats0["kv_bytes_swapped_out"]
                        + stats["kv_bytes_swapped_in"] - stats0["kv_bytes_swapped_in"]) / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="alias, .gguf or HF directory [default model]")
    ap.add_argument("--rates", default="0.1,0.2,0.3", help="request rates, requests/s")
    ap.add_argument("--requests", type=int, default=32, help="requests per rate")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="multiply prompt and output lengths (CPU runs use < 1)")
    ap.add_argument("--pool-tokens", type=int, default=None,
                    help="device KV pool, in tokens [default: 3 of the longest requests]")
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--offload-lookahead", type=int, default=4,
                    help="--kv-offload-lookahead of the layerwise modes")
    ap.add_argument("--repeats", type=int, default=1, help="runs per cell; cells show medians")
    ap.add_argument("--drain", type=float, default=120.0,
                    help="seconds after the last arrival a mode may take to finish")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()

    import pydoc_data.topics

    from qserve.config import engine_config
    from qserve.engine.cache_engine import KV_STORAGE, bytes_per_block
    from qserve.engine.llm_engine import LLMEngine
    from qserve.loader import load_model
    from qserve.loader.registry import resolve_model

    loaded = load_model(str(resolve_model(args.model)))
    text = "\n\n".join(pydoc_data.topics.topics.values())
    tokens = loaded.tokenizer.encode(text)
    longest = int(2048 * args.scale) + int(512 * args.scale)
    pool_tokens = args.pool_tokens or 3 * longest
    bs = 16
    dtype = KV_STORAGE["fp32" if args.kv_dtype == "auto" else args.kv_dtype]
    per_block = bytes_per_block(loaded.arch, bs, dtype)
    pool_bytes = -(-pool_tokens // bs) * per_block
    print(f"pool: {pool_tokens} tokens ({pool_bytes / 2**20:.0f} MiB, {args.kv_dtype} KV); "
          f"prompts {int(256 * args.scale)}-{int(2048 * args.scale)}, outputs "
          f"{int(64 * args.scale)}-{int(512 * args.scale)} tokens; {args.requests} requests "
          f"per rate", flush=True)

    rows = []
    for rate in [float(r) for r in args.rates.split(",")]:
        reqs = workload(tokens, args.requests, rate, args.scale, args.seed)
        for mode in args.modes.split(","):
            name, _, reserve = mode.partition("@")
            flags = dict(MODES[name])
            if name == "layerwise":
                flags["kv_offload_lookahead"] = args.offload_lookahead
                if reserve:
                    flags["kv_offload_reserve"] = float(reserve)
            runs = []
            for _ in range(args.repeats):
                cfg = engine_config(None, kv_cache_memory=pool_bytes, max_model_len=longest + 1,
                                    swap_space="2GiB", kv_dtype=args.kv_dtype, **flags)
                engine = LLMEngine(cfg, loaded)
                runs.append(run(engine, reqs, args.drain))
                del engine
            row = {"rate": rate, "mode": mode, **_median(runs)}
            rows.append(row)
            print(_fmt(row), flush=True)
    print()
    print(_table(rows))
    print(_verdict(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


def _median(runs: list[dict]) -> dict:
    """Each numeric field's median over the runs; kept_up only if every run kept up."""
    row = {}
    for key, value in runs[0].items():
        values = [r[key] for r in runs]
        if isinstance(value, bool):
            row[key] = all(values)
        elif any(v is None for v in values):
            row[key] = None
        else:
            row[key] = statistics.median(values)
    row["runs"] = runs
    return row


def _fmt(r: dict) -> str:
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    return (f"| {r['rate']:.2f} | {r['mode']} | {r['completed']:.0f}/{r['requests']} "
            f"| {f(r['ttft_p50_s'], '.2f')} | {f(r['ttft_p99_s'], '.2f')} "
            f"| {f(r['tpot_p50_s'] and r['tpot_p50_s'] * 1000, '.0f')} "
            f"| {r['throughput_tok_s']:.1f} | {r['preemptions']:.0f} | {r['layerwise_admits']:.0f} "
            f"| {r['offloaded_mib']:.0f} | {r['swapped_mib']:.0f} |")


def _table(rows: list[dict]) -> str:
    head = ("| rate req/s | mode | done | TTFT p50 s | TTFT p99 s | TPOT p50 ms | tok/s "
            "| preempt | layer-wise | offloaded MiB | swapped MiB |")
    return "\n".join([head, "|" + "---|" * 11] + [_fmt(r) for r in rows])


def _verdict(rows: list[dict]) -> str:
    base = {r["rate"]: r for r in rows if r["mode"] == "baseline"}
    ok = [rate for rate, r in base.items() if r["kept_up"]]
    if not ok:
        return "verdict: baseline kept up at no rate measured; lower --rates"
    rate = max(ok)
    b = base[rate]
    lines = []
    for r in rows:
        if r["rate"] != rate or not r["mode"].startswith("layerwise"):
            continue
        ttft = b["ttft_p99_s"] / r["ttft_p99_s"]
        tput = r["throughput_tok_s"] / b["throughput_tok_s"]
        lines.append(f"verdict at {rate} req/s (highest rate where baseline keeps up), "
                     f"{r['mode']}: TTFT p99 {ttft:.1f}x lower (target >= 5x: "
                     f"{'PASS' if ttft >= 5 else 'MISS'}), throughput {tput:.2f}x baseline "
                     f"(target >= 0.95x: {'PASS' if tput >= 0.95 else 'MISS'})")
    return "\n".join(lines) or "verdict: no layerwise mode measured"


if __name__ == "__main__":
    main()
