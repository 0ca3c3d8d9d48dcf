#!/usr/bin/env python3
"""qserve against its peers on the same machine and GGUF file, in one run, printed as one table.

    python scripts/bench_vs_peers.py [--model FILE.gguf] [--repeats 3] [--rounds 1]
                                     [--threads N] [--input-len 128] [--output-len 128]
                                     [--only qserve,llama.cpp] [--json [FILE]] [--isa avx2]

Rows: decode tokens/s at batch 1; prefill tokens/s of one prompt; throughput with 32 concurrent
requests of 128 prompt + 128 new tokens (32 x 128 generated tokens / wall time, prefill
included); prefill tokens/s of those 32 prompts; each column's peak resident memory. Columns
(--only picks; default: qserve,llama.cpp), each measured in this run on --model (default: the
default model):

    qserve              qserve on the GGUF as it loads it by default
    qserve-gguf-native  qserve, a `qserve quantize --recipe gguf-native` checkpoint of the GGUF
    qserve-w8           qserve, recipe w8
    transformers        Hugging Face transformers `generate`, fp32
    llama.cpp           native llama.cpp built for this CPU (scripts/peer.py builds it once):
                        llama-bench -n -d for batch-1 decode, -p for one-prompt prefill,
                        llama-batched-bench -npl 32 for the concurrent rows
    llama-cpp-python    llama.cpp through the llama-cpp-python wheel's low-level API, 32
                        sequences in one context (scripts/llama_cpp_batched.py)

Under the table, the batch-1 decode as a memory stream: each side's decode rate times the
file's size (a token reads every weight once), against a plain read of 1 GiB on the same
threads (torch's int32 max, in a child, once a round).

Every column runs in its own child process (this script again, or the llama.cpp binaries), so
one column's memory never counts toward another's: peak RSS is the child's own ru_maxrss (from
wait4; for llama.cpp the larger of llama-bench's and llama-batched-bench's). Linux counts the
parent's resident memory at fork into a child's peak too, so this process imports neither torch
nor qserve. Each cell is the median of --repeats runs (llama-bench's per-repetition samples);
ratio columns are qserve / peer. Below the table each target is checked against these numbers.

--rounds N measures the columns N times in turn (qserve, llama.cpp, qserve, llama.cpp, ...),
each time --repeats runs, and pools the runs (peak RSS: the largest). On a machine whose speed
drifts over minutes (a shared VM: one column measured in a slow spell and the other in a fast
one moved batch-1 ratios by 0.3 here) the drift then weighs on both sides alike; each round's
own ratios for the targets are printed under the table.

--isa avx2 measures both sides as an AVX2-only CPU (a Zen 3) would run them, on a CPU that has
AVX-512: qserve's kernels built with QSERVE_CPU_ISA=avx2, torch's own kernels held to AVX2 too
(AVX2_ENV: ATen's vectorized ops, MKL's GEMMs, oneDNN; without them torch ran its attention,
elementwise ops and fp32 GEMMs in AVX-512, 1.5x faster for an fp32 GEMM here than a Zen 3
would get), and llama.cpp's second build, QSERVE_PEER_ISA=avx2 (scripts/peer.py: GGML_NATIVE
off, AVX2 + FMA + F16C, no AVX-512). --isa avx2-vnni is the same with AVX-VNNI on both sides
(an Intel core without AVX-512, Alder Lake and later: qserve's int8 GEMM and llama.cpp's dot
products in 256-bit vpdpbusd; QSERVE_CPU_ISA=avx2-vnni, the peer's build-avx2-vnni).

llama-bench's decode runs at depth --input-len (`-d`: its 128 tokens generated after 128 of
context, as qserve decodes after a 128-token prompt; before 2026-12-06 it generated from an
empty context), its prefill from an empty context. Not quite like for like:
llama-batched-bench feeds random tokens instead of sampling, which favours llama.cpp
slightly. The quantized checkpoints are made once with `qserve quantize` into
.cache/bench-ckpt/<model>/<recipe>/ (delete one to remake it).
transformers needs the `bench` extra; llama-cpp-python its wheel.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# --isa avx2: qserve's kernels, torch's (ATen's CPU dispatch, MKL, oneDNN) and llama.cpp's build
AVX2_ENV = {"QSERVE_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "QSERVE_PEER_ISA": "avx2"}
ISA_ENV = {"avx2": AVX2_ENV,
           "avx2-vnni": AVX2_ENV | {"QSERVE_CPU_ISA": "avx2-vnni", "QSERVE_PEER_ISA": "avx2-vnni"}}
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "scripts")]
os.environ.setdefault("QSERVE_HOME", str(REPO / ".cache" / "qserve"))
CKPT_DIR = REPO / ".cache" / "bench-ckpt"
N_CONCURRENT = 32

COLUMNS = {  # --only name -> table header
    "qserve": "qserve",
    "qserve-gguf-native": "qserve gguf-native",
    "qserve-w8": "qserve w8",
    "transformers": "transformers fp32",
    "llama.cpp": "llama.cpp",
    "llama-cpp-python": "llama-cpp-python",
}
DEFAULT_COLUMNS = ("qserve", "llama.cpp")
QSERVE_RECIPES = {"qserve": None, "qserve-gguf-native": "gguf-native", "qserve-w8": "w8"}
PEERS = ["transformers", "llama.cpp", "llama-cpp-python"]
ROWS = [("decode tok/s, batch 1", "decode_b1"),
        ("prefill tok/s, 1 x {len}", "prefill_b1"),
        (f"throughput tok/s, {N_CONCURRENT} concurrent", "throughput_b32"),
        ("prefill tok/s, {n} x {len}", "prefill"),
        ("peak RSS MiB", "peak_rss_mib")]
TARGETS = [  # (label, qserve column, peer column, row key, minimum ratio)
    ("batch-1 decode", "qserve", "llama.cpp", "decode_b1", 1.0),
    (f"{N_CONCURRENT}-concurrent throughput", "qserve", "llama.cpp", "throughput_b32", 1.5),
    ("prefill, one prompt", "qserve", "llama.cpp", "prefill_b1", 1.0),
    (f"prefill, {N_CONCURRENT} prompts", "qserve", "llama.cpp", "prefill", 1.0),
    ("batch-1 decode", "qserve-w8", "transformers", "decode_b1", 3.0),
]


def run_child(cmd: list, quiet: bool = False, **popen) -> tuple[str, float]:
    """Run `cmd` to completion. Returns its stdout and its own peak RSS in MiB. `quiet` keeps
    its stderr (shown only if it fails); otherwise stderr passes through."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=out,
                                stderr=err if quiet else None, **popen)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:  # Ctrl-C: take the child down too
            proc.kill()
            proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            tail = "\n".join(err.read().strip().splitlines()[-10:])
            sys.exit(f"{tail}\nerror: {Path(str(cmd[0])).name} failed with exit status "
                     f"{proc.returncode}: {' '.join(map(str, cmd))}")
        return out.read(), usage.ru_maxrss / 1024  # Linux: KiB


