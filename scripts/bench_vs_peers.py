#!/usr/bin/env python3
"""qserve against its peers on the same machine, in one run, printed as one table.

    python scripts/bench_vs_peers.py [--repeats 3] [--input-len 128] [--output-len 128]

Rows: decode tokens/s at batch 1, throughput (generated tokens/s) with 32 concurrent requests
of 128 prompt + 128 new tokens, and prefill tokens/s (32 x 128 prompt tokens). Peers:
Hugging Face transformers `generate` at the same precision (fp32), and llama.cpp through
llama-cpp-python on the default GGUF where it is installed (it runs the GGUF's own Q4_1
weights, so that row is a different precision; its batch-32 cell is sequential requests,
since llama-cpp-python's high-level API serves one sequence at a time). Each cell is the
median of --repeats runs; ratios are qserve / peer.

Needs the `bench` extra (transformers, accelerate).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # run from a checkout, installed or not
os.environ.setdefault("QSERVE_HOME", str(REPO / ".cache" / "qserve"))


def bench_qserve(args) -> dict:
    from qserve.bench import run_bench
    from qserve.config import engine_config
    from qserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config(None, kv_cache_memory="1GiB", max_model_len=1024,
                                     max_num_batched_tokens=4096))
    runs = [run_bench(engine, [1, 32], args.input_len, args.output_len, seed=r, warmup=r == 0)
            for r in range(args.repeats)]
    b1 = [r[0] for r in runs]
    b32 = [r[1] for r in runs]
    return {
        "decode_b1": statistics.median(r["decode_tokens_per_s"] for r in b1),
        "throughput_b32": statistics.median(
            32 * args.output_len / r["total_s"] for r in b32),
        "prefill": statistics.median(r["prefill_tokens_per_s"] for r in b32),
    }


def bench_transformers(args, gguf: Path) -> dict:
    from hf_reference import hf_reference_dir
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_reference_dir(gguf)),
                                                 dtype=torch.float32).eval()
    vocab = model.config.vocab_size

    def gen(batch: int, new: int, seed: int) -> float:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(100, vocab, (batch, args.input_len), generator=g)
        mask = torch.ones_like(ids)
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    gen(2, 2, 0)  # warm-up
    b1, b32, pre = [], [], []
    for r in range(args.repeats):
        first = gen(1, 1, r)
        b1.append((args.output_len - 1) / (gen(1, args.output_len, r) - first))
        pre_t = gen(32, 1, r)
        pre.append(32 * args.input_len / pre_t)
        b32.append(32 * args.output_len / gen(32, args.output_len, r))
    return {"decode_b1": statistics.median(b1), "throughput_b32": statistics.median(b32),
            "prefill": statistics.median(pre)}


def bench_llama_cpp(args, gguf: Path) -> dict | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(gguf), n_ctx=1024, n_batch=512, n_threads=os.cpu_count(),
                verbose=False)
    import random

    def run(seed: int, new: int) -> tuple[float, float]:
        rng = random.Random(seed)
        prompt = [rng.randrange(100, llm.n_vocab()) for _ in range(args.input_len)]
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        t_prefill = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(new):
            nxt = llm.sample(temp=0.0)
            llm.eval([nxt])
        return t_prefill, time.perf_counter() - t

    run(0, 2)
    b1, pre, b32 = [], [], []
    for r in range(args.repeats):
        t_pre, t_dec = run(r, args.output_len)
        b1.append(args.output_len / t_dec)
        pre.append(args.input_len / t_pre)
        t = time.perf_counter()
        for i in range(32 if args.full_llama_cpp else 4):
            run(100 * r + i, args.output_len)
        per_req = (time.perf_counter() - t) / (32 if args.full_llama_cpp else 4)
        b32.append(args.output_len / per_req)  # requests served one after another
    return {"decode_b1": statistics.median(b1), "throughput_b32": statistics.median(b32),
            "prefill": statistics.median(pre)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--full-llama-cpp", action="store_true",
                    help="time all 32 sequential llama.cpp requests instead of 4")
    args = ap.parse_args()
    from qserve.loader.registry import resolve_model

    gguf = resolve_model(None)
    results = {"qserve fp32": bench_qserve(args),
               "transformers fp32": bench_transformers(args, gguf)}
    lc = bench_llama_cpp(args, gguf)
    if lc is not None:
        results["llama.cpp Q4_1"] = lc
    rows = [("decode tok/s, batch 1", "decode_b1"),
            ("throughput tok/s, 32 concurrent", "throughput_b32"),
            ("prefill tok/s, 32 x 128", "prefill")]
    names = list(results)
    ours = results["qserve fp32"]
    print(f"\nmodel: {gguf.name}, {os.cpu_count()} CPU threads, torch {torch.__version__}, "
          f"median of {args.repeats}")
    header = f"| {'metric':34} | " + " | ".join(f"{n:>18}" for n in names)
    header += " | " + " | ".join(f"{'qserve / ' + n.split()[0]:>22}" for n in names[1:]) + " |"
    print(header)
    print("|" + "|".join("-" * (len(c) + 0) for c in header.split("|")[1:-1]) + "|")
    for label, key in rows:
        cells = " | ".join(f"{results[n][key]:>18.1f}" for n in names)
        ratios = " | ".join(f"{ours[key] / results[n][key]:>21.2f}x" for n in names[1:])
        print(f"| {label:34} | {cells} | {ratios} |")


if __name__ == "__main__":
    main()
