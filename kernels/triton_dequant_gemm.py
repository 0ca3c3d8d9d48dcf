"""Fused dequant-GEMM in Triton: y = x @ W^T (+ bias) with W read packed (int4, int4z or int8)
and dequantized in registers. The reference is `F.linear(x, qt.dequantize().to(x.dtype), bias)`
(qserve/formats/qtensor.py has the layouts).

One kernel serves every M, with a plan that never looks at M (batch invariance: a row's
result is bit for bit the same alone and in any batch, so greedy output does not depend on
what else is running):

    BLOCK_M = 16 (the smallest tl.dot tile: batch-1 decode wastes the least; a weight's
    tuned configuration may take more, for every M alike), and K split over SPLIT_K
    programs chosen from N and K only, so that N / BLOCK_N * SPLIT_K fills the GPU. The
    fp32 partials (SPLIT_K, rows, N) are summed in split order by one small kernel; rows go
    ROWS_PER_LAUNCH at a time so the partials stay a few MB. Prefill pays for a small tile by
    dequantizing W once per BLOCK_M rows: on an H200 at 512 rows and 16-row tiles, int4 ran
    at 34-41 TFLOP/s against torch fp16's 670-740.

The launch configuration (BLOCK_N, the largest BLOCK_K, warps, pipeline stages, and how many
programs per multiprocessor split-K aims for) comes from a per-device table measured on that
GPU (`scripts/gpu_check.py --sections tune` writes kernels/tuned/<device>.json), keyed by
format, group, N and K: never by M, so the table keeps batch invariance. A configuration may
swap the dot's operands (`swap_ab`): y^T = W . x^T, the weight tile (BLOCK_N rows) the wide
operand and x's 16 rows the narrow one, the usual shape of a small-batch GEMM. On Hopper that
variant compiles to wgmma, the unswapped one to mma.sync with the weight tile through shared
memory (both read the weights with cp.async), so which is faster is the tuner's to measure.

Scales are applied per K tile, not per weight: when a tile lies inside one group,

    sum_k x_k (q_k s + m) = s * (x . q) + m * sum_k x_k

so the inner loop dots x with the raw codes (small integers, exact in fp16/bf16) and the
scale costs BLOCK_N multiplies per tile. int4z's integer zero points z become m = -z s in
fp32, exact (an 8-bit z times an fp16 s), so its weights q s + m are (q - z) s exactly. An
int4 tile is two dots, x's even columns with the low nibbles and its odd columns with the
high ones, so packed bytes load as contiguous runs and are never interleaved; the load is
masked on the packed byte index (not on the input column), so it vectorises, and a nibble
becomes a float by one bitcast (_codes). A group the tile cannot lie in (only the "divisor"
plan makes one, e.g. g24) falls back to dequantizing each weight before the dot.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from qserve.errors import ConfigError
from qserve.formats import QuantizedTensor

_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def dot_dtype(dtype: torch.dtype):
    """The tl dtype tiles of `dtype` are multiplied in. Triton 3.9's interpreter computes
    garbage for a bf16 tl.dot, so under it bf16 tiles are multiplied in fp32 instead."""
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return tl.float32
    return _TL_DTYPE[dtype]


@triton.jit
def _codes(nib, SYM: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """4-bit codes nib (int32 in [0, 15]) -> nib (minus 8 when SYM) in DOT_DTYPE, exact, with
    no int-to-float conversion: OR-ed into the mantissa of 2^e where the ulp is 1 (fp16 1024
    = 0x6400, bf16 128 = 0x4300, fp32 2^23 = 0x4B000000), a bitcast reads 2^e + nib, and
    one subtraction leaves the code."""
    if DOT_DTYPE == tl.float16:
        x = (nib | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        base = 1024.0
    elif DOT_DTYPE == tl.bfloat16:
        x = (nib | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        base = 128.0
    else:
        x = (nib | 0x4B000000).to(tl.float32, bitcast=True)
        base = 8388608.0
    if SYM:
        base += 8.0
    return x - base


@triton.jit
def _offsets(o_ptr, offs, mask, s, ZP: tl.constexpr):
    """The offsets m at offs (fp32): stored fp16 ones, or with ZP -z s from the zero points
    stored there (uint8), exact in fp32. s: the scales at offs, in fp32."""
    o = tl.load(o_ptr + offs, mask=mask, other=0)
    if ZP:
        return -(o.to(tl.float32) * s)
    return o.to(tl.float32)


@triton.jit
def _grid(offs_a, offs_b, T: tl.constexpr):
    """(offs_a[:, None], offs_b[None, :]) for an (A, B) tile, or laid out (B, A) when T: index
    and mask arithmetic written once for both the plain and the swapped kernel."""
    if T:  # one return statement: a compiled jit function's returns must agree in shape
        a, b = offs_a[None, :], offs_b[:, None]
    else:
        a, b = offs_a[:, None], offs_b[None, :]
    return a, b


@triton.jit
def _scaled_dot(acc, x, q, cols, g, offs_n, mask_n, K, s_ptr, o_ptr, stride_sn, stride_sg, GROUP,
                SYM: tl.constexpr, ZP: tl.constexpr, SCALE_PER_TILE: tl.constexpr,
                DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, T: tl.constexpr):
    """acc (BM, BN) + x (BM, BK') . W where W (BK', BN) = codes q of input columns `cols`
    times their scales (plus offsets). Columns past K meet x = 0 (group padding vanishes).
    T (swap_ab): everything transposed, acc (BN, BM) + W (BN, BK') . x (BK', BM), so the
    weight tile is the dot's wide operand and x's few rows its narrow one."""
    if SCALE_PER_TILE:  # the tile lies in group g: scale after the dot
        offs = offs_n * stride_sn + g * stride_sg
        s = tl.load(s_ptr + offs, mask=mask_n, other=0.0).to(tl.float32)
        if T:
            xq = tl.dot(q.to(DOT_DTYPE), x.to(DOT_DTYPE), input_precision=PRECISION)  # (BN, BM)
            acc += xq * s[:, None]
        else:
            xq = tl.dot(x.to(DOT_DTYPE), q.to(DOT_DTYPE), input_precision=PRECISION)  # (BM, BN)
            acc += xq * s[None, :]
        if not SYM:
            m = _offsets(o_ptr, offs, mask_n, s, ZP)
            if T:
                acc += m[:, None] * tl.sum(x.to(tl.float32), axis=0)[None, :]
            else:
                acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * m[None, :]
    else:  # each column's own group
        gk, nn = _grid(cols // GROUP, offs_n, T)
        ck, mn = _grid(cols < K, mask_n, T)
        g2 = gk * stride_sg + nn * stride_sn
        mask = ck & mn
        s = tl.load(s_ptr + g2, mask=mask, other=0.0).to(tl.float32)
        w = q * s
        if not SYM:
            w += _offsets(o_ptr, g2, mask, s, ZP)
        if T:
            acc += tl.dot(w.to(DOT_DTYPE), x.to(DOT_DTYPE), input_precision=PRECISION)
        else:
            acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=PRECISION)
    return acc


@triton.jit
def _dequant_matmul_kernel(
    # pointers
    x_ptr, w_ptr, s_ptr, o_ptr, bias_ptr, out_ptr,
    # sizes
    M, N, K, KP, GROUP, k_tiles_per_split,
    # strides
    stride_xm, stride_xk,
    stride_wn, stride_wk,  # over qweight's own columns (bytes for int4)
    stride_sn, stride_sg,  # scales and offsets (int4z: zero points) share theirs
    stride_os, stride_om, stride_on,  # out: (SPLIT_K, M, N)
    # meta-parameters
    BITS: tl.constexpr, SYM: tl.constexpr, ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCALE_PER_TILE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,  # every tile transposed (_scaled_dot's T): acc is (BN, BM)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    k_lo = pid_k * k_tiles_per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + k_tiles_per_split * BLOCK_K, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if BITS == 4:
            # Byte j holds input 2j in its low nibble and 2j + 1 in its high one. Rather than
            # interleave nibbles, split x: x . w = x[:, 0::2] . lo + x[:, 1::2] . hi, so the
            # bytes load as one contiguous (vectorisable) run per row of W.
            # Masked on the packed index against KP, qweight's own width (the group padding
            # past K is stored; it meets x = 0), so whole 16-byte runs load at once.
            offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            jj, nn = _grid(offs_j, offs_n, SWAP_AB)
            jm, nm = _grid(offs_j < KP, mask_n, SWAP_AB)
            packed = tl.load(w_ptr + jj * stride_wk + nn * stride_wn, mask=jm & nm, other=0)
            packed = packed.to(tl.int32)
            lo = _codes(packed & 0xF, SYM, DOT_DTYPE)  # (BK / 2, BN), or (BN, BK / 2)
            hi = _codes((packed >> 4) & 0xF, SYM, DOT_DTYPE)
            for half in tl.static_range(2):
                cols = 2 * offs_j + half  # (BK / 2,) input columns of this nibble
                mm, cc = _grid(offs_m, cols, SWAP_AB)
                mmask, cmask = _grid(mask_m, cols < K, SWAP_AB)
                x = tl.load(x_ptr + mm * stride_xm + cc * stride_xk, mask=mmask & cmask,
                            other=0.0)
                acc = _scaled_dot(acc, x, lo if half == 0 else hi, cols, k0 // GROUP, offs_n,
                                  mask_n, K, s_ptr, o_ptr, stride_sn, stride_sg, GROUP,
                                  SYM, ZP, SCALE_PER_TILE, DOT_DTYPE, PRECISION, SWAP_AB)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mm, kk = _grid(offs_m, offs_k, SWAP_AB)
            mmask, kmask = _grid(mask_m, offs_k < K, SWAP_AB)
            x = tl.load(x_ptr + mm * stride_xm + kk * stride_xk, mask=mmask & kmask, other=0.0)
            kk, nn = _grid(offs_k, offs_n, SWAP_AB)
            kmask, nmask = _grid(offs_k < K, mask_n, SWAP_AB)
            q = tl.load(w_ptr + kk * stride_wk + nn * stride_wn, mask=kmask & nmask, other=0)
            acc = _scaled_dot(acc, x, q.to(tl.float32), offs_k, k0 // GROUP, offs_n, mask_n, K,
                              s_ptr, o_ptr, stride_sn, stride_sg, GROUP,
                              SYM, ZP, SCALE_PER_TILE, DOT_DTYPE, PRECISION, SWAP_AB)

    if HAS_BIAS:
        if pid_k == 0:
            b = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            if SWAP_AB:
                acc += b[:, None]
            else:
                acc += b[None, :]
    mm, nn = _grid(offs_m, offs_n, SWAP_AB)
    mmask, nmask = _grid(mask_m, mask_n, SWAP_AB)
    out_ptrs = out_ptr + pid_k * stride_os + mm * stride_om + nn * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mmask & nmask)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, S, MN, BLOCK: tl.constexpr):
    """out (MN,) = sum over s of part (S, MN) fp32, added in the order s = 0, 1, ...: the
    same adds for every row whatever the batch (torch's sum may pick its order by shape)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(S):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


BLOCK_M = 16  # for every M: see the module docstring
ROWS_PER_LAUNCH = 1024  # split launches take rows this many at a time (bounded partials)
_SUM_BLOCK = 1024


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few splits, so the split path is exercised on CPU too


def split_plan(device: torch.device, N: int, k_units: int, BLOCK_N: int,
               split_k: int | None, fill: int = 2) -> tuple[int, int]:
    """How many programs share K, and how many K units each: enough to fill the GPU (`fill`
    programs per multiprocessor) with N / BLOCK_N tiles per split. Chosen from N and K, never
    M, so a row's sum runs in the same order in any batch. Returns (split_k, units per
    split)."""
    if split_k is None:
        split_k = max(1, min(k_units, fill * _num_sms(device) // triton.cdiv(N, BLOCK_N)))
    per_split = triton.cdiv(k_units, split_k)
    return triton.cdiv(k_units, per_split), per_split  # no empty splits


@dataclass(frozen=True)
class GemmConfig:
    """How _dequant_matmul_kernel is launched for one weight: chosen from the weight's format,
    group, N and K, never from M, so batch invariance holds whatever the table says."""
    block_n: int = 64
    max_block_k: int = 128  # the group rule may make a tile smaller (dequant_matmul)
    num_warps: int = 4
    num_stages: int = 3
    fill: int = 2  # split K until about fill programs per multiprocessor run
    swap_ab: bool = False  # the weight tile as the dot's first (wide) operand
    block_m: int = BLOCK_M  # rows of x per tile: more reuse each weight tile in prefill

    def __post_init__(self):
        for name in ("block_n", "max_block_k", "block_m", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < (16 if name.startswith("block") else 1) \
                    or v & (v - 1):
                raise ValueError(f"GemmConfig.{name} = {v!r}: not a power of two"
                                 + (" >= 16" if name.startswith("block") else ""))
        if self.max_block_k < 32 or self.num_stages < 1 or self.fill < 1:
            raise ValueError(f"GemmConfig: max_block_k >= 32, num_stages and fill >= 1: {self}")


DEFAULT_CONFIG = GemmConfig()
TUNED_DIR = Path(__file__).resolve().parent / "tuned"  # <device name>.json, by gpu_check tune


def tuning_key(fmt: str, group: int, N: int, K: int) -> str:
    """A tuned table's key for a weight: group 0 is one scale per row."""
    return f"{fmt} g{group} {N}x{K}"


def device_slug(name: str) -> str:
    """A device name as a file name: "NVIDIA H200" -> "nvidia-h200"."""
    slug = "".join(c if c.isalnum() else "-" for c in name.lower())
    return "-".join(part for part in slug.split("-") if part)


@functools.lru_cache(maxsize=None)
def _tuned_table(device_name: str, override: str | None) -> dict[str, GemmConfig]:
    """The tuned configurations for a device: $QSERVE_TRITON_TUNING's file if set, else
    kernels/tuned/<device>.json if it exists, else none (every weight gets DEFAULT_CONFIG).
    A file that cannot be read is a ConfigError (one line: the CLI's), not a silent
    fallback."""
    path = Path(override) if override else TUNED_DIR / f"{device_slug(device_name)}.json"
    if not path.is_file():
        if override:
            raise ConfigError(f"QSERVE_TRITON_TUNING: no such file {path}")
        return {}
    try:
        entries = json.loads(path.read_text())["dequant_matmul"]
        return {key: GemmConfig(**cfg) for key, cfg in entries.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{path}: not a dequant_matmul tuning table ({e})") from None


def gemm_config(device: torch.device, fmt: str, group: int, N: int, K: int) -> GemmConfig:
    """The configuration dequant_matmul launches a weight with on `device` (looked up once
    per device, table and weight shape: every linear of every step asks)."""
    if device.type != "cuda":
        return DEFAULT_CONFIG
    return _config_for(device, os.environ.get("QSERVE_TRITON_TUNING") or None,
                       tuning_key(fmt, group, N, K))


@functools.lru_cache(maxsize=None)
def _config_for(device: torch.device, override: str | None, key: str) -> GemmConfig:
    return _tuned_table(torch.cuda.get_device_name(device), override).get(key, DEFAULT_CONFIG)


def run_split(x: torch.Tensor, N: int, split_k: int, launch) -> torch.Tensor:
    """y (M, N) in x's dtype from launch(x_rows, out), which runs the GEMM of x_rows into
    out (splits, rows, N): one launch writing y itself when unsplit, else launches over
    ROWS_PER_LAUNCH rows at a time into fp32 partials, each summed by _sum_splits_kernel."""
    M = x.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if split_k == 1:
        launch(x, y.unsqueeze(0))
        return y
    buf = torch.empty(split_k * min(M, ROWS_PER_LAUNCH) * N, device=x.device,
                      dtype=torch.float32)
    for m0 in range(0, M, ROWS_PER_LAUNCH):
        rows = min(ROWS_PER_LAUNCH, M - m0)
        part = buf[: split_k * rows * N].view(split_k, rows, N)  # contiguous, as summed
        launch(x[m0:m0 + rows], part)
        _sum_splits_kernel[(triton.cdiv(rows * N, _SUM_BLOCK),)](
            part, y[m0:m0 + rows], split_k, rows * N, BLOCK=_SUM_BLOCK)
    return y


def dequant_matmul(x: torch.Tensor, qt: QuantizedTensor, bias: torch.Tensor | None = None,
                   split_k: int | None = None, config: GemmConfig | None = None
                   ) -> torch.Tensor:
    """x (M, K) fp16/bf16/fp32, qt packing an (N, K) weight -> (M, N) in x's dtype.

    split_k: programs along K (None picks one from N and K: enough to fill the GPU).
    config: the launch configuration (None: the device's tuned one for this weight, else
    DEFAULT_CONFIG).
    """
    assert x.dim() == 2 and x.dtype in _TL_DTYPE, (x.shape, x.dtype)
    M, K = x.shape
    N = qt.qweight.shape[0]
    assert K == qt.in_features, f"x has {K} columns, the weight {qt.in_features}"
    assert qt.qweight.dtype in (torch.uint8, torch.int8), qt.qweight.dtype
    assert qt.scales.shape == (N, qt.padded_in // qt.group_size), qt.scales.shape
    assert qt.format in ("int4", "int4z", "int8"), qt.format
    assert qt.offsets is None or (qt.bits == 4 and qt.offsets.stride() == qt.scales.stride())
    assert x.device == qt.qweight.device == qt.scales.device
    assert bias is None or bias.shape == (N,), bias.shape
    G = qt.scales.shape[1]
    group = qt.group_size
    if M == 0:
        return x.new_empty(0, N)

    if config is None:
        config = gemm_config(x.device, qt.format, group if G > 1 else 0, N, K)
    BLOCK_N = config.block_n
    if G == 1:  # one scale per row: any tile lies in the one group
        BLOCK_K = min(config.max_block_k, max(32, triton.next_power_of_2(K)))
        scale_per_tile = True
    else:  # a tile inside one group: the largest power of two dividing it, up to the cap
        BLOCK_K = min(config.max_block_k, group & -group)
        # tl.dot needs K >= 16, and an int4 tile is two dots over its halves; else scale each
        # weight (any even group: both nibbles of a byte share it)
        scale_per_tile = BLOCK_K >= 16 * (8 // qt.bits)
        BLOCK_K = BLOCK_K if scale_per_tile else 32
    split_k, per_split = split_plan(x.device, N, triton.cdiv(K, BLOCK_K), BLOCK_N, split_k,
                                    config.fill)
    s = qt.scales
    o = qt.offsets if qt.offsets is not None else s  # int4z: zero points; unread when symmetric

    def launch(xs: torch.Tensor, out: torch.Tensor) -> None:
        # out: (split_k, rows, N) partials, or (1, rows, N) y itself
        grid = (triton.cdiv(xs.shape[0], config.block_m), triton.cdiv(N, BLOCK_N),
                out.shape[0])
        _dequant_matmul_kernel[grid](
            xs, qt.qweight, s, o, bias if bias is not None else s, out,
            xs.shape[0], N, K, qt.qweight.shape[1], group if G > 1 else qt.padded_in,
            per_split,
            xs.stride(0), xs.stride(1),
            qt.qweight.stride(0), qt.qweight.stride(1),
            s.stride(0), s.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            BITS=qt.bits, SYM=qt.bits == 8 or qt.offsets is None, ZP=qt.format == "int4z",
            HAS_BIAS=bias is not None,
            SCALE_PER_TILE=scale_per_tile, DOT_DTYPE=dot_dtype(x.dtype),
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32: no tf32 rounding
            BLOCK_M=config.block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SWAP_AB=config.swap_ab,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )

    return run_split(x, N, split_k, launch)