def default_model() -> Path:
    """The default model's GGUF, resolved (and pulled) in a child: qserve imports torch."""
    out, _ = run_child([sys.executable, "-c", "from qserve.loader.registry import "
                        "resolve_model; print(resolve_model(None))"])
    return Path(out.strip().splitlines()[-1])


# --- llama.cpp, native: its own benchmark binaries, run from this process ---

def bench_llama_cpp(args, gguf: Path) -> tuple[dict[str, list[float]], str]:
    """llama-bench for batch 1, llama-batched-bench (--repeats runs) for N_CONCURRENT. Returns
    the runs and a description of the build."""
    import peer

    n_in, n_out, threads = args.input_len, args.output_len, args.threads

    def llama_bench(*test) -> tuple[dict, float]:
        out, rss = run_child([peer.binary("llama-bench"), "-m", gguf, *test, "-t", threads,
                              "-r", args.repeats, "-o", "json"], quiet=True)
        return json.loads(out)[0], rss

    # the prefill from an empty context; the decode at depth n_in (its n_out tokens generated
    # after n_in tokens of context), as qserve's rows are measured
    pp, rss_pp = llama_bench("-p", n_in, "-n", 0)
    tg, rss = llama_bench("-p", 0, "-n", n_out, "-d", n_in)
    rss = max(rss, rss_pp)
    runs = {"decode_b1": tg["samples_ts"], "prefill_b1": pp["samples_ts"],
            "throughput_b32": [], "prefill": [], "peak_rss_mib": [rss]}
    for _ in range(args.repeats):
        out, rss = run_child([
            peer.binary("llama-batched-bench"), "-m", gguf,
            "-c", N_CONCURRENT * (n_in + n_out),  # exactly the 32 sequences (it skips a
            "-npp", n_in, "-ntg", n_out, "-npl", N_CONCURRENT,  # case that does not fit)
            "-t", threads, "--output-format", "jsonl"], quiet=True)
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if len(rows) != 1:
            sys.exit(f"error: llama-batched-bench printed {len(rows)} result lines, not 1")
        runs["throughput_b32"].append(N_CONCURRENT * n_out / rows[0]["t"])
        runs["prefill"].append(rows[0]["speed_pp"])
        runs["peak_rss_mib"][0] = max(runs["peak_rss_mib"][0], rss)
    return runs, f"llama.cpp {tg['build_commit']} ({peer.SDIST}) on {tg['model_type']}"


