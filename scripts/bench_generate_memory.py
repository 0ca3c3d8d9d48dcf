#!/usr/bin/env python3
"""Peak RSS of a plain `qserve generate` per GGUF file, against the issue's bound (file size
x 1.2 + the KV pool) and against the memory planner's prediction (`qserve info --json`).

    python scripts/bench_generate_memory.py FILE.gguf [FILE.gguf ...] [--prompt-tokens 2000]

Each run is its own child process (`python -m qserve generate -m FILE --max-model-len 2048
--max-tokens 4 --temperature 0 PROMPT`), its peak the child's ru_maxrss. The prompt is a
sentence repeated to about --prompt-tokens tokens: a short one is what a chat turn costs; one
as long as --max-num-batched-tokens makes a prefill step as large as the plan assumes, so
"plan / peak" is then the planner's accuracy. Make the files with scripts/make_shaped_model.py.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

MiB = 1 << 20
SENTENCE = "The quick brown fox jumps over the lazy dog. "  # about 10 tokens


def measure(cmd: list[str]) -> tuple[float, str]:
    """Run cmd as a child; (its peak RSS in MiB, its stderr)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"error: {' '.join(cmd[:6])} ... failed: {r.stderr.strip()[-400:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak <= before:  # ru_maxrss is the largest child so far: order runs small to large
        print(f"warning: {cmd[4]} peaked below an earlier child; its figure is that child's",
              file=sys.stderr)
    return peak / 1024, r.stderr  # Linux: KiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--prompt-tokens", type=int, default=20)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args()
    flags = ["--max-model-len", str(args.max_model_len),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    prompt = (SENTENCE * (args.prompt_tokens // 10 + 1))[:args.prompt_tokens * 45 // 10]
    rows = []
    for f in sorted(args.files, key=lambda p: p.stat().st_size):  # see measure()
        info = subprocess.run([sys.executable, "-m", "qserve", "info", str(f), "--json",
                               "--max-num-seqs", "1", *flags], capture_output=True, text=True)
        if info.returncode:
            sys.exit(f"error: qserve info {f}: {info.stderr.strip()[-400:]}")
        plan = json.loads(info.stdout)["memory_plan"]
        peak, _ = measure([sys.executable, "-m", "qserve", "generate", "-m", str(f), *flags,
                           "--max-tokens", "4", "--temperature", "0", prompt])
        size, kv = f.stat().st_size / MiB, plan["kv_bytes"] / MiB
        rows.append((f.name, size, kv, peak, size * 1.2 + kv, plan["total_bytes"] / MiB))
    print(f"qserve generate {' '.join(flags)} --max-tokens 4, a ~{args.prompt_tokens}-token "
          f"prompt; bound = file x 1.2 + KV pool; plan = qserve info --json --max-num-seqs 1")
    print("| file | size MiB | KV pool MiB | peak RSS MiB | bound MiB | within | plan MiB | "
          "plan / peak |")
    print("|---|---|---|---|---|---|---|---|")
    for name, size, kv, peak, bound, plan in rows:
        print(f"| {name} | {size:,.0f} | {kv:,.0f} | {peak:,.0f} | {bound:,.0f} | "
              f"{'yes' if peak <= bound else 'NO'} | {plan:,.0f} | {plan / peak:.2f} |")


if __name__ == "__main__":
    main()
