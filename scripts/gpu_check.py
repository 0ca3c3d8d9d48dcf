#!/usr/bin/env python3
"""The Triton kernels on a CUDA machine, in one run of under 8 minutes: their tests at full
size, their speed at Llama-3-8B shapes next to the device's copy bandwidth and torch, and the
decode speed of a random-weight 8B-shaped model built from them. Markdown tables on stdout.

    python scripts/gpu_check.py                  # a CUDA machine
    python scripts/gpu_check.py --tiny           # the same code paths on CPU under
                                                 # TRITON_INTERPRET=1, tiny shapes, < 1 min
    python scripts/gpu_check.py --compile-only   # no GPU needed: compile every kernel variant
                                                 # the benchmarks launch, for sm_90 (--arch)
    python scripts/gpu_check.py --sections gemm,decode --deadline 120
                                                 # some sections (tests, copy, tune, gemm,
                                                 # decode, prefill, e2e); none starts after
                                                 # 120 s

The run ends with a go / no-go summary: GO when every section that ran passed.

Bandwidth is bytes the kernel must move (packed weights, scales, activations; K/V values and
scales of the context) over its median time (`triton.testing.do_bench` of CUDA-graph replays,
so kernel time without the host's launch time; GEMV weights in copies that stream from DRAM),
as a fraction of a device-to-device copy of 1 GiB measured in the same run (read + write
bytes). Targets (issue 4):
W4 GEMV >= 75% of copy and >= 3x torch fp16 at batch 1; int8-KV decode attention >= 70% at 8k.

The end-to-end model is a layer loop written here over the kernels alone (the engine's own
decode, model code and CUDA graphs included, is scripts/gpu_e2e.py bench): RMSNorm, fused
QKV, KV write, decode attention, output projection, fused gate/up, SiLU, down projection,
fp16 embedding and LM head; no RoPE (elementwise, a few microseconds). Timed eagerly and as
a replayed CUDA graph. In --tiny mode the times are the interpreter's and mean nothing; the
mode checks the code.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FAILURES: list[str] = []
SECTIONS = ("tests", "copy", "tune", "gemm", "decode", "prefill", "e2e")
SELECTED = set(SECTIONS)  # --sections
DEADLINE: float | None = None  # --deadline: seconds from START after which no section starts
START = time.monotonic()
OUTCOMES: list[tuple[str, str]] = []  # (section, ok / FAILED / skipped ...) for the summary


def section(title: str, key: str):
    """Decorator: print the section's heading and elapsed time; a failure is reported and
    remembered, and the run goes on to the next section. A section not in --sections, or
    reached after --deadline, is skipped."""
    def wrap(fn):
        def run(*args, **kwargs):
            if key not in SELECTED:
                return
            if DEADLINE is not None and time.monotonic() - START > DEADLINE:
                OUTCOMES.append((key, "skipped (deadline)"))
                return
            print(f"\n## {title}\n", flush=True)
            t0 = time.perf_counter()
            try:
                fn(*args, **kwargs)
                OUTCOMES.append((key, "ok"))
            except Exception:  # noqa: BLE001 - one broken section must not hide the others
                FAILURES.append(title)
                OUTCOMES.append((key, "FAILED"))
                print("```\n" + traceback.format_exc() + "```")
            print(f"\n({time.perf_counter() - t0:.1f} s)", flush=True)
        return run
    return wrap


class Ctx:
    """What every section needs: device, timing, and the shapes of this mode."""

    def __init__(self, tiny: bool):
        import torch

        self.tiny = tiny
        self.device = torch.device("cpu" if tiny else "cuda")
        self.copy_gbs = None
        if tiny:
            self.gemm_shapes = [(64, 48), (48, 96), (96, 48), (256, 40)]  # (K, N)
            self.gemm_rows = [1, 16, 40]
            self.tune_rows = [1, 16, 40]
            self.heads, self.kv_heads, self.head_dim, self.page = 4, 2, 32, 16
            self.contexts = [(1, 40), (2, 100)]  # (batch, context)
            self.prefill_len, self.write_tokens = 32, (4,)
            self.model = dict(layers=1, hidden=64, inter=96, vocab=256, group=32)
            self.e2e_batches, self.e2e_context = [1, 2], 20
        else:
            # the engine's fused Llama-3-8B weights: qkv, o, gate_up, down
            self.gemm_shapes = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
            self.gemm_rows = [1, 32, 512]
            self.tune_rows = [1, 32, 512]
            self.heads, self.kv_heads, self.head_dim, self.page = 32, 8, 128, 16
            self.contexts = [(1, 1024), (1, 8192), (1, 32768), (32, 1024), (32, 4096)]
            self.prefill_len, self.write_tokens = 4096, (32, 4096)
            self.model = dict(layers=32, hidden=4096, inter=14336, vocab=128256, group=128)
            self.e2e_batches, self.e2e_context = [1, 32], 1024

    def bench(self, fn) -> float:
        """Median milliseconds of fn()."""
        if self.tiny:  # the interpreter: one run is all the time there is
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")

    def bench_weights(self, fn, weights: list) -> float:
        """Median milliseconds of one fn(w), over distinct copies `weights` (together a few
        times the L2, so each comes from DRAM as a model's layers do), run back to back in
        one replayed CUDA graph: kernel time, none of the host's launch time."""
        if self.tiny:
            return self.bench(lambda: fn(weights[0]))
        import torch
        import triton.testing

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile and allocate outside the capture
            for w in weights:
                fn(w)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for w in weights:
                fn(w)
        ms = triton.testing.do_bench(graph.replay, warmup=3, rep=20, return_mode="median")
        del graph
        return ms / len(weights)

    def bench_graph(self, fn) -> float:
        """Median milliseconds of fn() replayed as a CUDA graph: kernel time without the
        host's launch time (which dwarfs a small kernel's). Where fn cannot be captured
        (a host-side copy inside it), timed eagerly, and the table says so in a comment."""
        try:
            return self.bench_weights(lambda _: fn(), [None])
        except RuntimeError as e:
            print(f"<!-- not capturable ({str(e)[:60]}): timed eagerly, launches included -->")
            return self.bench(fn)

    def copies(self, n: int, k: int, fmt: str, group: int) -> list:
        """Distinct random weights of one shape, 2 to 8 of them, together >= 3 x 60 MB L2."""
        one = random_weight(n, k, fmt, self.device, group)
        count = 1 if self.tiny else min(8, max(2, -(-180_000_000 // weight_bytes(one))))
        return [one] + [random_weight(n, k, fmt, self.device, group) for _ in range(count - 1)]

    def gbs(self, nbytes: int, ms: float) -> str:
        bw = nbytes / ms / 1e6
        return f"{bw:.0f} | {100 * bw / self.copy_gbs:.0f}%"


# ---- random weights and caches ------------------------------------------------------------
def random_weight(n: int, k: int, fmt: str, device, group: int = 128):
    """An (n, k) weight whose x @ W^T keeps x's scale: fp16 tensor, or a QuantizedTensor
    with random codes ("w8": int8 per channel; "w4": int4 g`group` symmetric; "w4a": asym;
    a GGML in-place type such as "q4_k": random blocks, read by triton_ggml)."""
    import torch

    from qserve.formats import QuantizedTensor

    if fmt == "fp16":
        return (torch.randn(n, k, device=device) * k ** -0.5).half()
    from qserve.formats import ggml

    if fmt in ggml.IN_PLACE:
        return QuantizedTensor(fmt, ggml.random_rows(fmt, n, k, device=device), None, None, k)
    if fmt == "w8":
        q = torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8)
        s = torch.full((n, 1), 1 / (73 * k ** 0.5), device=device, dtype=torch.float16)
        return QuantizedTensor("int8", q, s, None, k)
    kp = -(-k // group) * group
    q = torch.randint(0, 256, (n, kp // 2), device=device, dtype=torch.uint8)
    s = torch.full((n, kp // group), 1 / (4.6 * k ** 0.5), device=device, dtype=torch.float16)
    return QuantizedTensor("int4", q, s, None if fmt == "w4" else -7.5 * s, k)


def weight_bytes(w) -> int:
    return w.numel() * w.element_size() if hasattr(w, "numel") else w.nbytes


@functools.lru_cache(maxsize=None)
def synthetic_key_codebook(kv_heads: int, head_dim: int) -> dict:
    """An int4 key codebook (kv_quant.CODEBOOK, tensors (kv_heads, head_dim)) that looks
    calibrated: the calibrator's own allocation (qserve/engine/kv_codebook.py) over RoPE-like
    energies, most of them in the slowly rotating pairs, with per-head jitter. Widths then
    run from 0 to 8, as on a real model."""
    import torch

    from qserve.engine.kv_codebook import codebook_from_energy

    g = torch.Generator().manual_seed(0)
    half = head_dim // 2
    slow = torch.linspace(0, 1, half) ** 6  # pair i rotates at theta^(-2i/d): high i is slow
    jitter = torch.exp(torch.randn(2, 1, kv_heads, half, generator=g))
    k2, q2 = (0.05 + 20 * slow) * jitter[0], (0.2 + 2 * slow) * jitter[1]
    book = codebook_from_energy(torch.cat([k2, k2], -1), torch.cat([q2, q2], -1))  # 1 layer
    return {name: t[0] for name, t in book.items()}


def random_cache(batch: int, context: int, kv_heads: int, head_dim: int, page: int, kv: str,
                 device):
    """A paged cache of random bytes over shuffled blocks, with room for context + 1 tokens
    per sequence (int4: with synthetic_key_codebook); and decode metadata for one query per
    sequence at position `context`."""
    import torch

    from qserve.kernels.kv_quant import KEY_BITS, VALUE_BITS, packed_bytes
    from qserve.kernels.paged_attention import PagedAttentionMetadata

    per_seq = -(-(context + 1) // page)
    num_blocks = batch * per_seq
    cache = {}
    for w, bits in (("k", KEY_BITS), ("v", VALUE_BITS)):
        d_store = packed_bytes(head_dim, bits) if kv == "int4" else head_dim
        shape = (num_blocks, page, kv_heads, d_store)
        if kv == "fp16":
            cache[w] = torch.randn(shape, device=device, dtype=torch.float16)
            continue
        lo, hi, dt = (-127, 128, torch.int8) if kv == "int8" else (0, 256, torch.uint8)
        cache[w] = torch.randint(lo, hi, shape, device=device, dtype=dt)
        # int8: scale; int4 keys: t ~ max |x_j| / sigma_j of a Gaussian head; int4 values:
        # scale and offset over [-0.15, 0.15]
        scale = 3.0 if (kv, w) == ("int4", "k") else 0.02
        cache[f"{w}_scale"] = torch.full(shape[:3], scale, device=device, dtype=torch.float16)
        if (kv, w) == ("int4", "v"):
            cache["v_offset"] = torch.full(shape[:3], -0.15, device=device, dtype=torch.float16)
    if kv == "int4":
        cache.update({n: t.to(device) for n, t in
                      synthetic_key_codebook(kv_heads, head_dim).items()})
    tables = torch.randperm(num_blocks, device=device).view(batch, per_seq)
    seq_lens = torch.full((batch,), context + 1, device=device)
    slots = tables[:, context // page] * page + context % page
    meta = PagedAttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.arange(batch + 1, device=device),
        seq_lens=seq_lens, block_tables=tables, query_lens_list=[1] * batch,
        seq_lens_list=[context + 1] * batch, max_seq_len=context + 1, decode_only=True)
    return cache, meta


def cache_bytes(cache, tokens: int) -> int:
    """Bytes of K and V (values and companions) that `tokens` tokens occupy; an int4 key
    codebook is per layer, read once per program, and not counted."""
    from qserve.kernels.kv_quant import CODEBOOK

    per_slot = sum(t[0, 0].numel() * t.element_size() for n, t in cache.items()
                   if n not in CODEBOOK)
    return per_slot * tokens


# ---- sections ----------------------------------------------------------------------------
@section("Kernel tests", "tests")
def run_tests(ctx: Ctx) -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           str(REPO / "tests" / "test_triton_kernels.py"),
           str(REPO / "tests" / "test_triton_ggml.py")]
    if ctx.tiny:  # the whole file is CI's; here one test, to check the invocation
        cmd += ["-k", "split_k"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    tail = (r.stdout + r.stderr).strip().splitlines()
    print(f"`{' '.join(cmd[1:])}`: {tail[-1] if tail else 'no output'}")
    if r.returncode != 0:
        print("```\n" + "\n".join(tail[-60:]) + "\n```")
        raise RuntimeError("kernel tests failed")


@section("Copy bandwidth", "copy")
def measure_copy(ctx: Ctx) -> None:
    import torch

    n = (1 << 20) if ctx.tiny else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    ms = ctx.bench(lambda: dst.copy_(src))
    ctx.copy_gbs = 2 * n / ms / 1e6
    name = "CPU (interpreter mode)" if ctx.tiny else torch.cuda.get_device_name()
    print(f"{name}: device-to-device copy of {n >> 20} MiB, {ctx.copy_gbs:.0f} GB/s "
          "(read + write); the 100% of the tables below")


@section("Dequant GEMV / GEMM (`dequant_matmul`) vs torch fp16 `F.linear`", "gemm")
def bench_gemm(ctx: Ctx) -> None:
    import torch
    import torch.nn.functional as F

    from qserve.kernels.dispatch import _triton_matmul

    print("| K x N | M | weights | us | GB/s | % of copy | TFLOP/s | x torch fp16 |")
    print("|---|---|---|---|---|---|---|---|")
    for k, n in ctx.gemm_shapes:
        # GGML Q4_K and Q6_K (a Q4_K_M file's two types) where K holds whole super-blocks
        weights = {f: ctx.copies(n, k, f, ctx.model["group"])
                   for f in ("fp16", "w8", "w4", "w4a", "q4_k", "q6_k")
                   if not f.startswith("q") or k % 256 == 0}
        for m in ctx.gemm_rows:
            x = torch.randn(m, k, device=ctx.device, dtype=torch.float16)
            base = None
            for fmt, ws in weights.items():
                if fmt == "fp16":
                    ms = ctx.bench_weights(lambda w: F.linear(x, w), ws)
                    base = ms
                else:  # the kernel the engine dispatches the format to
                    ms = ctx.bench_weights(lambda w: _triton_matmul(x, w), ws)
                nbytes = weight_bytes(ws[0]) + 2 * m * (k + n)
                label = {"fp16": "fp16 (torch)", "w8": "int8 per-channel",
                         "w4": f"int4 g{ctx.model['group']} sym",
                         "w4a": f"int4 g{ctx.model['group']} asym",
                         "q4_k": "GGML Q4_K", "q6_k": "GGML Q6_K"}[fmt]
                print(f"| {k} x {n} | {m} | {label} | {ms * 1e3:.1f} | {ctx.gbs(nbytes, ms)} | "
                      f"{2 * m * n * k / ms / 1e9:.1f} | {base / ms:.2f} |", flush=True)
        del weights


# Launch configurations the tune section tries (kernels/triton_dequant_gemm.GemmConfig): the
# neighbourhood of the unswapped kernel's winners on an H200 (2026-12-04), and the swapped
# variant (weights as the dot's wide operand: wgmma on Hopper) more widely, with 16 to 64 rows
# of x per tile (a batch of 32 dequantizes each weight tile once instead of twice)
TUNE_SPACE = [dict(block_n=(64, 128), max_block_k=(128,), num_warps=(4,), num_stages=(2, 3),
                   fill=(2, 4), swap_ab=(False,)),
              dict(block_n=(64, 128, 256), max_block_k=(128,), num_warps=(4, 8),
                   num_stages=(2, 3), fill=(2, 4), swap_ab=(True,), block_m=(16, 32, 64))]
TUNE_OUT: Path | None = None  # --tune-out
E2E_KV = ("fp16", "int8", "int4")  # --e2e-kv
TUNE_BUDGET = 150.0  # --tune-budget: seconds the sweep may take


@section("Tune `dequant_matmul`: launch configurations per weight shape", "tune")
def tune_gemm(ctx: Ctx) -> None:
    """For int4 g128 and int8 per-channel weights of each shape: every configuration of
    TUNE_SPACE (compiled configurations first reused), timed at ctx.tune_rows[0] rows (batch-1
    decode); the best 3 of each row tile (block_m) also at the others (a batch's decode,
    prefill). The one with the least summed time relative to each row count's best (one row
    counted twice) is the shape's entry, kept only if it is not the default; the table
    goes to --tune-out (kernels/tuned/<device>.json format). Configurations depend on the
    weight, never on M, so batch invariance holds."""
    import itertools
    import json

    import torch

    from qserve.kernels import triton_dequant_gemm as gemm

    t_end = time.monotonic() + TUNE_BUDGET
    keys = [f.name for f in dataclasses.fields(gemm.GemmConfig)]
    space = {gemm.DEFAULT_CONFIG} | {
        gemm.GemmConfig(**dict(zip(part, v)))
        for part in TUNE_SPACE for v in itertools.product(*part.values())}
    # the default first, then by compiled variant, so a deadline cuts whole variants
    space = sorted(space, key=lambda c: (c != gemm.DEFAULT_CONFIG, c.swap_ab, c.block_m,
                                         c.block_n, c.max_block_k, c.num_warps, c.num_stages,
                                         c.fill))
    if ctx.tiny:  # the interpreter checks the code, not the speed
        space = space[:3] + [gemm.GemmConfig(32, 64, 8, 4, 4, swap_ab=True, block_m=64)]
    table, rows = {}, ctx.tune_rows
    print(f"{len(space)} configurations of {', '.join(keys)}; time per call in us at "
          f"{rows[0]} row(s), the best 3 of each block_m then at "
          f"{', '.join(map(str, rows[1:]))}; graph "
          f"replays over copies of the weight (kernel time from DRAM)\n")
    print("| weight | K x N | config (block_n, max_block_k, warps, stages, fill, swap, "
          "block_m) | "
          + " | ".join(f"us at {m}" for m in rows) + " | % of copy at 1 | x default |")
    print("|---|---|---|" + "---|" * len(rows) + "---|---|")
    for fmt, label in (("w4", f"int4 g{ctx.model['group']}"), ("w8", "int8 per-channel")):
        for k, n in ctx.gemm_shapes:
            if time.monotonic() > t_end:
                print(f"| {label} | {k} x {n} | skipped (budget) |" + " |" * (len(rows) + 2))
                continue
            ws = ctx.copies(n, k, fmt, ctx.model["group"])
            xs = {m: torch.randn(m, k, device=ctx.device, dtype=torch.float16) for m in rows}
            times: dict = {}
            for cfg in space:
                if time.monotonic() > t_end:
                    break
                try:
                    times[cfg] = {rows[0]: ctx.bench_weights(
                        lambda w: gemm.dequant_matmul(xs[rows[0]], w, config=cfg), ws)}
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                    print(f"<!-- {cfg}: {type(e).__name__}: {str(e)[:80]} -->")
            if not times:
                continue
            default = times.get(gemm.DEFAULT_CONFIG)
            best = []  # the 3 fastest at one row for each row tile, and the default
            for bm in sorted({c.block_m for c in times}):
                best += sorted((c for c in times if c.block_m == bm),
                               key=lambda c: times[c][rows[0]])[:3]
            if default is not None and gemm.DEFAULT_CONFIG not in best:
                best.append(gemm.DEFAULT_CONFIG)
            for cfg in best:
                for m in rows[1:]:
                    times[cfg][m] = ctx.bench_weights(
                        lambda w: gemm.dequant_matmul(xs[m], w, config=cfg), ws)
            lowest = {m: min(times[c][m] for c in best) for m in rows}
            # batch-1 decode counts twice: a model spends most steps there
            score = {c: sum((2 if i == 0 else 1) * times[c][m] / lowest[m]
                            for i, m in enumerate(rows)) for c in best}
            pick = min(best, key=score.get)
            nbytes = weight_bytes(ws[0]) + 2 * (k + n)
            for cfg in best:
                t = times[cfg]
                mark = " (picked)" if cfg == pick else " (default)" if cfg == gemm.DEFAULT_CONFIG \
                    else ""
                vs = f"{times[gemm.DEFAULT_CONFIG][rows[0]] / t[rows[0]]:.2f}" \
                    if default is not None else "?"
                print(f"| {label} | {k} x {n} | {cfg.block_n}, {cfg.max_block_k}, "
                      f"{cfg.num_warps}, {cfg.num_stages}, {cfg.fill}, "
                      f"{'swap' if cfg.swap_ab else '-'}, {cfg.block_m}{mark} | "
                      + " | ".join(f"{t[m] * 1e3:.1f}" for m in rows)
                      + f" | {ctx.gbs(nbytes, t[rows[0]]).split(' | ')[1]} | {vs} |",
                      flush=True)
            if pick != gemm.DEFAULT_CONFIG:
                w = ws[0]
                group = w.group_size if w.scales.shape[1] > 1 else 0
                table[gemm.tuning_key(w.format, group, n, k)] = dataclasses.asdict(pick)
            del ws
            if not ctx.tiny:
                torch.cuda.empty_cache()
    name = "cpu (interpreter)" if ctx.tiny else torch.cuda.get_device_name()
    print(f"\n{len(table)} shape(s) tuned away from the default on {name}")
    if TUNE_OUT is not None:
        out = TUNE_OUT / f"{gemm.device_slug(name)}.json" if TUNE_OUT.is_dir() else TUNE_OUT
        out.write_text(json.dumps({"device": name, "dequant_matmul": table}, indent=1) + "\n")
        print(f"written to {out}")


@section("Paged attention, decode (`decode_attention`) vs torch SDPA on contiguous fp16 K/V",
         "decode")
def bench_decode(ctx: Ctx) -> None:
    import torch
    import torch.nn.functional as F

    from qserve.kernels.triton_paged_attention import decode_attention

    H, hkv, d = ctx.heads, ctx.kv_heads, ctx.head_dim
    print(f"{H} query heads, {hkv} KV heads, head_dim {d}, block size {ctx.page}; "
          "bytes = the context's K and V (values and scales)\n")
    print("| batch | context | KV | us | GB/s | % of copy | x SDPA fp16 |")
    print("|---|---|---|---|---|---|---|")
    for batch, context in ctx.contexts:
        q = torch.randn(batch, H, d, device=ctx.device, dtype=torch.float16)
        k = torch.randn(batch, hkv, context + 1, d, device=ctx.device, dtype=torch.float16)
        sdpa = ctx.bench_graph(lambda: F.scaled_dot_product_attention(
            q.unsqueeze(2), k, k, scale=d ** -0.5, enable_gqa=True))
        print(f"| {batch} | {context} | SDPA fp16 | {sdpa * 1e3:.1f} | "
              f"{ctx.gbs(2 * k.numel() * 2, sdpa)} | 1.00 |")
        del k
        for kv in ("fp16", "int8", "int4"):
            cache, meta = random_cache(batch, context, hkv, d, ctx.page, kv, ctx.device)
            ms = ctx.bench_graph(lambda: decode_attention(q, cache, meta, d ** -0.5))
            nbytes = cache_bytes(cache, batch * (context + 1))
            print(f"| {batch} | {context} | {kv} | {ms * 1e3:.1f} | {ctx.gbs(nbytes, ms)} | "
                  f"{sdpa / ms:.2f} |", flush=True)
            del cache


@section("Prefill attention (`prefill_attention`) and KV write (`write_kv`)", "prefill")
def bench_prefill_and_write(ctx: Ctx) -> None:
    import torch
    import torch.nn.functional as F

    from qserve.kernels.triton_kv_write import write_kv
    from qserve.kernels.triton_prefill_attention import prefill_attention

    H, hkv, d, L = ctx.heads, ctx.kv_heads, ctx.head_dim, ctx.prefill_len
    flops = 4 * L * L * H * d / 2  # causal: half of QK^T and PV
    q = torch.randn(L, H, d, device=ctx.device, dtype=torch.float16)
    print(f"One fresh prompt of {L} tokens, causal; {H} / {hkv} heads, head_dim {d}.\n")
    print("| kernel | KV | us | TFLOP/s or GB/s | x torch |")
    print("|---|---|---|---|---|")
    kt = torch.randn(1, hkv, L, d, device=ctx.device, dtype=torch.float16)
    sdpa = ctx.bench_graph(lambda: F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), kt, kt, is_causal=True, enable_gqa=True))
    print(f"| SDPA causal (torch) | fp16 | {sdpa * 1e3:.1f} | {flops / sdpa / 1e9:.1f} TFLOP/s "
          "| 1.00 |")
    for kv in ("fp16", "int8", "int4"):
        cache, meta = random_cache(1, L - 1, hkv, d, ctx.page, kv, ctx.device)
        meta.query_lens_list, meta.decode_only = [L], False
        meta.query_start_loc = torch.tensor([0, L], device=ctx.device)
        ms = ctx.bench_graph(lambda: prefill_attention(q, cache, meta, d ** -0.5))
        print(f"| prefill_attention | {kv} | {ms * 1e3:.1f} | {flops / ms / 1e9:.1f} TFLOP/s | "
              f"{sdpa / ms:.2f} |", flush=True)
        for tokens in ctx.write_tokens:
            kn = torch.randn(tokens, hkv, d, device=ctx.device, dtype=torch.float16)
            slots = torch.randperm(L, device=ctx.device)[:tokens]
            ms = ctx.bench_graph(lambda: write_kv(kn, kn, cache, slots))
            nbytes = 2 * kn.numel() * 2 + cache_bytes(cache, tokens)  # read fp16, write cache
            print(f"| write_kv, {tokens} tokens | {kv} | {ms * 1e3:.1f} | "
                  f"{nbytes / ms / 1e6:.0f} GB/s | |", flush=True)
        del cache


class RandomLlama:
    """A Llama-shaped decoder over the Triton kernels, random weights (see module docstring)."""

    def __init__(self, ctx: Ctx, weights: str):
        import torch

        m, dev = ctx.model, ctx.device
        self.H, self.hkv, self.d = ctx.heads, ctx.kv_heads, ctx.head_dim
        hid, inter = m["hidden"], m["inter"]
        qkv_out = (self.H + 2 * self.hkv) * self.d

        def w(n, k):
            return random_weight(n, k, weights, dev, m["group"])

        self.layers = [dict(qkv=w(qkv_out, hid), o=w(hid, self.H * self.d),
                            gate_up=w(2 * inter, hid), down=w(hid, inter),
                            norm1=torch.ones(hid, device=dev, dtype=torch.float16),
                            norm2=torch.ones(hid, device=dev, dtype=torch.float16))
                       for _ in range(m["layers"])]
        self.embed = torch.randn(m["vocab"], hid, device=dev, dtype=torch.float16)
        self.lm_head = random_weight(m["vocab"], hid, "fp16", dev)
        self.norm = torch.ones(hid, device=dev, dtype=torch.float16)
        self.nbytes = sum(weight_bytes(t) for lyr in self.layers for t in lyr.values()) \
            + weight_bytes(self.lm_head)

    @staticmethod
    def linear(x, w):
        import torch.nn.functional as F

        from qserve.kernels.triton_dequant_gemm import dequant_matmul

        return F.linear(x, w) if hasattr(w, "numel") else dequant_matmul(x, w)

    @staticmethod
    def rms_norm(x, w, eps: float = 1e-5):
        import torch

        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

    def decode_step(self, ids, caches, meta):
        """ids (B,) -> (B,) greedy next tokens; writes each layer's K/V at meta.slot_mapping."""
        import torch.nn.functional as F

        from qserve.kernels.triton_kv_write import write_kv
        from qserve.kernels.triton_paged_attention import decode_attention

        B, H, hkv, d = ids.shape[0], self.H, self.hkv, self.d
        h = self.embed[ids]  # (B, hidden)
        for layer, cache in zip(self.layers, caches):
            qkv = self.linear(self.rms_norm(h, layer["norm1"]), layer["qkv"])  # (B, (H+2hkv)d)
            q = qkv[:, :H * d].view(B, H, d)
            k = qkv[:, H * d:(H + hkv) * d].view(B, hkv, d)
            v = qkv[:, (H + hkv) * d:].view(B, hkv, d)
            write_kv(k, v, cache, meta.slot_mapping)
            attn = decode_attention(q, cache, meta, d ** -0.5)  # (B, H, d)
            h = h + self.linear(attn.reshape(B, H * d), layer["o"])
            gu = self.linear(self.rms_norm(h, layer["norm2"]), layer["gate_up"])  # (B, 2 inter)
            g, u = gu.chunk(2, dim=-1)
            h = h + self.linear(F.silu(g) * u, layer["down"])
        return F.linear(self.rms_norm(h, self.norm), self.lm_head).argmax(-1)


@section("End-to-end decode, random-weight Llama-3-8B-shaped model", "e2e")
def bench_e2e(ctx: Ctx) -> None:
    import torch

    m = ctx.model
    print(f"{m['layers']} layers, hidden {m['hidden']}, MLP {m['inter']}, {ctx.heads} / "
          f"{ctx.kv_heads} heads x {ctx.head_dim}, vocab {m['vocab']}; every sequence at "
          f"context {ctx.e2e_context}. Built here from dequant_matmul, write_kv and "
          "decode_attention (torch F.linear for fp16 weights and the fp16 LM head), the "
          "kernels the engine's models dispatch to on CUDA (kernels/dispatch.py).\n")
    print("| weights | KV | batch | weight GB | eager tok/s | CUDA graph tok/s |")
    print("|---|---|---|---|---|---|")
    for weights in ("fp16", "w8", "w4"):
        model = RandomLlama(ctx, weights)
        for kv in E2E_KV:
            for batch in ctx.e2e_batches:
                caches, meta = [], None
                for _ in range(m["layers"]):
                    cache, meta = random_cache(batch, ctx.e2e_context, ctx.kv_heads,
                                               ctx.head_dim, ctx.page, kv, ctx.device)
                    caches.append(cache)
                ids = torch.randint(0, m["vocab"], (batch,), device=ctx.device)
                eager = ctx.bench(lambda: model.decode_step(ids, caches, meta))
                graphed = "n/a (CPU)" if ctx.tiny else _graphed_tok_s(model, ids, caches, meta,
                                                                      ctx, batch)
                print(f"| {weights} | {kv} | {batch} | {model.nbytes / 1e9:.2f} | "
                      f"{batch / eager * 1e3:.1f} | {graphed} |", flush=True)
                del caches
        del model
        if not ctx.tiny:
            torch.cuda.empty_cache()


def _graphed_tok_s(model, ids, caches, meta, ctx: Ctx, batch: int) -> str:
    """Tokens/s of the decode step captured once as a CUDA graph and replayed (no Python or
    launch overhead); the reason, if capture fails."""
    import torch

    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile and allocate outside the capture
            for _ in range(2):
                model.decode_step(ids, caches, meta)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model.decode_step(ids, caches, meta)
        ms = ctx.bench(graph.replay)
        del graph
        return f"{batch / ms * 1e3:.1f}"
    except Exception as e:  # noqa: BLE001
        return f"n/a ({type(e).__name__}: {str(e)[:60]})"


# ---- compile-only: every variant the benchmarks launch, compiled for a GPU target ---------
def compile_only(arch: int) -> None:
    """Run the wrappers on CPU tensors with each launch replaced by triton.compile for
    cuda:sm_`arch` (ptxas ships with triton): front end, MLIR passes, PTX and cubin, no GPU."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    tys = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
           torch.int8: "i8", torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64"}
    seen = set()
    print(f"\n## Compile for cuda sm_{arch} (no launch)\n")
    print("| kernel | meta-parameters | shared bytes | warps | s |")
    print("|---|---|---|---|---|")

    def compile_launch(self, *args, grid, warmup, **kwargs):
        bound = dict(zip(self.arg_names, args), **kwargs)
        # the launcher's specialization: 16-byte aligned pointers and integers divisible by
        # 16 are marked so (what lets loads vectorise), integers equal to 1 become constants
        sig, constexprs, attrs = {}, {}, {}
        for i, (name, p) in enumerate(zip(self.arg_names, self.params)):
            v = bound[name]
            if p.is_constexpr:
                sig[name], constexprs[(i,)] = "constexpr", v
            elif isinstance(v, torch.Tensor):
                sig[name] = "*" + tys[v.dtype]
                if v.data_ptr() % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(v, bool):
                sig[name] = "i1"
            elif isinstance(v, int) and v == 1 and not p.do_not_specialize:
                sig[name], constexprs[(i,)] = "constexpr", 1
            elif isinstance(v, int):
                sig[name] = "i64" if abs(v) >= 2 ** 31 else "i32"
                if v % 16 == 0 and not p.do_not_specialize:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                sig[name] = "fp32"
        meta = ", ".join(f"{self.arg_names[i[0]]}={v}" for i, v in constexprs.items())
        key = (self.fn.__name__, meta, kwargs.get("num_warps"), kwargs.get("num_stages"))
        if key in seen:
            return
        seen.add(key)
        t0 = time.perf_counter()
        options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        meta += "".join(f", {k}={v}" for k, v in options.items())
        c = triton.compile(ASTSource(self, sig, constexprs=constexprs, attrs=attrs),
                           target=GPUTarget("cuda", arch, 32), options=options)
        print(f"| {self.fn.__name__} | {meta} | {c.metadata.shared} | {c.metadata.num_warps} | "
              f"{time.perf_counter() - t0:.1f} |", flush=True)

    JITFunction.run = compile_launch
    from qserve.kernels.triton_dequant_gemm import GemmConfig, dequant_matmul
    from qserve.kernels.triton_kv_write import write_kv
    from qserve.kernels.triton_paged_attention import decode_attention
    from qserve.kernels.triton_prefill_attention import prefill_attention

    swapped = GemmConfig(block_n=128, num_stages=2, fill=4, swap_ab=True)
    wide = GemmConfig(block_n=128, num_warps=8, num_stages=2, swap_ab=True, block_m=64)
    for fmt in ("w8", "w4", "w4a"):
        for m, dtype in ((1, torch.float16), (512, torch.float16), (1, torch.bfloat16)):
            for cfg in (None, swapped, wide):  # the default (or tuned), swapped variants
                dequant_matmul(torch.randn(m, 256).to(dtype),
                               random_weight(128, 256, fmt, "cpu"), config=cfg)
    dequant_matmul(torch.randn(2, 256), random_weight(128, 256, "w8", "cpu"),
                   torch.randn(128))  # fp32 (ieee dots), with a bias
    dequant_matmul(torch.randn(2, 48).half(), random_weight(128, 48, "w4a", "cpu", group=24))
    from qserve.formats import ggml
    from qserve.kernels.triton_ggml import ggml_matmul

    for fmt in ggml.IN_PLACE:  # the GGML formats read in place (a Q4_K_M file's Q4_K, Q6_K)
        for m, dtype in ((1, torch.float16), (512, torch.bfloat16)):
            ggml_matmul(torch.randn(m, 256).to(dtype), random_weight(128, 256, fmt, "cpu"))
    for kv in ("fp16", "int8", "int4"):
        cache, meta = random_cache(2, 300, 8, 128, 16, kv, "cpu")
        meta.sliding_window = 256 if kv == "int8" else None
        for dtype in (torch.float16, torch.bfloat16):
            q = torch.randn(2, 32, 128).to(dtype)
            decode_attention(q, cache, meta, 0.1)
            write_kv(q[:, :8], q[:, :8], cache, meta.slot_mapping)
            meta.decode_only = False
            prefill_attention(q, cache, meta, 0.1)
            meta.decode_only = True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true",
                    help="tiny shapes on CPU under TRITON_INTERPRET=1 (checks the script)")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile the kernels for a CUDA target without a GPU, then stop")
    ap.add_argument("--arch", type=int, default=90, help="compute capability for --compile-only")
    ap.add_argument("--skip-tests", action="store_true", help="skip the pytest run")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated, of {', '.join(SECTIONS)} (copy runs whenever a "
                         "benchmark does: they are reported against it)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from start after which no further section starts")
    ap.add_argument("--tune-out", default=None,
                    help="tune: where the table goes (a folder: <device>.json in it)")
    ap.add_argument("--tune-budget", type=float, default=150.0,
                    help="tune: seconds the sweep may take")
    ap.add_argument("--e2e-kv", default="fp16,int8,int4",
                    help="e2e: KV dtypes (fp16, int8, int4)")
    args = ap.parse_args()
    global DEADLINE, TUNE_OUT, TUNE_BUDGET, E2E_KV
    E2E_KV = tuple(k for k in args.e2e_kv.split(",") if k)
    if not E2E_KV or set(E2E_KV) - {"fp16", "int8", "int4"}:
        print(f"error: --e2e-kv takes fp16, int8, int4; got {args.e2e_kv!r}", file=sys.stderr)
        return 2
    DEADLINE = args.deadline
    TUNE_OUT = Path(args.tune_out) if args.tune_out else None
    TUNE_BUDGET = args.tune_budget
    SELECTED.clear()
    SELECTED.update(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = SELECTED - set(SECTIONS)
    if unknown:
        print(f"error: unknown section(s) {', '.join(sorted(unknown))}; choose from "
              f"{', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    if args.skip_tests:
        SELECTED.discard("tests")
    if SELECTED & {"tune", "gemm", "decode", "prefill", "e2e"}:
        SELECTED.add("copy")
    if args.tiny:  # before triton is imported: triton.jit reads it when it decorates
        os.environ["TRITON_INTERPRET"] = "1"
    elif args.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)
        compile_only(args.arch)
        return 0

    import torch

    if not args.tiny and not torch.cuda.is_available():
        print("no CUDA device: run with --tiny (interpreter) or --compile-only")
        return 2
    ctx = Ctx(args.tiny)
    import triton

    print(f"# qserve Triton kernels: GPU check ({'--tiny, interpreter' if args.tiny else 'CUDA'})"
          f"\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}"
          f", triton {triton.__version__}")
    t0 = time.perf_counter()
    run_tests(ctx)
    measure_copy(ctx)
    if ctx.copy_gbs is not None:
        tune_gemm(ctx)
        bench_gemm(ctx)
        bench_decode(ctx)
        bench_prefill_and_write(ctx)
        bench_e2e(ctx)
    print(f"\nTotal {time.perf_counter() - t0:.0f} s. "
          + (f"FAILED: {', '.join(FAILURES)}" if FAILURES else "All sections ran."))
    print("\n## Summary\n\n| section | outcome |\n|---|---|")
    for key, outcome in OUTCOMES:
        print(f"| {key} | {outcome} |")
    verdict = "NO-GO: " + ", ".join(FAILURES) if FAILURES else "GO"
    print(f"\n**{verdict}**")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