# --- the machine's memory bandwidth: what a batch-1 decode, which reads every weight once a
# token, can at most reach ---

READ_CODE = """
import sys, time, statistics, torch
torch.set_num_threads(int(sys.argv[1]))
x = torch.ones(1 << 28, dtype=torch.int32)  # 1 GiB, faulted in before it is timed
x.max()
times = []
for _ in range(5):
    t = time.perf_counter()
    x.max()
    times.append(time.perf_counter() - t)
print(x.numel() * 4 / statistics.median(times) / 1e9)
"""


def read_bandwidth(threads: int) -> float:
    """GB/s of a plain read of 1 GiB on `threads` threads (torch's int32 max, the median of 5
    passes), in a child; on this project's 2-core VM it read as a hand-written AVX-512 loop
    did (~30-32 GB/s, 2026-12-06)."""
    out, _ = run_child([sys.executable, "-c", READ_CODE, threads])
    return float(out.strip().splitlines()[-1])


def streamed(medians: dict[str, dict[str, float]], gguf: Path, read: list[float]) -> list[str]:
    """Lines on the batch-1 decode as a memory stream: each column's decode rate times the
    file's size (every weight read once a token: about what either side reads, its K/V
    aside), against the plain read."""
    ceiling = statistics.median(read)
    lines = [f"memory: a plain read of 1 GiB ran at {ceiling:.1f} GB/s (median of "
             f"{', '.join(f'{r:.1f}' for r in read)}); batch-1 decode reads ~the file "
             f"({gguf.stat().st_size / 2**20:,.0f} MiB) a token:"]
    for n, m in medians.items():
        if "decode_b1" in m and n in ("qserve", "llama.cpp"):
            gbs = m["decode_b1"] * gguf.stat().st_size / 1e9
            lines.append(f"- {COLUMNS[n]}: {gbs:.1f} GB/s, {gbs / ceiling:.0%} of the read")
    return lines


# --- the Python columns: each in a child process running this script with --worker ---

def prepare(name: str, gguf: Path) -> Path:
    """What column `name` loads: made here, in its own children, so that making it (a
    `qserve quantize`, a conversion to HF) never counts toward the measured child's peak RSS."""
    if QSERVE_RECIPES.get(name):
        return checkpoint(gguf, QSERVE_RECIPES[name])
    if name == "transformers":  # converted once, cached; the worker finds it there
        run_child([sys.executable, "-c", "import pathlib, sys; from hf_reference import "
                   "hf_reference_dir; hf_reference_dir(pathlib.Path(sys.argv[1]))", gguf],
                  cwd=REPO / "tests")
    return gguf


