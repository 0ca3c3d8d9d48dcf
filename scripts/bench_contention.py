#!/usr/bin/env python3
"""Decode speed when other processes want the CPU: qserve and native llama.cpp on the same GGUF,
quiet and with 1 and 2 competing busy processes, in one run, printed as one table.

    python scripts/bench_contention.py [--model FILE.gguf] [--busy 0,1,2] [--threads 2]
                                       [--repeats 3] [--concurrent 16] [--output-len 64]
                                       [--qserve-env default,OMP_WAIT_POLICY=active]

A busy process is a bounded spin loop (a child Python process that stops itself after
--busy-limit seconds, and is killed when its cell is done). For each busy level the script runs,
each in its own child process:

    qserve      `qserve bench MODEL --batch-sizes 1,C --json`: batch-1 decode tokens/s and the
                throughput of C concurrent requests (C x output-len generated tokens / wall
                time, prefill included), once per --qserve-env variant ("default" is qserve as
                a user runs it; a variant such as OMP_WAIT_POLICY=active shows the old
                spin-waiting behaviour)
    llama.cpp   native llama.cpp (scripts/peer.py builds it once): `llama-bench -n` for batch 1
                and `llama-batched-bench -npl C` for C concurrent sequences, as a user runs
                them (default --poll)

Each cell is the median of --repeats runs. The table gives tokens/s, each column's fraction of
its own quiet speed, and qserve / llama.cpp under the same contention. Run it on an otherwise
quiet machine: the busy processes are the only contention meant to be there.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "scripts")]
os.environ.setdefault("QSERVE_HOME", str(REPO / ".cache" / "qserve"))

from bench_vs_peers import default_model, markdown, run_child  # noqa: E402

BUSY_LOOP = ("import time, sys\n"
             "end = time.monotonic() + float(sys.argv[1])\n"
             "while time.monotonic() < end:\n"
             "    pass\n")


class Busy:
    """n spinning child processes for the length of a `with` block (each also stops itself
    after `limit` seconds, so none outlives a crashed run)."""

    def __init__(self, n: int, limit: float):
        self.n, self.limit, self.procs = n, limit, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(self.limit)])
                      for _ in range(self.n)]
        time.sleep(0.5 if self.n else 0)  # let them reach their loop
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


def qserve_runs(args, model: Path, env_variant: str) -> dict[str, float]:
    """One `qserve bench` child: {"b1": decode tok/s, "bC": throughput tok/s}."""
    env = dict(os.environ)
    if env_variant != "default":
        key, _, value = env_variant.partition("=")
        env[key] = value
    max_len = args.input_len + args.output_len
    out, _ = run_child([sys.executable, "-m", "qserve", "bench", model,
                        "--batch-sizes", f"1,{args.concurrent}", "--input-len", args.input_len,
                        "--output-len", args.output_len, "--max-model-len", max_len,
                        "--kv-cache-memory", args.kv_cache_memory, "--json"],
                       quiet=True, env=env | {"OMP_NUM_THREADS": str(args.threads)})
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    b1 = next(r for r in rows if r["batch_size"] == 1)
    bc = next(r for r in rows if r["batch_size"] == args.concurrent)
    return {"b1": b1["decode_tokens_per_s"],
            "bC": args.concurrent * args.output_len / bc["total_s"]}


def llama_cpp_runs(args, model: Path) -> dict[str, float]:
    """llama-bench tg at batch 1 and llama-batched-bench with C sequences, one run each."""
    import peer

    out, _ = run_child([peer.binary("llama-bench"), "-m", model, "-p", 0, "-n", args.output_len,
                        "-t", args.threads, "-r", 1, "-o", "json"], quiet=True)
    tg = next(t for t in json.loads(out) if t["n_gen"] == args.output_len)
    out, _ = run_child([peer.binary("llama-batched-bench"), "-m", model,
                        "-c", args.concurrent * (args.input_len + args.output_len),
                        "-npp", args.input_len, "-ntg", args.output_len,
                        "-npl", args.concurrent, "-t", args.threads,
                        "--output-format", "jsonl"], quiet=True)
    row = next(json.loads(line) for line in out.splitlines() if line.startswith("{"))
    return {"b1": tg["avg_ts"], "bC": args.concurrent * args.output_len / row["t"]}


def measure(args, model: Path) -> dict[tuple[int, str], dict[str, float]]:
    """(busy level, column) -> {"b1", "bC"}: medians over --repeats."""
    columns = [f"qserve {v}" if v != "default" else "qserve" for v in args.qserve_env]
    if not args.no_llama_cpp:
        columns.append("llama.cpp")
    cells = {}
    for busy in args.busy:
        for col in columns:
            runs = []
            for _ in range(args.repeats):
                with Busy(busy, args.busy_limit):
                    if col == "llama.cpp":
                        runs.append(llama_cpp_runs(args, model))
                    else:
                        variant = col.removeprefix("qserve").strip() or "default"
                        runs.append(qserve_runs(args, model, variant))
            cells[busy, col] = {k: statistics.median(r[k] for r in runs) for k in ("b1", "bC")}
            print(f"busy {busy}  {col:28s} batch 1 {cells[busy, col]['b1']:7.1f} tok/s   "
                  f"{args.concurrent} concurrent {cells[busy, col]['bC']:7.1f} tok/s",
                  file=sys.stderr)
    return cells


def report(args, cells) -> str:
    cols = sorted({c for _, c in cells}, key=lambda c: (c == "llama.cpp", c))
    header = ["busy processes", "load"]
    for c in cols:
        header += [f"{c} tok/s", f"{c} / its quiet"]
    peer = "llama.cpp" if "llama.cpp" in cols else None
    if peer:
        header += [f"{c} / llama.cpp" for c in cols if c != peer]
    rows = []
    for busy in args.busy:
        for key, label in (("b1", "batch 1"), ("bC", f"{args.concurrent} concurrent")):
            row = [str(busy), label]
            for c in cols:
                v, quiet = cells[busy, c][key], cells.get((0, c), {}).get(key)
                row += [f"{v:.1f}", f"{v / quiet:.2f}x" if quiet else "-"]
            if peer:
                row += [f"{cells[busy, c][key] / cells[busy, peer][key]:.2f}x"
                        for c in cols if c != peer]
            rows.append(row)
    return markdown(header, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a GGUF (default: the default model)")
    ap.add_argument("--busy", default="0,1,2", help="numbers of busy processes to run beside")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--busy-limit", type=float, default=600.0,
                    help="seconds after which a busy process stops by itself")
    ap.add_argument("--qserve-env", default="default",
                    help="comma-separated qserve variants: default, or VAR=VALUE run with that "
                         "environment variable set (e.g. OMP_WAIT_POLICY=active)")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp column")
    args = ap.parse_args()
    try:
        args.busy = [int(b) for b in args.busy.split(",")]
    except ValueError:
        sys.exit(f"error: --busy takes comma-separated integers, not {args.busy!r}")
    if any(b < 0 for b in args.busy) or 0 not in args.busy:
        sys.exit("error: --busy needs 0 (the quiet baseline) and no negative counts")
    args.qserve_env = [v.strip() for v in args.qserve_env.split(",") if v.strip()]
    bad = [v for v in args.qserve_env if v != "default" and "=" not in v]
    if bad:
        sys.exit(f"error: --qserve-env variants are 'default' or VAR=VALUE, not {bad[0]!r}")
    if not args.no_llama_cpp:
        import peer
        peer.binary("llama-bench")  # build it before anything is timed
    model = args.model or default_model()
    if not model.is_file():
        sys.exit(f"error: no such GGUF file: {model}")
    cells = measure(args, model)
    print(f"\n{model.name}, {args.threads} threads, {args.input_len} prompt + "
          f"{args.output_len} generated tokens, median of {args.repeats}\n")
    print(report(args, cells))


if __name__ == "__main__":
    main()
