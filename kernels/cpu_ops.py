"""The CPU fast path: kernels/cpu_ops.c (with kernels/cpu_formats.c), compiled once per machine
and called through ctypes.

The C source is built at first use with the system C compiler and CFLAGS (`-O3 -march=native
-fopenmp` ...) into $QSERVE_HOME/build/, keyed by a hash of the sources, the flags and the
machine, so an upgrade or a different CPU rebuilds it. Without a compiler, or if the build
fails, `lib()` returns None once and the model keeps the pure-torch reference path
(kernels/paged_attention.py, QuantizedTensor.dequantize); the reason is logged, never raised,
unless QSERVE_REQUIRE_KERNELS=1 (CI), which makes a failed build an error.

A weight matrix crosses into C as one WDesc (wdesc in cpu_ops.c): its format's kind from the
registry (qserve/formats/registry.py), pointers and sizes. `weight_matmul` runs any format
`supports` accepts; `CpuDecoder` runs a whole decode step over layers whose linears mix formats.

OpenMP: the library links libgomp.so.1 by soname, so inside a process where torch has loaded
its own libgomp the loader reuses that one: one thread pool, sized from torch.get_num_threads().
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from qserve.formats import QuantizedTensor, ggml
from qserve.formats.registry import KIND_INT4, KIND_INT4_X16, KIND_INT4Z, KIND_INT8
from qserve.kernels.kv_quant import CODEBOOK, KEY_BITS

log = logging.getLogger("qserve.kernels")

SOURCE = Path(__file__).with_name("cpu_ops.c")
SOURCES = (SOURCE, SOURCE.with_name("cpu_formats.c"))  # cpu_ops.c #includes the second
# Above this many rows, dequantize once and run one dense GEMM (prefill); at or below it, the
# fused kernel reads the packed weight once for all rows (decode).
FUSED_MAX_ROWS = 32
KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3, torch.uint8: 4}
# A layer's cache as the C functions take it (kv_layer in cpu_ops.c): these tensors' addresses
# in this order, 0 for those its dtype lacks (no scales for float KV; v_offset and the key
# codebook for int4 only).
KV_TENSORS = ("k", "k_scale", "v", "v_scale", "v_offset", *CODEBOOK)
MAX_HEAD_DIM = 1024

_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None  # why the build failed
_disabled = 0  # > 0 inside `disabled()`

_i64, _int, _flt, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p


class WDesc(ctypes.Structure):
    """One weight matrix W (N, K) as the C kernels take it (wdesc in cpu_ops.c, same order)."""

    _fields_ = [("kind", _i64),  # qserve/formats/registry.py WeightFormat.kind
                ("w", _ptr),  # dense (N, K), int4/int8 qweight, or GGML rows
                ("scales", _ptr),  # int4/int4z/int8 fp16 (N, G), else NULL
                ("offsets", _ptr),  # int4 fp16 (N, G), int4z uint8 zero points, else NULL
                ("bias", _ptr),  # fp32 (N,) or NULL
                ("N", _i64), ("K", _i64),
                ("Kp", _i64),  # int4/int4z/int8: K padded to whole groups; others K
                ("group_size", _i64),  # int4/int4z/int8 group, GGML block, dense 1
                ("row_bytes", _i64)]


MAX_SEGMENTS = 3  # row blocks per linear in the fused decode step (wlinear in cpu_ops.c)


class WLinear(ctypes.Structure):
    """A linear's output rows as up to MAX_SEGMENTS row blocks, each in its own format."""

    _fields_ = [("nseg", _i64), ("seg", WDesc * MAX_SEGMENTS)]


class DLayer(ctypes.Structure):
    """One decoder layer as decode_layers reads it (dlayer in cpu_ops.c)."""

    _fields_ = [("norm_in", _ptr), ("norm_post", _ptr), ("qkv", WLinear), ("o", WLinear),
                ("gate_up", WLinear), ("down", WLinear), ("cache", _i64 * len(KV_TENSORS)),
                ("rope", _i64),  # 0: the layer applies no rope (SmolLM3's every fourth)
                ("residual", ctypes.c_float)]  # scales each output before its add (Granite)


_WDESC = ctypes.POINTER(WDesc)
_SIGNATURES = {  # name: (argtypes, restype)
    "wmatmul": ([_WDESC, _ptr, _i64, _i64, _ptr, _i64, _int, _int], _int),
    "wdequant": ([_WDESC, _ptr, _int], _int),
    "wdequant_bf16": ([_WDESC, _ptr, _int], _int),
    "wdequant_rows": ([_WDESC, _ptr, _i64, _ptr, _int], _int),
    "wgemm_i8": ([_WDESC, _ptr, _i64, _i64, _ptr, _i64, _int], _int),
    "wkind_known": ([_i64], _int),
    "gemm_min_rows": ([_WDESC], _int),
    "set_gemm_rows": ([_int], None),
    "set_half_gemm_rows": ([_int], None),
    "has_int8_path": ([], _int),
    "kernel_isa": ([], _int),
    "gemm_vnni256": ([], _int),
    "kv_write": ([_int, _ptr, _ptr, _ptr, _i64, _i64, _int, _ptr, _int], None),
    "f32_matmul": ([_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _int], None),
    "decode_layers": ([_ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _int, _i64, _flt, _ptr, _ptr,
                       _ptr, _int, _ptr, _ptr, _i64, _ptr, _i64, _i64, _flt, _ptr, _int, _int],
                      None),
    "argmax_rows": ([_ptr, _i64, _i64, _i64, _ptr], None),
    "copy_rows": ([_ptr, _ptr, _ptr, _ptr, _i64, _i64], None),
    "x16_interleave": ([_WDESC, _WDESC, _i64, _int], _int),
    "paged_decode": ([_int, _ptr, _ptr, _i64, _i64, _i64, _int, _ptr, _ptr, _i64, _ptr, _i64,
                      _flt, _i64, _ptr, _int], None),
}


