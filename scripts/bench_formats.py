"""Decode-sized matmul speed of the CPU kernels per weight format, as weight bytes read per second.

    python scripts/bench_formats.py [--threads N] [--repeats R] [--fp32] [--formats F,...]
                                    [--shapes KxN,...]

Each weight matrix is random bytes in its format's layout (speed does not depend on the values),
at Llama-3.2-1B shapes (or --shapes: gpt-oss-20b's experts are 2880x5760 and 2880x2880). The formats are timed interleaved, one call each per round, so load from
other processes lands on all of them alike; the table gives medians and each format's GB/s
relative to qserve's int4 g32 (the peer: the same 4.5 bits per weight as q4_k). With one thread
the clock is the thread's CPU time (OpenMP runs the kernel on the calling thread), which time
slices lost to other processes on a shared machine do not inflate; with more, wall time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from qserve.formats import QuantizedTensor, ggml
from qserve.kernels import cpu_ops

SHAPES = [(2048, 8192), (8192, 2048), (2048, 2048)]  # (K, N): gate/up, down, q/o
FORMATS = ["int4", "q4_k", "q6_k", "q5_k", "q3_k", "q2_k", "q5_0", "int8", "f16"]


def random_weight(fmt: str, N: int, K: int, g: torch.Generator) -> QuantizedTensor:
    if fmt == "int4":
        return QuantizedTensor("int4", torch.randint(0, 256, (N, K // 2), dtype=torch.uint8,
                                                     generator=g),
                               (torch.rand(N, K // 32, generator=g) * 0.01).half(), None, K)
    if fmt == "int8":
        return QuantizedTensor("int8", torch.randint(-128, 128, (N, K), dtype=torch.int8,
                                                     generator=g),
                               (torch.rand(N, K // 32, generator=g) * 0.01).half(), None, K)
    if fmt == "f16":
        return QuantizedTensor("f16", torch.randn(N, K, generator=g).half(), None, None, K)
    return QuantizedTensor(fmt, ggml.random_rows(fmt, N, K, g), None, None, K)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--fp32", action="store_true", help="fp32 activations (default: int8)")
    ap.add_argument("--formats", help=f"comma-separated [default: {','.join(FORMATS)}]; int4 "
                                      f"is always timed (the ratios' base)")
    ap.add_argument("--shapes", help="comma-separated KxN (inputs x outputs)  [default: "
                                     + ",".join(f"{k}x{n}" for k, n in SHAPES) + "]")
    args = ap.parse_args()
    formats = ["int4"] + [f for f in (args.formats or ",".join(FORMATS)).split(",")
                          if f and f != "int4"]
    shapes = ([tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
              if args.shapes else SHAPES)
    torch.set_num_threads(args.threads)
    assert cpu_ops.lib() is not None, "the CPU kernels did not build"
    i8 = not args.fp32
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    g = torch.Generator().manual_seed(0)
    print(f"threads {args.threads}, {'int8' if i8 else 'fp32'} activations, median of "
          f"{args.repeats}, {'thread CPU' if args.threads == 1 else 'wall'} time")
    print(f"{'K':>5} {'N':>5} {'M':>2}  " + "".join(f"{f:>14}" for f in formats))
    for K, N in shapes:
        weights = {f: random_weight(f, N, K, g) for f in formats}
        for M in (1, 8):
            x = torch.randn(M, K, generator=g)
            times: dict[str, list[float]] = {f: [] for f in formats}
            for r in range(args.repeats + 2):
                for f, qt in weights.items():
                    t0 = clock()
                    cpu_ops.weight_matmul(x, qt, None, i8)
                    if r >= 2:  # two warm-up rounds
                        times[f].append(clock() - t0)
            gbs = {f: weights[f].nbytes / statistics.median(t) / 1e9 for f, t in times.items()}
            cells = "".join(f"{gbs[f]:6.2f} ({gbs[f] / gbs['int4']:4.2f}x)" for f in formats)
            print(f"{K:>5} {N:>5} {M:>2}  {cells}")
    print("cells: weight GB/s (relative to int4 g32)")


if __name__ == "__main__":
    main()
