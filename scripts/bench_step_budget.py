"""Prefill speed against the scheduler's step budget (--max-num-batched-tokens), on one engine.

    python scripts/bench_step_budget.py [--model FILE.gguf] [--budgets 256,512,1024,2048,4096]
                                        [--rounds 3] [--batch 32] [--input-len 128]

One engine loads --model (default: the default model) once; each round runs --batch prompts of
--input-len random tokens (2 new tokens each) at every budget, in alternating order, so drift
of the machine's speed lands on all budgets alike. Every run draws its own prompts (a repeated
prompt would hit the prefix cache). Prints each run, then the median prefill tokens/s per
budget, and the process's peak RSS. What qserve's CPU default (512 tokens,
qserve.config.batched_tokens_for) was chosen by.
"""
from __future__ import annotations

import argparse
import resource
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF or HF directory (default model)")
    ap.add_argument("--budgets", default="256,512,1024,2048,4096")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]

    import torch

    from qserve.bench import run_bench
    from qserve.config import engine_config
    from qserve.engine.llm_engine import LLMEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(engine_config(args.model, max_model_len=args.input_len + 16,
                                     max_num_seqs=args.batch, max_num_batched_tokens=max(budgets)))
    speed: dict[int, list[float]] = {b: [] for b in budgets}
    for r in range(args.rounds):
        for i, b in enumerate(budgets if r % 2 == 0 else budgets[::-1]):
            engine.scheduler.config.max_num_batched_tokens = b
            row, = run_bench(engine, [args.batch], args.input_len, 2, seed=1000 * r + b,
                             warmup=r == 0 and i == 0)
            speed[b].append(row["prefill_tokens_per_s"])
            print(f"round {r} budget {b}: {row['prefill_tokens_per_s']:.1f} prefill tok/s",
                  flush=True)
    print(f"\n{args.batch} x {args.input_len} prompt tokens, median of {args.rounds}")
    print("| budget | prefill tok/s | runs |\n|---|---|---|")
    for b in budgets:
        print(f"| {b} | {statistics.median(speed[b]):.1f} | "
              f"{', '.join(f'{v:.0f}' for v in speed[b])} |")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB "
          f"(the largest budget's step)")


if __name__ == "__main__":
    main()