# -ffp-contract=fast lets a * b + c become one FMA: the int4/int8 KV writes, which must match
# the torch reference bit for bit, therefore divide, and multiply only where the product is
# exact. -fno-trapping-math changes no result (IEEE rounding stays as written) but lets gcc
# vectorize loops with clamps and rounding in them (the KV writes': ~3x faster).
CFLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-trapping-math", "-fopenmp",
          "-shared", "-fPIC", "-std=gnu11"]
# QSERVE_CPU_ISA=avx2 builds without AVX-512 (and without AVX-VNNI, its 256-bit vpdpbusd) on a
# CPU that has them: the kernels an AVX2-only CPU (Zen 3) runs, for tests and comparisons;
# avx2-vnni keeps AVX-VNNI where the CPU has it: what an Intel core without AVX-512 (Alder Lake
# and later) runs, the AVX2 kernels with the int8 GEMM in vpdpbusd.
ISA_FLAGS = {"native": [], "avx2": ["-mno-avx512f", "-mno-avxvnni"], "avx2-vnni": ["-mno-avx512f"]}
AVX2_ISAS = ("avx2", "avx2-vnni")  # QSERVE_CPU_ISA values that stand for a CPU without AVX-512


@functools.lru_cache(maxsize=None)
def cpu_vendor_and_flags() -> tuple[str, frozenset[str]]:
    """The first CPU's vendor_id and flags in /proc/cpuinfo; ("", empty) where unreadable."""
    vendor, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id":
                    vendor = value.strip()
                elif key == "flags":
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return vendor, flags


def mkl_strict_wanted(vendor: str, flags: frozenset[str], env: Mapping[str, str]) -> bool:
    """Whether MKL's fp32 GEMM (the prefill's, for dense weights and fp32 activations) needs
    its strict reproducibility mode (MKL_CBWR=AUTO,STRICT) for a row of the output not to
    depend on the rows beside it: on an Intel CPU where MKL runs its AVX2 code, whose sums
    there follow how it blocks the rows and columns (a Sapphire Rapids VM held to AVX2 by
    MKL_ENABLE_INSTRUCTIONS, standing for an Alder Lake: rows 3-40 of 45 multiplied alone
    differed from the same rows among the 45). In strict mode each output's sum has one order:
    equal bits, at the same speed there (113 GMAC/s at 512 x 2048 x 8192, 80-82 at 40 rows).
    Not where MKL runs AVX-512 (its rows agree there already, and strict mode is 4-5% slower)
    nor on AMD (Zen 3 agrees without it); never over a MKL_CBWR the user set."""
    if env.get("MKL_CBWR") or vendor != "GenuineIntel":
        return False
    held = env.get("MKL_ENABLE_INSTRUCTIONS", "").strip().upper()
    return "avx512f" not in flags or (held != "" and not held.startswith("AVX512"))


# MKL reads MKL_CBWR at its first call: set on import, it holds where torch has not yet
# multiplied on the CPU in this process (the CLI and the server import the kernels first).
if mkl_strict_wanted(*cpu_vendor_and_flags(), os.environ):
    os.environ["MKL_CBWR"] = "AUTO,STRICT"


def cflags() -> list[str]:
    isa = os.environ.get("QSERVE_CPU_ISA", "native")
    if isa not in ISA_FLAGS:
        raise RuntimeError(f"QSERVE_CPU_ISA={isa!r}: expected one of {', '.join(ISA_FLAGS)}")
    return CFLAGS + ISA_FLAGS[isa]


def _build_path() -> Path:
    from qserve.config import model_home

    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + " ".join(cflags()).encode()
                         + platform.machine().encode() + platform.node().encode()).hexdigest()[:16]
    return model_home() / "build" / f"cpu_ops-{key}.so"