def checkpoint(gguf: Path, recipe: str) -> Path:
    """The qserve checkpoint of `gguf` under `recipe`, made with `qserve quantize` if missing
    (quantize writes the directory only once it has succeeded)."""
    out = CKPT_DIR / gguf.stem / recipe
    if not out.exists():
        print(f"making {out} (qserve quantize --recipe {recipe}) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "qserve", "quantize", str(gguf), "-o", str(out),
                        "--recipe", recipe], check=True, stdout=subprocess.DEVNULL, cwd=REPO)
    return out


def measure_in_child(name: str, args, gguf: Path) -> tuple[dict[str, list[float]], dict]:
    """Run column `name` in a child; returns its runs (with its peak RSS) and what the child
    reports about itself (torch version and threads)."""
    model = prepare(name, gguf)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        _, rss = run_child([sys.executable, __file__, "--worker", name, "--worker-out", f.name,
                            "--model", model, "--repeats", args.repeats, "--threads", args.threads,
                            "--input-len", args.input_len, "--output-len", args.output_len],
                           env=os.environ | {"OMP_NUM_THREADS": str(args.threads)})
        result = json.loads(Path(f.name).read_text())
    return result.pop("runs") | {"peak_rss_mib": [rss]}, result


def worker(args) -> None:
    """The body of a --worker child: measure one Python column, write its numbers as JSON."""
    import torch

    torch.set_num_threads(args.threads)
    if args.worker in QSERVE_RECIPES:
        runs = bench_qserve(args, args.model)
    elif args.worker == "transformers":
        runs = bench_transformers(args, args.model)
    else:
        runs = bench_llama_cpp_python(args, args.model)
    Path(args.worker_out).write_text(json.dumps(
        {"runs": runs, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
         "torch_isa": torch.backends.cpu.get_cpu_capability()}))


