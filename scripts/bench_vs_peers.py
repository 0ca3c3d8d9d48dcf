#!/usr/bin/env python3
"""qserve against its peers on the same machine, in one run, printed as one table.

    python scripts/bench_vs_peers.py [--repeats 3] [--input-len 128] [--output-len 128]
                                     [--only qserve-gguf-native,llama.cpp] [--json [FILE]]

Rows: decode tokens/s at batch 1; throughput with 32 concurrent requests of 128 prompt + 128
new tokens (32 x 128 generated tokens / wall time, prefill included); prefill tokens/s
(32 x 128 prompt tokens). Columns, each measured in this run on the default model:

    qserve-fp32         qserve, the model's weights dequantized to dense fp32
    qserve-gguf-native  qserve, int4 g32 asym layers + int8 g32 embedding imported losslessly
                        from the GGUF (the very weights llama.cpp runs)
    qserve-w8           qserve, recipe w8
    transformers        Hugging Face transformers `generate`, fp32
    llama.cpp           llama.cpp on the GGUF's own Q4_1 weights, through llama-cpp-python's
                        low-level API: the 32 sequences share one context, and each decode
                        step is one llama_decode over all of them (scripts/llama_cpp_batched.py)

The quantized checkpoints are made once with `qserve quantize` into .cache/bench-ckpt/
(delete a directory there to remake it after a checkpoint format change).
Each cell is the median of --repeats runs; ratio columns are qserve / peer. Below the table,
each target of issues #2 and #4 is checked against the measured numbers.

Needs the `bench` extra (transformers, accelerate) and llama-cpp-python for the llama.cpp
column (skipped, with a note, when it is not installed).
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # run from a checkout, installed or not
os.environ.setdefault("QSERVE_HOME", str(REPO / ".cache" / "qserve"))
CKPT_DIR = REPO / ".cache" / "bench-ckpt"
N_CONCURRENT = 32

COLUMNS = {  # --only name -> table header
    "qserve-fp32": "qserve fp32",
    "qserve-gguf-native": "qserve gguf-native",
    "qserve-w8": "qserve w8",
    "transformers": "transformers fp32",
    "llama.cpp": "llama.cpp Q4_1",
}
QSERVE_RECIPES = {"qserve-fp32": None, "qserve-gguf-native": "gguf-native", "qserve-w8": "w8"}
PEERS = ["transformers", "llama.cpp"]
ROWS = [("decode tok/s, batch 1", "decode_b1"),
        (f"throughput tok/s, {N_CONCURRENT} concurrent", "throughput_b32"),
        ("prefill tok/s, {n} x {len}", "prefill")]
TARGETS = [  # (label, qserve column, peer column, row key, minimum ratio); issues #4 and #2
    ("int4 (gguf-native) batch-1 decode", "qserve-gguf-native", "llama.cpp", "decode_b1", 0.8),
    ("int4 (gguf-native) 32-concurrent", "qserve-gguf-native", "llama.cpp", "throughput_b32",
     1.5),
    ("int4 (gguf-native) prefill", "qserve-gguf-native", "llama.cpp", "prefill", 1.0),
    ("int8 (w8) batch-1 decode", "qserve-w8", "transformers", "decode_b1", 3.0),
    ("fp32 batch-1 decode", "qserve-fp32", "transformers", "decode_b1", 1.1),
    ("fp32 32-concurrent", "qserve-fp32", "transformers", "throughput_b32", 1.5),
]


def checkpoint(gguf: Path, recipe: str) -> Path:
    """The qserve checkpoint of `gguf` under `recipe`, made with `qserve quantize` if missing
    (quantize writes the directory only once it has succeeded)."""
    out = CKPT_DIR / recipe
    if not out.exists():
        print(f"making {out} (qserve quantize --recipe {recipe}) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "qserve", "quantize", str(gguf), "-o", str(out),
                        "--recipe", recipe], check=True, stdout=subprocess.DEVNULL, cwd=REPO)
    return out


def bench_qserve(args, model: Path | None) -> dict[str, list[float]]:
    """qserve through qserve.bench.run_bench; `model` None is the default model in fp32."""
    from qserve.bench import run_bench
    from qserve.config import engine_config
    from qserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config(
        None if model is None else str(model), kv_cache_memory="1GiB",
        max_model_len=max(1024, args.input_len + args.output_len),
        max_num_batched_tokens=max(4096, args.input_len)))
    runs = [run_bench(engine, [1, N_CONCURRENT], args.input_len, args.output_len, seed=r,
                      warmup=r == 0) for r in range(args.repeats)]
    return {"decode_b1": [b1["decode_tokens_per_s"] for b1, _ in runs],
            "throughput_b32": [N_CONCURRENT * args.output_len / b32["total_s"]
                               for _, b32 in runs],
            "prefill": [b32["prefill_tokens_per_s"] for _, b32 in runs]}


def bench_transformers(args, gguf: Path) -> dict[str, list[float]]:
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
        pre.append(N_CONCURRENT * args.input_len / gen(N_CONCURRENT, 1, r))
        b32.append(N_CONCURRENT * args.output_len / gen(N_CONCURRENT, args.output_len, r))
    return {"decode_b1": b1, "throughput_b32": b32, "prefill": pre}


def bench_llama_cpp(args, gguf: Path) -> dict[str, list[float]]:
    """llama.cpp with real batching: batch 1 and 32 sequences through one context."""
    from llama_cpp_batched import BatchedLlama

    seq_len = -(-max(256, args.input_len + args.output_len) // 256) * 256
    llm = BatchedLlama(gguf, n_seq=N_CONCURRENT, max_seq_len=seq_len,
                       max_prompt_tokens=N_CONCURRENT * args.input_len,
                       n_threads=os.cpu_count())

    def prompts(n: int, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(100, llm.n_vocab) for _ in range(args.input_len)]
                for _ in range(n)]

    try:
        llm.generate(prompts(N_CONCURRENT, -1), 2)  # warm-up at the largest shape
        b1, b32, pre = [], [], []
        for r in range(args.repeats):
            one = llm.generate(prompts(1, r), args.output_len)
            b1.append((args.output_len - 1) / one["decode_s"])
            many = llm.generate(prompts(N_CONCURRENT, r), args.output_len)
            pre.append(N_CONCURRENT * args.input_len / many["prefill_s"])
            b32.append(N_CONCURRENT * args.output_len / many["total_s"])
    finally:
        llm.close()
    return {"decode_b1": b1, "throughput_b32": b32, "prefill": pre}


def measure(name: str, args, gguf: Path) -> dict[str, list[float]]:
    if name in QSERVE_RECIPES:
        recipe = QSERVE_RECIPES[name]
        return bench_qserve(args, None if recipe is None else checkpoint(gguf, recipe))
    if name == "transformers":
        return bench_transformers(args, gguf)
    return bench_llama_cpp(args, gguf)


def markdown(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table: the first column left-aligned, numbers right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *map(line, rows)])


def report(args, medians: dict[str, dict[str, float]]) -> str:
    ours = [n for n in medians if n in QSERVE_RECIPES]
    peers = [n for n in PEERS if n in medians]
    pairs = [(q, p) for q in ours for p in peers]
    header = ["metric", *(COLUMNS[n] for n in medians),
              *(f"{COLUMNS[q].removeprefix('qserve ')} / {p}" for q, p in pairs)]
    rows = []
    for label, key in ROWS:
        label = label.format(n=N_CONCURRENT, len=args.input_len)
        rows.append([label, *(f"{medians[n][key]:.1f}" for n in medians),
                     *(f"{medians[q][key] / medians[p][key]:.2f}x" for q, p in pairs)])
    lines = [markdown(header, rows), "",
             "targets (issues #4, #2; qserve / peer, this run):"]
    for label, q, p, key, need in TARGETS:
        if q in medians and p in medians:
            ratio = medians[q][key] / medians[p][key]
            verdict = f"{ratio:.2f}x {'PASS' if ratio >= need else 'MISS'}"
        else:
            verdict = "not measured"
        lines.append(f"- {label} >= {need:g}x {COLUMNS[p]}: {verdict}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell; the median is shown")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--only", metavar="COL,...",
                    help=f"columns to measure, of {','.join(COLUMNS)}  [default: all]")
    ap.add_argument("--json", nargs="?", const="-", metavar="FILE",
                    help="also write every run's numbers as JSON to FILE (stdout without one)")
    args = ap.parse_args()
    if args.repeats < 1 or args.input_len < 1 or args.output_len < 2:
        ap.error("--repeats and --input-len must be >= 1 and --output-len >= 2 "
                 "(batch-1 decode needs a token after the first)")
    names = list(COLUMNS) if args.only is None else [n.strip() for n in args.only.split(",")]
    if bad := [n for n in names if n not in COLUMNS]:
        ap.error(f"--only: unknown column {', '.join(bad)}; choose from {', '.join(COLUMNS)}")
    names = [n for n in COLUMNS if n in names]  # table order
    if "llama.cpp" in names and importlib.util.find_spec("llama_cpp") is None:
        print("llama-cpp-python is not installed: no llama.cpp column", file=sys.stderr)
        names.remove("llama.cpp")
    from qserve.loader.registry import resolve_model

    gguf = resolve_model(None)
    runs = {}
    for name in names:
        print(f"measuring {COLUMNS[name]} ...", file=sys.stderr)
        runs[name] = measure(name, args, gguf)
        gc.collect()  # the previous column's model goes before the next one loads
    medians = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in runs.items()}
    print(f"\nmodel: {gguf.name}, {os.cpu_count()} CPU threads, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), {args.input_len} prompt + {args.output_len} "
          f"new tokens, median of {args.repeats}\n")
    print(report(args, medians))
    if args.json:
        dump = json.dumps({"model": gguf.name, "cpu_threads": os.cpu_count(),
                           "input_len": args.input_len, "output_len": args.output_len,
                           "concurrent": N_CONCURRENT, "runs": runs, "median": medians},
                          indent=2)
        if args.json == "-":
            print(dump)
        else:
            Path(args.json).write_text(dump + "\n")


if __name__ == "__main__":
    main()