def _compile(out: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    # build to a private name, then rename: concurrent processes never load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cc, *cflags(), str(SOURCE), "-o", tmp, "-lm"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:2])} failed: {res.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def lib() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None where it cannot be built or is
    switched off (QSERVE_KERNELS=reference). With QSERVE_REQUIRE_KERNELS=1 a failed build
    raises RuntimeError (with the compiler's message) instead, on every call."""
    global _lib, _tried, _error
    if _disabled:
        return None
    if not _tried:
        _tried = True
        if os.environ.get("QSERVE_KERNELS", "auto") == "reference":
            return None
        try:
            path = _build_path()
            if not path.exists():
                _compile(path)
            handle = ctypes.CDLL(str(path))
            for name, (argtypes, restype) in _SIGNATURES.items():
                fn = getattr(handle, name)
                fn.argtypes, fn.restype = argtypes, restype
            _lib = handle
            set_gemm_rows(_env_gemm_rows())
        except Exception as e:  # any failure leaves the reference path, which is always correct
            _error = str(e)
            log.warning("CPU kernels unavailable, using the pure-torch path: %s", e)
    if _lib is None and _error is not None and os.environ.get("QSERVE_REQUIRE_KERNELS") == "1":
        raise RuntimeError(f"the CPU kernels are required (QSERVE_REQUIRE_KERNELS=1) but did "
                           f"not build: {_error}")
    return _lib


@contextlib.contextmanager
def disabled():
    """Run the pure-torch reference path inside this block (tests compare the two)."""
    global _disabled
    _disabled += 1
    try:
        yield
    finally:
        _disabled -= 1


def _p(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def int8_activations() -> bool:
    """Whether packed matmuls may approximate their activations: decode-sized ones quantize
    them to int8 per 32 inputs (llama.cpp's CPU scheme: about 2x fewer instructions per
    weight; with many rows through the int8 GEMM on the weights' own codes, gemm_min_rows),
    prefill-sized ones multiply in bf16 where the CPU does that fast (fast_bf16), or quantize
    them alike for the int8 GEMM (int8_gemm).
    QSERVE_CPU_ACTIVATIONS=fp32 keeps fp32 (bit-for-bit closer to the reference path)."""
    return os.environ.get("QSERVE_CPU_ACTIVATIONS", "int8") != "fp32"


@functools.lru_cache(maxsize=None)
def fast_bf16() -> bool:
    """Whether prefill-sized matmuls multiply in bf16 (torch's oneDNN GEMM): where the CPU has
    AMX, at 4-5x the fp32 GEMM's rate (128 x 2048 x 8192: 218 against 43 GMAC/s on one core).
    AVX512-BF16 alone is not enough: on such a Xeon without AMX the bf16 GEMM ran at 0.64x
    the fp32 one (2 threads, 82 against 128 GFLOP/s at the same size, 0.76x at 512 rows).
    QSERVE_CPU_BF16=1 or 0 decides instead of the CPU's flags; QSERVE_CPU_ISA=avx2 or
    avx2-vnni (what a CPU without AVX-512 runs, which has no AMX) means 0 unless it is set."""
    forced = os.environ.get("QSERVE_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    if os.environ.get("QSERVE_CPU_ISA") in AVX2_ISAS:
        return False
    return "amx_bf16" in cpu_vendor_and_flags()[1]


def int8_gemm() -> bool:
    """Whether prefill-sized packed matmuls with int8 activations run the int8 GEMM (wgemm_i8,
    where fast_bf16 does not pick bf16; a kind it does not take, gemm_min_rows 0, keeps the
    fp32 GEMM): with the AVX-512 VNNI kernels at 1B shapes 3.3-3.5x the
    dequantize-then-fp32-GEMM path on a Xeon without AMX (128-512 rows, 2 threads); with the
    AVX2 ones (vpmaddubsw) 1.4-3.4x it at 2048 x 8192 and 8192 x 2048, 128-512 rows, 2
    threads (QSERVE_CPU_ISA=avx2 on a Zen 5); 8-bit codes (int8, iq4), multiplied there as two
    4-bit planes, about as fast as it (torch's GEMM held to AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2,
    a Sapphire Rapids VM: 0.97-1.07x at 2048 rows, up to 1.1x at 512)."""
    return kernel_isa() in ("avx512-vnni", "avx2") and not fast_bf16()


def _env_gemm_rows() -> int:
    """QSERVE_CPU_GEMM_ROWS: unset, each kind's own crossover (-1); n >= 1, the int8 GEMM from
    n rows for every kind; 0, never at decode sizes (up to FUSED_MAX_ROWS rows)."""
    raw = os.environ.get("QSERVE_CPU_GEMM_ROWS", "").strip()
    if not raw:
        return -1
    try:
        rows = int(raw)
    except ValueError:
        rows = -2
    if rows < 0:
        log.warning("QSERVE_CPU_GEMM_ROWS=%r is not a row count (0 or more); ignored", raw)
        return -1
    return rows


def set_gemm_rows(rows: int | None) -> None:
    """From how many rows int8-activation matmuls of up to FUSED_MAX_ROWS rows (decode batches)
    run the int8 GEMM instead of the row kernels, for every kind: None restores each kind's
    own crossover, 0 keeps the row kernels (then a row's result at decode never depends on its
    batch's size)."""
    if _lib is not None:
        _lib.set_gemm_rows(-1 if rows is None else int(rows))


def set_half_gemm_rows(rows: int | None) -> None:
    """From how many rows a dense fp16 / bf16 matmul of up to FUSED_MAX_ROWS rows converts each
    weight tile once for all rows (the tile GEMM) instead of once a row (the row kernel): None,
    the built-in crossover; 0, never. The two give the same bits; for tests and benchmarks."""
    L = lib()
    if L is not None:
        L.set_half_gemm_rows(-1 if rows is None else int(rows))


def gemm_min_rows(qt: QuantizedTensor) -> int:
    """The fewest rows from which `weight_matmul(..., int8_activations=True)` runs qt through
    the int8 GEMM at decode sizes; 0 where it never does (no AVX-512 VNNI, a dense format)."""
    L = lib()
    return 0 if L is None else int(L.gemm_min_rows(ctypes.byref(_desc(qt))))


def has_int8_path() -> bool:
    """Whether the build has the int8-activation kernels (AVX2 machines); elsewhere
    `int8_activations=True` runs the fp32-activation kernels."""
    L = lib()
    return L is not None and bool(L.has_int8_path())


def kernel_isa() -> str:
    """The instruction set of the built row kernels: "avx512-vnni", "avx2" or "portable"
    ("none" where the kernels are unavailable)."""
    L = lib()
    return "none" if L is None else ("portable", "avx2", "avx512-vnni")[L.kernel_isa()]


def gemm_isa() -> str:
    """What the int8 GEMM multiplies with: "avx512-vnni" (vpdpbusd on zmm), "avx-vnni"
    (vpdpbusd on ymm, the AVX2 kernels' GEMM on a CPU with AVX-VNNI and no AVX-512), "avx2"
    (vpmaddubsw), or "none" (no GEMM in this build)."""
    isa = kernel_isa()
    if isa == "avx2" and lib().gemm_vnni256():
        return "avx-vnni"
    return isa if isa in ("avx512-vnni", "avx2") else "none"


class ThreadBudget:
    """How many threads the C kernels and torch use: the user's torch.get_num_threads(), less
    the cores other processes are keeping busy (torch's count follows it).

    Two threads that meet at ~200 barriers per decode step run at the speed of the slower
    one, and one that the OS has descheduled for a time slice stalls the other (default
    model, 2 cores, one busy process beside: 39 tok/s on two threads, ~0.35x of quiet, where
    one thread alone keeps ~0.7x). So every INTERVAL seconds it reads how much CPU time the
    machine's cores spent busy (/proc/stat, the cores this process may run on) beyond this
    process's own (os.times()), and runs on the cores that leaves: round(cores - others),
    at least 1. QSERVE_ADAPTIVE_THREADS=0 keeps torch's count.
    """

    INTERVAL = 0.5

    def __init__(self):
        self.enabled = os.environ.get("QSERVE_ADAPTIVE_THREADS", "1") != "0"
        self.cores = _allowed_cpus()
        self.last: tuple[float, float, float] | None = None  # wall, busy ticks, own CPU s
        self.free: float | None = None  # cores the others left us at the last reading
        self.most = self.applied = 0  # the user's thread count; the count we last set

    def threads(self) -> int:
        n = torch.get_num_threads()
        if not self.enabled or not self.cores:
            return n
        if n != self.applied:  # set by the user (or torch's default), not by us
            self.most = n
        now = time.monotonic()
        if self.last is None or now - self.last[0] >= self.INTERVAL:
            self._read(now)
        k = self.most if self.free is None else max(1, min(self.most, round(self.free)))
        if k != n:  # torch's own parallel ops (the prefill GEMM) follow the same budget
            torch.set_num_threads(k)
        self.applied = k
        return k

    def _read(self, now: float) -> None:
        busy, own = _busy_ticks(self.cores), sum(os.times()[:2])
        if busy is not None and self.last is not None:
            wall = now - self.last[0]
            others = ((busy - self.last[1]) / _TICKS - (own - self.last[2])) / wall
            self.free = len(self.cores) - max(0.0, others)
        self.last = (now, busy if busy is not None else 0.0, own)


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def _busy_ticks(cpus: list[int]) -> float | None:
    """Clock ticks the given CPUs have spent not idle (user, nice, system, irq, softirq,
    steal), from /proc/stat; None where it cannot be read."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    want, total = {f"cpu{i}" for i in cpus}, 0.0
    for line in lines:
        parts = line.split()
        if parts and parts[0] in want:
            v = [float(x) for x in parts[1:9]]
            total += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]  # minus idle (3), iowait (4)
    return total


_budget = ThreadBudget()


def _threads() -> int:
    return _budget.threads()


# ---- weight matmul ---------------------------------------------------------------------------
def _desc(qt: QuantizedTensor, bias: torch.Tensor | None = None) -> WDesc:
    """The WDesc of qt (N, K) with this bias (N,); the caller keeps both alive meanwhile."""
    w = qt.qweight
    grouped = qt.fmt.kind in (KIND_INT4, KIND_INT4Z, KIND_INT4_X16, KIND_INT8)
    return WDesc(qt.fmt.kind, _p(w), _p(qt.scales), _p(qt.offsets), _p(bias), w.shape[0],
                 qt.in_features, qt.padded_in, qt.group_size if grouped else qt.fmt.block,
                 w.stride(0) * w.element_size())


def supports(qt: QuantizedTensor) -> bool:
    """Whether weight_matmul runs this matrix: a format the C kernels know, its tensors on the
    CPU, contiguous and shaped as the format says (int4, int4z: groups a multiple of 32
    inputs)."""
    L = lib()
    if L is None or not L.wkind_known(qt.fmt.kind):
        return False
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in qt.tensors().values()):
        return False
    return qt.validate() is None and (qt.fmt.kind not in (KIND_INT4, KIND_INT4Z)
                                      or qt.group_size % 32 == 0)


def runtime_layout(qt: QuantizedTensor, out: QuantizedTensor | None = None, row: int = 0
                   ) -> QuantizedTensor:
    """qt as the CPU kernels run it fastest: a q4_k / q6_k / int4 matrix with a multiple of 16
    rows (int4: groups of a multiple of 32 inputs) becomes its _x16 layout (16 rows
    interleaved, ggml.interleave: the same codes, so the same weights) where this build's
    kernels run it (X16_BASES: the 512-bit and the AVX2 ones all three);
    anything else is returned as it is. QSERVE_CPU_REPACK=0 keeps the file's layout (for
    comparisons).

    out: a matrix in qt's layout_format to write that layout into instead, at rows row ..
    row + qt's rows, and return (a large matrix laid out a slice at a time, or a fused
    matrix's parts, each straight into its place in the stack: ggml.empty_rows makes it)."""
    if out is None:
        run = layout_format(qt)
        if run == qt.format:
            return qt
        out = ggml.empty_rows(qt, qt.shape[0], run)
    n = qt.shape[0]
    assert 0 <= row and row + n <= out.shape[0], (row, n, out.shape)
    if out.format == qt.format or not _interleave_into(qt, out, row):
        # rows kept as they are, or the reference's interleaving where the kernels are not built
        laid = qt if out.format == qt.format else ggml.interleave(qt)
        for o, t in zip((out.qweight, out.scales, out.offsets),
                        (laid.qweight, laid.scales, laid.offsets)):
            if o is not None:
                o[row:row + n] = t
    return out


def layout_format(qt: QuantizedTensor) -> str:
    """The format runtime_layout lays qt out in (qt's own where it stays as it is)."""
    if qt.qweight.device.type != "cpu" or (qt.format == "int4" and qt.group_size % 32):
        return qt.format
    return runtime_format(qt.format, qt.shape)


def _interleave_into(qt: QuantizedTensor, out: QuantizedTensor, row: int) -> bool:
    """qt (n, K) in q4_k / q6_k / int4 -> rows row .. row + n of out, its _x16, in C
    (x16_interleave in cpu_formats.c: ggml.interleave's bytes, without its temporaries); False
    where the kernels are not built or do not take these tensors (nothing written)."""
    L = lib()
    if L is None or any(not t.is_contiguous() for t in (*qt.tensors().values(),
                                                         *out.tensors().values())):
        return False
    return L.x16_interleave(ctypes.byref(_desc(qt)), ctypes.byref(_desc(out)), row,
                            _threads()) == 0


# The formats each kernel set runs interleaved
X16_BASES = {"avx512-vnni": set(ggml.BY_BASE), "avx2": set(ggml.BY_BASE)}


def runtime_format(fmt: str, shape: tuple[int, ...]) -> str:
    """The format runtime_layout runs a `fmt` matrix of this shape (out, in) in."""
    if (fmt not in X16_BASES.get(kernel_isa(), ()) or len(shape) != 2
            or shape[0] % ggml.X16_ROWS or os.environ.get("QSERVE_CPU_REPACK", "1") == "0"):
        return fmt
    return ggml.BY_BASE[fmt]


def runtime_bytes(fmt: str, nbytes: int, shape: tuple[int, ...]) -> tuple[str, int]:
    """(format, resident bytes) of a `fmt` matrix of `nbytes` once runtime_layout has run."""
    run = runtime_format(fmt, shape)
    if run == fmt or ggml.INTERLEAVED[run][1] is None:  # int4_x16: the same bytes
        return run, nbytes
    blocks = shape[0] * (shape[1] // 256)
    return run, blocks * ggml.INTERLEAVED[run][1]


_local = threading.local()


SCRATCH_BYTES = 32 << 20  # a prefill matmul's dequantized weights, at most (_row_blocks)


def _scratch(N: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    """An (N, K) buffer for a dequantized block of weight rows, reused by this thread's
    prefill matmuls: the largest block's size is kept, not a fresh allocation per call, whose
    new pages the kernel would zero and fault in (about as long as the dequantization)."""
    size = N * K * torch.finfo(dtype).bits // 8
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < size:
        buf = _local.buf = torch.empty(size, dtype=torch.uint8)
    return buf[:size].view(dtype).view(N, K)


def _row_blocks(qt: QuantizedTensor, dtype: torch.dtype) -> list[tuple[int, int]]:
    """Output-row ranges a prefill matmul dequantizes and multiplies one at a time, each
    about SCRATCH_BYTES in `dtype` and a multiple of 64 rows (whole groups of an _x16
    layout's 16 rows); the whole matrix where its parts are not stored row by row."""
    N, K = qt.shape
    if any(t.shape[0] != N for t in qt.tensors().values()):
        return [(0, N)]
    step = block_rows(K, dtype.itemsize)
    return [(n0, min(N, n0 + step)) for n0 in range(0, N, step)]


def block_rows(K: int, itemsize: int) -> int:
    """Rows of a prefill matmul's dequantized block (_row_blocks) for K inputs."""
    return max(64, SCRATCH_BYTES // (K * itemsize) // 64 * 64)


def _row_range(qt: QuantizedTensor, n0: int, n1: int) -> QuantizedTensor:
    """Output rows n0 .. n1 of qt in its own layout: views of each part's rows."""
    pick = lambda t: None if t is None else t[n0:n1]  # noqa: E731
    return QuantizedTensor(qt.format, qt.qweight[n0:n1], pick(qt.scales), pick(qt.offsets),
                           qt.in_features)


def weight_matmul(x: torch.Tensor, qt: QuantizedTensor, bias: torch.Tensor | None = None,
                  int8_activations: bool = False, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """x (M, K) fp32 @ W^T (+ bias) for W = qt (N, K) in any format `supports` accepts
    -> (M, N) fp32; the reference is F.linear(x, qt.dequantize(), bias).

    Args:
        x: activations, stride(1) == 1 (rows may be strided).
        bias: fp32 (N,), contiguous, or None.
        int8_activations: approximate activations: up to FUSED_MAX_ROWS rows, x quantized to
            int8 per 32 inputs for the packed formats' integer dot products, as llama.cpp
            does (dense formats ignore it), in the row kernels, or from gemm_min_rows(qt)
            rows on in the int8 GEMM (wgemm_i8 in cpu_ops.c: the same x against the
            weights' own codes, AVX-512 VNNI or AVX2); more rows (prefill), x and the
            dequantized W in bf16 with fp32 accumulation where the CPU multiplies bf16 fast
            (fast_bf16), else the int8 GEMM where the kernels are AVX-512 VNNI or AVX2
            (int8_gemm).
        out: where to write, an (M, N) fp32 view with stride(1) == 1, e.g. a column slice
            y[:, n0:n1] of a wider output that several segments fill.
    Returns:
        out, or a new (M, N) tensor.
    """
    L = lib()
    assert L is not None
    M, K = x.shape
    N = qt.shape[0]
    assert K == qt.in_features and x.dtype == torch.float32 and x.stride(1) == 1, (x.shape, x.dtype)
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()
                            and bias.shape == (N,))
    if out is None:
        out = torch.empty(M, N, dtype=torch.float32)
    assert out.shape == (M, N) and out.dtype == torch.float32 and out.stride(1) == 1
    if M == 0:
        return out
    desc = _desc(qt, bias)
    if M > FUSED_MAX_ROWS:  # prefill: dequantize, then dense GEMMs
        bf16 = int8_activations and fast_bf16()  # as approximate as int8 per 32 inputs
        if not bf16 and int8_activations and int8_gemm() and L.wgemm_i8(
                ctypes.byref(desc), _p(x), M, x.stride(0), _p(out), out.stride(0),
                _threads()) == 0:  # -1: a dense format, which keeps the float GEMM
            return out
        if qt.format == "f32" and not bf16:
            out.copy_(torch.nn.functional.linear(x, qt.qweight, bias))
            return out
        dtype = torch.bfloat16 if bf16 else torch.float32
        dequant = L.wdequant_bf16 if bf16 else L.wdequant
        xs = x.to(dtype)
        for n0, n1 in _row_blocks(qt, dtype):
            part = qt if (n0, n1) == (0, N) else _row_range(qt, n0, n1)
            w = _scratch(n1 - n0, K, dtype)
            assert dequant(ctypes.byref(_desc(part)), _p(w), _threads()) == 0
            if bf16:  # fp32 accumulation, rounded to bf16, widened as copied
                out[:, n0:n1].copy_(torch.nn.functional.linear(xs, w))
            else:
                out[:, n0:n1].copy_(torch.nn.functional.linear(
                    xs, w, None if bias is None else bias[n0:n1]))
        return out.add_(bias) if bf16 and bias is not None else out
    assert L.wmatmul(ctypes.byref(desc), _p(x), M, x.stride(0), _p(out), out.stride(0),
                     int(int8_activations), _threads()) == 0
    return out


def weight_rows(qt: QuantizedTensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (integers, any shape) of qt in fp32, (*ids.shape, in_features): a token
    embedding's lookup through the row decoders of wdequant, which give the reference's
    weights exactly, without the Python deinterleaving of an _x16 table's groups. IndexError
    for an id outside qt's rows. The caller has checked supports(qt)."""
    L = lib()
    assert L is not None
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    return _rows(L, qt, _desc(qt), flat).reshape(*ids.shape, qt.in_features)


def _rows(L: ctypes.CDLL, qt: QuantizedTensor, desc: WDesc, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` ((n,) int64, contiguous) of qt, described by desc, in fp32: (n, in_features);
    IndexError for an id outside qt's rows."""
    out = torch.empty(ids.shape[0], qt.in_features, dtype=torch.float32)
    rc = L.wdequant_rows(ctypes.byref(desc), _p(ids), ids.shape[0], _p(out), _threads())
    if rc == -2:
        raise IndexError(f"a token id outside the embedding table's {qt.shape[0]} rows")
    assert rc == 0, rc
    return out


# ---- KV cache --------------------------------------------------------------------------------
def _kv_addresses(cache: dict[str, torch.Tensor]) -> list[int]:
    """The KV_TENSORS addresses of a layer's cache."""
    return [_p(cache.get(name)) or 0 for name in KV_TENSORS]


def _kv_layer(cache: dict[str, torch.Tensor]) -> ctypes.Array:
    """A kv_layer for one call; the cache dict keeps the tensors alive meanwhile."""
    return (_i64 * len(KV_TENSORS))(*_kv_addresses(cache))


def supports_cache(cache: dict[str, torch.Tensor]) -> bool:
    """Whether these kernels can read and write this layer's cache (CPU, contiguous, known
    dtype, head_dim that fits the kernels' stack buffer, int4 with its key codebook)."""
    k = cache["k"]
    int4 = k.dtype == torch.uint8
    d = k.shape[-1] * 8 // KEY_BITS if int4 else k.shape[-1]
    return (k.device.type == "cpu" and k.dtype in KV_KINDS and d <= MAX_HEAD_DIM
            and (not int4 or all(name in cache for name in CODEBOOK))
            and all(t.is_contiguous() for t in cache.values()))


def write_kv(k: torch.Tensor, v: torch.Tensor, cache: dict[str, torch.Tensor],
             slot_mapping: torch.Tensor) -> None:
    """Quantize (as the cache stores them; int4 keys with the cache's codebook) and scatter
    k, v (T, hkv, d) fp32 into their slots: kernels/paged_attention.py write_kv, without
    returning the dequantized values."""
    T, hkv, d = k.shape
    kind = KV_KINDS[cache["k"].dtype]
    k, v = k.float().contiguous(), v.float().contiguous()
    slots = slot_mapping.contiguous()
    assert slots.dtype == torch.int64 and slots.shape == (T,)
    lib().kv_write(kind, _p(k), _p(v), _p(slots), T, hkv, d, _kv_layer(cache), _threads())


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor,
              dst_idx: torch.Tensor) -> None:
    """dst[dst_idx] = src[src_idx] for contiguous CPU tensors of the same row shape and dtype,
    without OpenMP (see copy_rows in cpu_ops.c)."""
    assert src.dtype == dst.dtype and src.shape[1:] == dst.shape[1:]
    assert src.is_contiguous() and dst.is_contiguous() and src_idx.shape == dst_idx.shape
    assert src_idx.dtype == dst_idx.dtype == torch.int64
    src_idx, dst_idx = src_idx.contiguous(), dst_idx.contiguous()
    row_bytes = src[0].numel() * src.element_size() if src.shape[0] else 0
    lib().copy_rows(_p(src), _p(dst), _p(src_idx), _p(dst_idx), src_idx.numel(), row_bytes)


def f32_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ w (N, K)^T in fp32 with the row kernel (f32_matmul in cpu_ops.c): it streams
    w once for every MT rows of x, at DRAM speed, which suits a few rows. Reference: F.linear."""
    M, K = x.shape
    N = w.shape[0]
    assert x.dtype == w.dtype == torch.float32 and w.shape[1] == K and w.is_contiguous()
    assert x.stride(1) == 1
    y = torch.empty(M, N, dtype=torch.float32)
    lib().f32_matmul(_p(x), M, K, x.stride(0), _p(w), N, None, _p(y), N, _threads())
    return y


def paged_decode(q: torch.Tensor, cache: dict[str, torch.Tensor], block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence against its paged context: q (B, H, d) -> (B, H, d) fp32;
    sinks (H,): each head's sink logit (gpt-oss). The reference is
    kernels/paged_attention.py _decode_attention."""
    B, H, d = q.shape
    kc = cache["k"]
    bs, hkv = kc.shape[1:3]
    assert H % hkv == 0 and d <= MAX_HEAD_DIM
    assert block_tables.dtype == torch.int64 and seq_lens.dtype == torch.int64
    assert sinks is None or sinks.shape == (H,)
    q = q.float().contiguous()
    tables, lens = block_tables.contiguous(), seq_lens.contiguous()
    sinks = None if sinks is None else sinks.float().contiguous()
    out = torch.empty(B, H, d, dtype=torch.float32)
    lib().paged_decode(KV_KINDS[kc.dtype], _p(q), _p(out), B, H, hkv, d, _kv_layer(cache),
                       _p(tables), tables.shape[1], _p(lens), bs, scale, sliding_window or 0,
                       _p(sinks), _threads())
    return out


# ---- the fused decode step -------------------------------------------------------------------
def _linear(module: torch.nn.Module) -> WLinear | None:
    """One linear as decode_layers reads it: a QuantLinear's row segments (`module.segments`,
    any mix of formats, up to MAX_SEGMENTS) or an nn.Linear's fp32 weight, each segment with its
    slice of the bias; None if the C code cannot run it."""
    bias = getattr(module, "bias", None)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    segments = getattr(module, "segments", None)
    if segments is None:  # a dense nn.Linear
        w = module.weight
        segments = [QuantizedTensor("f32", w, None, None, w.shape[1])]
    if not 0 < len(segments) <= MAX_SEGMENTS or not all(supports(s) for s in segments):
        return None
    lin, n0 = WLinear(len(segments)), 0
    for i, seg in enumerate(segments):
        n1 = n0 + seg.shape[0]
        lin.seg[i] = _desc(seg, None if bias is None else bias[n0:n1])
        n0 = n1
    return lin


class CpuDecoder:
    """All decoder layers of a decode step in one C call (decode_layers).

    Built once per (model, KV cache): it records the raw addresses of the weights and cache
    tensors (one DLayer per layer), and holds references to them so they outlive it. `build`
    returns None where the C path does not apply (not fp32 on CPU, an unsupported linear or
    cache)."""

    def __init__(self, model, caches: list[dict[str, torch.Tensor]], layers: list[DLayer],
                 norm_final: torch.Tensor | None = None, head: QuantizedTensor | None = None,
                 table: QuantizedTensor | None = None):
        self.model, self.caches = model, caches
        self.head, self.table = head, table  # the output matrix, the token embedding's
        self.layers = (DLayer * len(layers))(*layers)
        arch = model.arch
        self.kind = KV_KINDS[caches[0]["k"].dtype]
        self.dims = (arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                     arch.intermediate_size, float(arch.rms_norm_eps))
        self.int8_activations = int8_activations()
        self.norm_final = norm_final  # the model's last norm's weight, or None: not applied

    @classmethod
    def build(cls, model, caches: list[dict[str, torch.Tensor]],
              norm_final: torch.Tensor | None = None, head: QuantizedTensor | None = None,
              table: QuantizedTensor | None = None) -> "CpuDecoder | None":
        """norm_final: the weight of an RMSNorm (w * x / sqrt(mean(x^2) + eps), the layers'
        eps) to apply to the step's output, fp32 (hidden,); head: the output matrix for
        `logits`; table: the token embedding's, for `embed` (fp32 rows); or None (each is
        dropped where the kernels cannot take it, and left to the caller)."""
        if lib() is None or model.dtype != torch.float32 or model.device.type != "cpu":
            return None
        d = model.arch.head_dim
        if d % 2 or d > MAX_HEAD_DIM or not all(supports_cache(c) for c in caches):
            return None
        layers: list[DLayer] = []
        for layer, cache in zip(model.layers, caches):
            attn, mlp = layer.self_attn, layer.mlp
            lins = [_linear(m) for m in
                    (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            # the model's own tables, or no rotation at all (a rope without tables)
            rotates = attn.rope is model.rope
            if any(x is None for x in lins) or not (rotates or not hasattr(attn.rope, "cos")):
                return None
            layers.append(DLayer(_p(layer.input_layernorm.weight),
                                 _p(layer.post_attention_layernorm.weight), *lins,
                                 (_i64 * len(KV_TENSORS))(*_kv_addresses(cache)), int(rotates),
                                 layer.residual))
        if norm_final is not None and not (norm_final.dtype == torch.float32
                                           and norm_final.is_contiguous()
                                           and norm_final.shape == (model.arch.hidden_size,)):
            norm_final = None  # the caller applies it
        head, table = [qt if qt is not None and qt.shape[1] == model.arch.hidden_size
                       and supports(qt) else None for qt in (head, table)]
        return cls(model, caches, layers, norm_final, head, table)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta, owned: bool = False
                 ) -> torch.Tensor:
        """x (T, hidden) fp32 embeddings of one decode step -> (T, hidden) after the last layer,
        and after norm_final where the decoder has one; writes the step's K/V into the
        cache. owned: x is contiguous and the caller's to overwrite (`embed`'s), else it is
        copied first."""
        if not owned:
            x = x.contiguous().clone()
        T = x.shape[0]
        hidden, H, hkv, d, inter, eps = self.dims
        rope = self.model.rope
        pos, slots = positions.contiguous(), meta.slot_mapping.contiguous()
        tables, lens = meta.block_tables.contiguous(), meta.seq_lens.contiguous()
        lib().decode_layers(ctypes.addressof(self.layers), len(self.caches), _p(x), T, hidden, H,
                            hkv, d, inter, eps, _p(pos), _p(rope.cos), _p(rope.sin), self.kind,
                            _p(slots), _p(tables), tables.shape[1], _p(lens),
                            self.caches[0]["k"].shape[1], meta.sliding_window or 0,
                            self.model.layers[0].self_attn.scale, _p(self.norm_final),
                            int(self.int8_activations), _threads())
        return x

    def embed(self, ids: torch.Tensor) -> torch.Tensor | None:
        """(T,) int64 token ids -> their (T, hidden) fp32 embedding rows (weight_rows' decoders,
        the same rows, without its reshapes and casts), or None where this does not apply (no
        table, ids of another shape or type)."""
        L = lib()
        if (L is None or self.table is None or ids.dtype != torch.int64 or ids.dim() != 1
                or not ids.is_contiguous() or ids.device.type != "cpu"):
            return None
        return _rows(L, self.table, _desc(self.table), ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(S, hidden) fp32 final hidden states -> (S, vocab) fp32 logits: weight_matmul on the
        output matrix (the call and bits of packed_linear's), or None where this does not apply
        (no head, another dtype, device or layout). packed_linear's reshapes, casts and
        column views around that call, their code out of the caches, had cost ~0.15 ms a
        step; weight_matmul's own checks cost ~5 us."""
        if (lib() is None or self.head is None or hidden.dtype != torch.float32
                or hidden.device.type != "cpu" or hidden.dim() != 2 or hidden.stride(1) != 1):
            return None
        return weight_matmul(hidden, self.head, None, self.int8_activations)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, V) fp32 on the CPU, stride(1) == 1 -> (B,) int64: each row's torch.argmax (the first
    largest; a NaN counts as the largest). torch's own took ~45 us for a 49k vocabulary (and
    more with its code out of the caches after a decode step's weights streamed through)."""
    B, V = x.shape
    assert x.dtype == torch.float32 and x.device.type == "cpu" and (x.stride(1) == 1 or V <= 1)
    out = torch.empty(B, dtype=torch.int64)
    if B and V:
        lib().argmax_rows(_p(x), B, V, x.stride(0), _p(out))
    elif B:
        raise RuntimeError("argmax of an empty row")
    return out