def bench_qserve(args, model: Path) -> dict[str, list[float]]:
    """qserve through qserve.bench.run_bench, with a KV pool just big enough for the run."""
    from qserve.bench import run_bench
    from qserve.config import engine_config
    from qserve.engine.cache_engine import bytes_per_block
    from qserve.engine.llm_engine import LLMEngine
    from qserve.engine.memory_plan import resolve_kv_dtype
    from qserve.loader import load_arch

    arch = load_arch(model)
    config = engine_config(str(model), max_model_len=max(1024, args.input_len + args.output_len))
    block = config.cache.block_size  # one spare block per sequence, at the K/V dtype it runs
    blocks = N_CONCURRENT * (-(-(args.input_len + args.output_len) // block) + 1)
    kv_dtype = resolve_kv_dtype(model, arch, config)
    config.cache.kv_cache_memory = blocks * bytes_per_block(arch, block, kv_dtype)
    engine = LLMEngine(config)  # the default step budget
    runs = [run_bench(engine, [1, N_CONCURRENT], args.input_len, args.output_len, seed=r,
                      warmup=r == 0) for r in range(args.repeats)]
    return {"decode_b1": [b1["decode_tokens_per_s"] for b1, _ in runs],
            "prefill_b1": [b1["prefill_tokens_per_s"] for b1, _ in runs],
            "throughput_b32": [N_CONCURRENT * args.output_len / b32["total_s"]
                               for _, b32 in runs],
            "prefill": [b32["prefill_tokens_per_s"] for _, b32 in runs]}


def bench_transformers(args, gguf: Path) -> dict[str, list[float]]:
    import torch
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
    runs = {"decode_b1": [], "prefill_b1": [], "throughput_b32": [], "prefill": []}
    for r in range(args.repeats):
        first = gen(1, 1, r)
        runs["prefill_b1"].append(args.input_len / first)
        runs["decode_b1"].append((args.output_len - 1) / (gen(1, args.output_len, r) - first))
        runs["prefill"].append(N_CONCURRENT * args.input_len / gen(N_CONCURRENT, 1, r))
        runs["throughput_b32"].append(
            N_CONCURRENT * args.output_len / gen(N_CONCURRENT, args.output_len, r))
    return runs


def bench_llama_cpp_python(args, gguf: Path) -> dict[str, list[float]]:
    """llama.cpp through the wheel: batch 1 and 32 sequences through one context."""
    import random

    from llama_cpp_batched import BatchedLlama

    seq_len = -(-max(256, args.input_len + args.output_len) // 256) * 256
    llm = BatchedLlama(gguf, n_seq=N_CONCURRENT, max_seq_len=seq_len,
                       max_prompt_tokens=N_CONCURRENT * args.input_len, n_threads=args.threads)

    def prompts(n: int, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(100, llm.n_vocab) for _ in range(args.input_len)]
                for _ in range(n)]

    runs = {"decode_b1": [], "prefill_b1": [], "throughput_b32": [], "prefill": []}
    try:
        llm.generate(prompts(N_CONCURRENT, -1), 2)  # warm-up at the largest shape
        for r in range(args.repeats):
            one = llm.generate(prompts(1, r), args.output_len)
            runs["decode_b1"].append((args.output_len - 1) / one["decode_s"])
            runs["prefill_b1"].append(args.input_len / one["prefill_s"])
            many = llm.generate(prompts(N_CONCURRENT, r), args.output_len)
            runs["prefill"].append(N_CONCURRENT * args.input_len / many["prefill_s"])
            runs["throughput_b32"].append(N_CONCURRENT * args.output_len / many["total_s"])
    finally:
        llm.close()
    return runs


# --- the table ---

def markdown(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table: the first column left-aligned, numbers right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *map(line, rows)])


def round_ratios(rounds: dict[str, list[dict[str, list[float]]]]) -> list[str]:
    """Each target's ratio in each round (medians of that round's runs), one line a target."""
    lines = []
    for label, q, p, key, need in TARGETS:
        if q not in rounds or p not in rounds:
            continue
        got = [statistics.median(a[key]) / statistics.median(b[key])
               for a, b in zip(rounds[q], rounds[p]) if a.get(key) and b.get(key)]
        if got:
            lines.append(f"- {COLUMNS[q]} {label}: " + ", ".join(f"{r:.2f}x" for r in got))
    return lines


def report(args, medians: dict[str, dict[str, float]]) -> str:
    ours = [n for n in medians if n in QSERVE_RECIPES]
    peers = [n for n in PEERS if n in medians]
    pairs = [(q, p) for q in ours for p in peers]
    header = ["metric", *(COLUMNS[n] for n in medians), *(f"{q} / {p}" for q, p in pairs)]

    def ratio(q: str, p: str, key: str) -> float | None:
        a, b = medians[q].get(key), medians[p].get(key)
        return a / b if a is not None and b else None

    rows = []
    for label, key in ROWS:
        cells = [f"{medians[n][key]:.1f}" if key in medians[n] else "-" for n in medians]
        ratios = [ratio(q, p, key) for q, p in pairs]
        rows.append([label.format(n=N_CONCURRENT, len=args.input_len), *cells,
                     *("-" if r is None else f"{r:.2f}x" for r in ratios)])
    lines = [markdown(header, rows), "", "targets (qserve / peer, this run):"]
    for label, q, p, key, need in TARGETS:
        r = ratio(q, p, key) if q in medians and p in medians else None
        verdict = "not measured" if r is None else f"{r:.2f}x {'PASS' if r >= need else 'MISS'}"
        lines.append(f"- {COLUMNS[q]} {label} >= {need:g}x {COLUMNS[p]}: {verdict}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a GGUF file  [default: the default model]")
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell; the median is shown")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure the columns this many times in turn, pooling their runs")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="CPU threads for every column  [default: all]")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--only", metavar="COL,...",
                    help=f"columns to measure, of {','.join(COLUMNS)}  "
                         f"[default: {','.join(DEFAULT_COLUMNS)}]")
    ap.add_argument("--json", nargs="?", const="-", metavar="FILE",
                    help="also write every run's numbers as JSON to FILE (stdout without one)")
    ap.add_argument("--isa", choices=("native", *ISA_ENV), default="native",
                    help="native: each side built for this CPU; avx2: both without AVX-512 "
                         "(and AVX-VNNI); avx2-vnni: without AVX-512, with AVX-VNNI")
    ap.add_argument("--worker", choices=[n for n in COLUMNS if n != "llama.cpp"],
                    help=argparse.SUPPRESS)  # internal: measure one column in this process
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if (args.repeats < 1 or args.rounds < 1 or args.threads < 1 or args.input_len < 1
            or args.output_len < 2):
        ap.error("--repeats, --rounds, --threads and --input-len must be >= 1 and --output-len "
                 ">= 2 (batch-1 decode needs a token after the first)")
    if args.model is not None and (args.model.suffix != ".gguf" or not args.model.is_file()):
        ap.error(f"--model {args.model}: give an existing .gguf file")
    only = DEFAULT_COLUMNS if args.only is None else [n.strip() for n in args.only.split(",")]
    if bad := [n for n in only if n not in COLUMNS]:
        ap.error(f"--only: unknown column {', '.join(bad)}; choose from {', '.join(COLUMNS)}")
    names = [n for n in COLUMNS if n in only]  # table order
    if "llama-cpp-python" in names and importlib.util.find_spec("llama_cpp") is None:
        print("llama-cpp-python is not installed: no llama-cpp-python column", file=sys.stderr)
        names.remove("llama-cpp-python")
    gguf = args.model.resolve() if args.model else default_model()
    if args.isa != "native":  # the children (qserve's workers, llama.cpp's binaries) inherit it
        os.environ |= ISA_ENV[args.isa]

    rounds, about, read = {}, [], []  # column -> its runs, a dict a round
    for r in range(args.rounds):
        read.append(read_bandwidth(args.threads))
        for name in names:
            of = f" (round {r + 1} of {args.rounds})" if args.rounds > 1 else ""
            print(f"measuring {COLUMNS[name]} on {gguf.name}{of} ...", file=sys.stderr)
            if name == "llama.cpp":
                got, build = bench_llama_cpp(args, gguf)
                about.append(build)
            else:
                got, child = measure_in_child(name, args, gguf)
                about.append(f"torch {child['torch']} ({child['torch_threads']} threads, "
                             f"{child['torch_isa']})")
            rounds.setdefault(name, []).append(got)
    runs = {n: {k: [v for got in rs for v in got.get(k, [])] for k in dict.fromkeys(
        k for got in rs for k in got)} for n, rs in rounds.items()}
    medians = {n: {k: (max if k == "peak_rss_mib" else statistics.median)(v)  # RSS: largest
                   for k, v in r.items()} for n, r in runs.items()}
    runs_each = f"{args.repeats} x {args.rounds} rounds" if args.rounds > 1 else args.repeats
    print(f"\nmodel: {gguf.name}; {args.threads} threads of {os.cpu_count()} CPUs; "
          f"{'; '.join(dict.fromkeys(about))}; ISA {args.isa}; {args.input_len} prompt + {args.output_len} "
          f"new tokens, median of {runs_each}\n")
    print(report(args, medians))
    print("\n" + "\n".join(streamed(medians, gguf, read)))
    if args.rounds > 1 and (each := round_ratios(rounds)):
        print("\neach round (qserve / peer, medians of that round's runs):")
        print("\n".join(each))
    if args.json:
        dump = json.dumps({"model": str(gguf), "cpu_threads": os.cpu_count(), "isa": args.isa,
                           "threads": args.threads, "input_len": args.input_len,
                           "output_len": args.output_len, "concurrent": N_CONCURRENT,
                           "rounds": args.rounds, "read_gb_per_s": read,
                           "about": about, "runs": runs, "median": medians}, indent=2)
        if args.json == "-":
            print(dump)
        else:
            Path(args.json).write_text(dump + "\n")


if __name__ == "__main__":
    main()
