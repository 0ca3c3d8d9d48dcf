"""GGML quantization blocks: the layouts of a GGUF tensor's rows, and their pure-torch
dequantization, bit-exact with `gguf.quants.dequantize` (tests/test_ggml_formats.py).

A row of `in` inputs is in / block consecutive blocks of block_bytes bytes (little-endian).
Q4_0 / Q4_1 / Q8_0 have an exact qserve scheme and are repacked at load (`repack`); the other
types run in place: their kernels read these bytes as the file has them.

The _x16 layouts (q4_k_x16, q6_k_x16, and int4_x16 for the Q4_0 / Q4_1 repack) are the same
codes regrouped by 16 rows, which the CPU's kernels run (the 512-bit and the AVX2 ones all
three; `interleave`, `deinterleave`; kernels/cpu_ops.py runtime_layout picks them); never
stored in a file.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qserve.formats.qtensor import QuantizedTensor, pack_int4, unpack_int4
from qserve.heap import weight_buffer


@dataclass(frozen=True)
class GGMLType:
    type_id: int  # GGMLQuantizationType value
    block: int  # inputs per block
    block_bytes: int
    fp16_fields: tuple[int, ...]  # byte offsets of a block's fp16 scales (d, and dmin / m)
    e8m0_fields: tuple[int, ...] = ()  # byte offsets of its E8M0 scales (MXFP4's exponent e)


TYPES = {
    "q4_0": GGMLType(2, 32, 18, (0,)), "q4_1": GGMLType(3, 32, 20, (0, 2)),
    "q5_0": GGMLType(6, 32, 22, (0,)), "q5_1": GGMLType(7, 32, 24, (0, 2)),
    "q8_0": GGMLType(8, 32, 34, (0,)),
    "q2_k": GGMLType(10, 256, 84, (80, 82)), "q3_k": GGMLType(11, 256, 110, (108,)),
    "q4_k": GGMLType(12, 256, 144, (0, 2)), "q5_k": GGMLType(13, 256, 176, (0, 2)),
    "q6_k": GGMLType(14, 256, 210, (208,)),
    "iq4_nl": GGMLType(20, 32, 18, (0,)), "iq4_xs": GGMLType(23, 256, 136, (0,)),
    "mxfp4": GGMLType(39, 32, 17, (), (0,)),
}
# Every GGML type a GGUF file may name: id -> (name, inputs per block, bytes per block), so a
# file's header is read (and a type qserve cannot run is named) without the gguf package.
ALL_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}


class GGMLTypeId(int):
    """A GGML type id that knows its name (compares and hashes as the int)."""

    @property
    def name(self) -> str:
        return ALL_TYPES[self][0] if self in ALL_TYPES else f"type {int(self)}"


REPACKED = {"q4_0": "int4", "q4_1": "int4", "q8_0": "int8"}  # GGML type -> qserve format
IN_PLACE = ("q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs",
            "mxfp4")
# IQ4_NL / IQ4_XS: 4-bit indices into one fixed table of 16 int8 values (a non-uniform grid
# denser near zero), not integer codes; w = d * IQ4_VALUES[q] (IQ4_NL, 32-input blocks) or
# (d * (ls - 32)) * IQ4_VALUES[q] (IQ4_XS: super-blocks of 256, a 6-bit scale ls per 32).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# MXFP4 (OCP microscaling FP4, gpt-oss's experts): as IQ4_NL, but the table is E2M1's values
# doubled (a sign bit over 0, 0.5, 1, 1.5, 2, 3, 4, 6) and the block's scale an E8M0 byte e:
# w = 2^(e - 128) * MXFP4_VALUES[q] (2^(e - 127) halved for the doubling), exact in fp32.
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# random_rows' E8M0 exponents, [lo, hi): scales 2^-10 .. 2^-3, weights of a checkpoint's size
RANDOM_E8M0 = (118, 126)


def random_rows(name: str, out: int, in_features: int, generator: torch.Generator | None = None,
                device: torch.device | str | None = None) -> torch.Tensor:
    """(out, in_features / block * block_bytes) uint8 rows of random type-`name` blocks whose
    fp16 fields hold randn * 0.01 and E8M0 fields exponents in RANDOM_E8M0 (a checkpoint's
    size: no NaN, inf or subnormal arithmetic), for tests and benchmarks: every code and
    sub-block scale pattern occurs."""
    t = TYPES[name]
    n = out * in_features // t.block
    blocks = torch.randint(0, 256, (n, t.block_bytes), dtype=torch.uint8, generator=generator,
                           device=device)
    for off in t.fp16_fields:
        d = (torch.randn(n, 1, generator=generator, device=device) * 0.01).half()
        blocks[:, off:off + 2] = d.view(torch.uint8)
    for off in t.e8m0_fields:
        blocks[:, off] = torch.randint(*RANDOM_E8M0, (n,), dtype=torch.uint8,
                                       generator=generator, device=device)
    return blocks.view(out, -1)


def dequantize_blocks(name: str, blocks: torch.Tensor) -> torch.Tensor:
    """blocks (n, block_bytes) uint8 of GGML type `name` -> (n, block) fp32."""
    t = TYPES[name]
    assert blocks.dtype == torch.uint8 and blocks.dim() == 2 and blocks.shape[1] == t.block_bytes
    return _DEQUANTIZE[name](blocks)


def repack(name: str, rows: torch.Tensor, in_features: int) -> QuantizedTensor:
    """Q4_0 / Q4_1 / Q8_0 rows (out, in / 32 * block_bytes) uint8 -> qserve int4/int8 g32,
    losslessly:

        Q4_0  d fp16 | qs 16 B          w = d * (q - 8)   -> int4 g32 sym,  scale d
        Q4_1  d fp16 | m fp16 | qs 16 B w = d * q + m     -> int4 g32 asym, scale d, offset m
        Q8_0  d fp16 | qs 32 x int8     w = d * q         -> int8 g32,      scale d

    In a Q4 block byte j holds input j (low nibble) and j + 16 (high); qserve pairs inputs 2j,
    2j + 1 in a byte, so only nibbles move. Codes, scales and offsets are the file's own and
    dequantize with gguf-py's fp32 arithmetic, so every value is bit for bit the same.
    """
    nbytes = TYPES[name].block_bytes
    out = rows.shape[0]
    blocks = rows.reshape(out, in_features // 32, nbytes)
    scales = blocks[..., 0:2].contiguous().view(torch.float16).view(out, -1)  # (out, G)
    if name == "q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).reshape(out, in_features)
        return QuantizedTensor("int8", q, scales, None, in_features)
    offsets = None
    if name == "q4_1":
        offsets = blocks[..., 2:4].contiguous().view(torch.float16).view(out, -1)
    qs = blocks[..., nbytes - 16:]  # (out, G, 16)
    q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(out, in_features)  # inputs in order
    return QuantizedTensor("int4", pack_int4(q), scales, offsets, in_features)



# ---- q4_k_x16: Q4_K with 16 rows interleaved, for the CPU kernels (512-bit and AVX2) ---------
# Group g (rows 16g .. 16g + 15) holds its super-blocks in order, 16 x 144 bytes each:
#   d[16] fp16 | dmin[16] fp16 | lo[8][16] | hi[4][16] | qs[4][8][16][4]
# (sub-block j's 6-bit scale sc and min m of row r: lo[j][r] = sc & 15 | (m & 15) << 4, and
# hi[i][r] holds the top 2 bits of sub-blocks 2i (bits 0-1 sc, 2-3 m) and 2i + 1 (bits 4-5 sc,
# 6-7 m); qs[p][lg][r][t] = byte 32p + 4lg + t of row r's qs). Only bytes move and the 6-bit
# values are regrouped (_k_scale_min / _pack_scale_min and _split_scale_min / _join_scale_min
# are inverse bijections of 96 bits each), so deinterleave gives back the file's bytes exactly
# and the weights are q4_k's bit for bit. kernels/cpu_formats.c reads the layout.
X16_ROWS = 16
X16_ROW_BYTES = 144  # per row and super-block, as in the file
X16_CHUNK = 64 * X16_ROWS  # rows interleaved at a time


def _pack_scale_min(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """(n, 8) 6-bit scales and mins -> the (n, 12) bytes _k_scale_min reads them from."""
    a = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    m = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    lo = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return torch.cat([a, m, lo], dim=1)


def _split_scale_min(sc: torch.Tensor, mn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 8) 6-bit scales and mins -> q4_k_x16's (n, 8) low nibbles and (n, 4) top bits."""
    lo = (sc & 15) | ((mn & 15) << 4)
    top = (sc >> 4) | ((mn >> 4) << 2)  # (n, 8), 4 bits each
    return lo, top[:, 0::2] | (top[:, 1::2] << 4)


def _join_scale_min(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of _split_scale_min."""
    top = torch.stack([hi & 15, hi >> 4], dim=2).reshape(-1, 8)
    return (lo & 15) | ((top & 3) << 4), (lo >> 4) | ((top >> 2) << 4)


def _by_groups(qt: QuantizedTensor, name: str, row_bytes: int, one) -> QuantizedTensor:
    """qt's rows interleaved as `name`, `one` (input rows -> output rows) applied to
    X16_CHUNK rows at a time, written into one output: a large table (a vocabulary's
    embedding) never has more than a chunk's temporaries beside its two copies."""
    n, nb = qt.shape[0], qt.in_features // 256
    out = torch.empty(n, nb * row_bytes, dtype=torch.uint8)
    for r in range(0, n, X16_CHUNK):
        out[r:r + X16_CHUNK] = one(qt.qweight[r:r + X16_CHUNK], nb)
    return QuantizedTensor(name, out, None, None, qt.in_features)


def interleave_q4_k(qt: QuantizedTensor) -> QuantizedTensor:
    """A q4_k matrix (rows a multiple of 16) -> the same weights as q4_k_x16."""
    assert qt.format == "q4_k" and qt.shape[0] % X16_ROWS == 0
    return _by_groups(qt, "q4_k_x16", X16_ROW_BYTES, _interleave_q4_k)


def _interleave_q4_k(rows: torch.Tensor, nb: int) -> torch.Tensor:
    n = rows.shape[0]
    g = n // X16_ROWS
    b = rows.reshape(g, X16_ROWS, nb, 144)
    lo, hi = _split_scale_min(*_k_scale_min(b[..., 4:16].reshape(-1, 12)))

    def by_row(t: torch.Tensor, width: int) -> torch.Tensor:  # (g, r, nb, w) -> (g, nb, w, r)
        return t.reshape(g, X16_ROWS, nb, width).permute(0, 2, 3, 1)

    d = b[..., 0:2].permute(0, 2, 1, 3).reshape(g, nb, 32)
    dmin = b[..., 2:4].permute(0, 2, 1, 3).reshape(g, nb, 32)
    qs = b[..., 16:].reshape(g, X16_ROWS, nb, 4, 8, 4).permute(0, 2, 3, 4, 1, 5)
    out = torch.cat([d, dmin, by_row(lo, 8).reshape(g, nb, 128),
                     by_row(hi, 4).reshape(g, nb, 64), qs.reshape(g, nb, 2048)], dim=2)
    return out.reshape(n, nb * X16_ROW_BYTES)


def deinterleave_q4_k(qt: QuantizedTensor) -> QuantizedTensor:
    """q4_k_x16 -> the q4_k matrix it was made from, byte for byte."""
    n, nb = qt.shape[0], qt.in_features // 256
    g = n // X16_ROWS
    x = qt.qweight.reshape(g, nb, X16_ROWS * X16_ROW_BYTES)

    def by_block(t: torch.Tensor, width: int) -> torch.Tensor:  # (g, nb, w * r) -> (g, r, nb, w)
        return t.reshape(g, nb, width, X16_ROWS).permute(0, 3, 1, 2)

    d = x[..., 0:32].reshape(g, nb, X16_ROWS, 2).permute(0, 2, 1, 3)
    dmin = x[..., 32:64].reshape(g, nb, X16_ROWS, 2).permute(0, 2, 1, 3)
    sc, mn = _join_scale_min(by_block(x[..., 64:192], 8).reshape(-1, 8),
                             by_block(x[..., 192:256], 4).reshape(-1, 4))
    scales = _pack_scale_min(sc, mn).reshape(g, X16_ROWS, nb, 12)
    qs = x[..., 256:].reshape(g, nb, 4, 8, X16_ROWS, 4).permute(0, 4, 1, 2, 3, 5)
    blocks = torch.cat([d, dmin, scales, qs.reshape(g, X16_ROWS, nb, 128)], dim=3)
    return QuantizedTensor("q4_k", blocks.reshape(n, nb * 144), None, None, qt.in_features)



# ---- q6_k_x16: Q6_K alike --------------------------------------------------------------------
# Per group and super-block (X16Q6_ROW_BYTES a row, 2 of them zero padding):
#   ql[2][2][8][16][4] | qh[2][8][16][4] | sc[16][16] int8 | d[16] fp16 | 32 zero bytes
# ql[h][e][lg][r][t] = row r's ql[64h + 32e + 4lg + t], qh[h][lg][r][t] = its qh[32h + 4lg + t],
# sc[s][r] its scale s: bytes moved, nothing recomputed (kernels/cpu_formats.c).
X16Q6_ROW_BYTES = 212


def interleave_q6_k(qt: QuantizedTensor) -> QuantizedTensor:
    """A q6_k matrix (rows a multiple of 16) -> the same weights as q6_k_x16."""
    assert qt.format == "q6_k" and qt.shape[0] % X16_ROWS == 0
    return _by_groups(qt, "q6_k_x16", X16Q6_ROW_BYTES, _interleave_q6_k)


def _interleave_q6_k(rows: torch.Tensor, nb: int) -> torch.Tensor:
    n = rows.shape[0]
    g = n // X16_ROWS
    b = rows.reshape(g, X16_ROWS, nb, 210)
    ql = b[..., 0:128].reshape(g, X16_ROWS, nb, 2, 2, 8, 4).permute(0, 2, 3, 4, 5, 1, 6)
    qh = b[..., 128:192].reshape(g, X16_ROWS, nb, 2, 8, 4).permute(0, 2, 3, 4, 1, 5)
    sc = b[..., 192:208].permute(0, 2, 3, 1)
    d = b[..., 208:210].permute(0, 2, 1, 3)
    pad = torch.zeros(g, nb, 32, dtype=torch.uint8)
    out = torch.cat([ql.reshape(g, nb, 2048), qh.reshape(g, nb, 1024), sc.reshape(g, nb, 256),
                     d.reshape(g, nb, 32), pad], dim=2)
    return out.reshape(n, nb * X16Q6_ROW_BYTES)


def deinterleave_q6_k(qt: QuantizedTensor) -> QuantizedTensor:
    """q6_k_x16 -> the q6_k matrix it was made from, byte for byte."""
    n, nb = qt.shape[0], qt.in_features // 256
    g = n // X16_ROWS
    x = qt.qweight.reshape(g, nb, X16_ROWS * X16Q6_ROW_BYTES)
    ql = x[..., 0:2048].reshape(g, nb, 2, 2, 8, X16_ROWS, 4).permute(0, 5, 1, 2, 3, 4, 6)
    qh = x[..., 2048:3072].reshape(g, nb, 2, 8, X16_ROWS, 4).permute(0, 4, 1, 2, 3, 5)
    sc = x[..., 3072:3328].reshape(g, nb, 16, X16_ROWS).permute(0, 3, 1, 2)
    d = x[..., 3328:3360].reshape(g, nb, X16_ROWS, 2).permute(0, 2, 1, 3)
    blocks = torch.cat([ql.reshape(g, X16_ROWS, nb, 128), qh.reshape(g, X16_ROWS, nb, 64), sc,
                        d], dim=3)
    return QuantizedTensor("q6_k", blocks.reshape(n, nb * 210), None, None, qt.in_features)


# ---- int4_x16: qserve's int4 (a Q4_0 / Q4_1 file's repack) interleaved alike ------------------
# qweight (out, in_p / 2) as int4's, per group of 16 rows and 32-input chunk c: [lg][r][t] = row
# r's codes of inputs 32c + 4lg + t (low nibble) and 32c + 16 + 4lg + t (high); scales and
# offsets (out, G) with each group of 16 rows stored [G][16]. Same bytes count, same codes.
def interleave_int4(qt: QuantizedTensor) -> QuantizedTensor:
    """An int4 matrix (rows a multiple of 16, groups a multiple of 32) -> int4_x16."""
    assert qt.format == "int4" and qt.shape[0] % X16_ROWS == 0 and qt.group_size % 32 == 0
    n, kp = qt.shape[0], qt.padded_in
    out = torch.empty(n, kp // 2, dtype=torch.uint8)
    for r in range(0, n, X16_CHUNK):  # a chunk's temporaries at a time, as _by_groups
        rows = qt.qweight[r:r + X16_CHUNK]
        g = rows.shape[0] // X16_ROWS
        codes = unpack_int4(rows).reshape(g, X16_ROWS, kp // 32, 2, 4, 4)  # (g, r, c, h, lg, t)
        packed = (codes[:, :, :, 0] | (codes[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)
        out[r:r + X16_CHUNK] = packed.reshape(-1, kp // 2)
    return QuantizedTensor("int4_x16", out, _rows_by_group(qt.scales),
                           _rows_by_group(qt.offsets), qt.in_features)


def deinterleave_int4(qt: QuantizedTensor) -> QuantizedTensor:
    """int4_x16 -> the int4 matrix it was made from."""
    n, kp = qt.shape[0], qt.padded_in
    g, nc = n // X16_ROWS, kp // 32
    b = qt.qweight.reshape(g, nc, 4, X16_ROWS, 4)  # (g, c, lg, r, t)
    codes = torch.stack([b & 15, b >> 4], dim=2)  # (g, c, half, lg, r, t)
    codes = codes.permute(0, 4, 1, 2, 3, 5).reshape(n, kp)
    return QuantizedTensor("int4", pack_int4(codes), _rows_by_group(qt.scales, back=True),
                           _rows_by_group(qt.offsets, back=True), qt.in_features)


def _rows_by_group(t: torch.Tensor | None, back: bool = False) -> torch.Tensor | None:
    """(out, G) -> the same shape with each group of 16 rows stored [G][16] (back: undone)."""
    if t is None:
        return None
    n, G = t.shape
    if back:
        return t.reshape(n // X16_ROWS, G, X16_ROWS).transpose(1, 2).reshape(n, G)
    return t.reshape(n // X16_ROWS, X16_ROWS, G).transpose(1, 2).reshape(n, G)


# name -> (base format, bytes a row and super-block or None where the size is the base's,
# interleave, deinterleave)
INTERLEAVED = {"q4_k_x16": ("q4_k", X16_ROW_BYTES, interleave_q4_k, deinterleave_q4_k),
               "q6_k_x16": ("q6_k", X16Q6_ROW_BYTES, interleave_q6_k, deinterleave_q6_k),
               "int4_x16": ("int4", None, interleave_int4, deinterleave_int4)}
BY_BASE = {base: name for name, (base, *_) in INTERLEAVED.items()}


def empty_rows(qt: QuantizedTensor, rows: int, fmt: str | None = None) -> QuantizedTensor:
    """An uninitialized (rows, qt.in_features) matrix in `fmt`, qt's format or its _x16 (default
    qt's), with qt's groups and symmetry: a stack for qt and like matrices to be written into
    (cpu_ops.runtime_layout's out)."""
    fmt = fmt or qt.format
    assert fmt == qt.format or INTERLEAVED[fmt][0] == qt.format, (fmt, qt.format)
    width = qt.qweight.shape[1]
    if fmt != qt.format and INTERLEAVED[fmt][1] is not None:  # int4_x16: int4's shapes
        width = qt.in_features // 256 * INTERLEAVED[fmt][1]
    new = lambda t: None if t is None else t.new_empty((rows, t.shape[1]))  # noqa: E731
    codes = weight_buffer((rows, width), qt.qweight.dtype, qt.qweight.device)  # 2 MiB pages
    return QuantizedTensor(fmt, codes, new(qt.scales), new(qt.offsets), qt.in_features)


def interleave(qt: QuantizedTensor) -> QuantizedTensor:
    """q4_k / q6_k (rows a multiple of X16_ROWS) -> its _x16 layout."""
    return INTERLEAVED[BY_BASE[qt.format]][2](qt)


def deinterleave(qt: QuantizedTensor) -> QuantizedTensor:
    """An _x16 matrix -> the file's q4_k / q6_k blocks, byte for byte."""
    return INTERLEAVED[qt.format][3](qt)


def interleaved_rows(qt: QuantizedTensor, idx) -> QuantizedTensor:
    """Rows `idx` (an index tensor or slice) of an _x16 matrix, in its base format: only the
    groups of 16 that hold them are deinterleaved (a token embedding's lookup)."""
    ids = torch.arange(qt.shape[0])[idx].reshape(-1)
    groups = torch.unique(ids // X16_ROWS)

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        w = t.shape[1]
        return t.reshape(-1, X16_ROWS * w)[groups].reshape(-1, w)

    base = deinterleave(QuantizedTensor(qt.format, pick(qt.qweight), pick(qt.scales),
                                        pick(qt.offsets), qt.in_features))
    pos = torch.searchsorted(groups, ids // X16_ROWS) * X16_ROWS + ids % X16_ROWS
    return base.rows(pos)

# ---- per-type dequantization (n, block_bytes) uint8 -> (n, block) fp32 ----------------------
# Each follows gguf-py's fp32 arithmetic step for step (products formed in the same order,
# integers exact), so the results are bit for bit its own. Layout comments give byte offsets
# into a block and number its inputs 0 .. block - 1; d, dmin and m are fp16.
def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 little-endian fp16 -> (n, 1) fp32."""
    return b.contiguous().view(torch.float16).float()


def _fields(b: torch.Tensor, width: int) -> torch.Tensor:
    """(..., L) uint8 -> (..., 8 // width, L) uint8: field f holds bits
    [f * width, (f + 1) * width) of each byte."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=b.device)
    return (b.unsqueeze(-2) >> shifts[:, None]) & ((1 << width) - 1)


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) bytes of a 32-input block -> (n, 32) codes: input j is byte j's low nibble,
    input j + 16 its high one."""
    return _fields(qs, 4).reshape(qs.shape[0], 32)


def _high_bits32(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) bytes, a little-endian uint32 -> (n, 32): bit i (input i's fifth bit)."""
    return _fields(qh, 1).transpose(1, 2).reshape(qh.shape[0], 32)


def _dequantize_q4_0(b: torch.Tensor) -> torch.Tensor:
    # 0 d | 2 qs[16]                        w = d * (q - 8)
    return _f16(b[:, 0:2]) * (_nibbles32(b[:, 2:18]).float() - 8)


def _dequantize_q4_1(b: torch.Tensor) -> torch.Tensor:
    # 0 d | 2 m | 4 qs[16]                  w = d * q + m
    return _f16(b[:, 0:2]) * _nibbles32(b[:, 4:20]).float() + _f16(b[:, 2:4])


def _dequantize_q5_0(b: torch.Tensor) -> torch.Tensor:
    # 0 d | 2 qh (uint32) | 6 qs[16]        q = nibble | qh bit i << 4, w = d * (q - 16)
    q = _nibbles32(b[:, 6:22]) | (_high_bits32(b[:, 2:6]) << 4)
    return _f16(b[:, 0:2]) * (q.float() - 16)


def _dequantize_q5_1(b: torch.Tensor) -> torch.Tensor:
    # 0 d | 2 m | 4 qh (uint32) | 8 qs[16]  q as Q5_0, w = d * q + m
    q = _nibbles32(b[:, 8:24]) | (_high_bits32(b[:, 4:8]) << 4)
    return _f16(b[:, 0:2]) * q.float() + _f16(b[:, 2:4])


def _dequantize_q8_0(b: torch.Tensor) -> torch.Tensor:
    # 0 d | 2 qs[32] int8                   w = q * d
    return b[:, 2:34].contiguous().view(torch.int8).float() * _f16(b[:, 0:2])


def _dequantize_q2_k(b: torch.Tensor) -> torch.Tensor:
    # 0 scales[16] | 16 qs[64] | 80 d | 82 dmin; 16 sub-blocks of 16 inputs.
    # scales[s]: low nibble sc, high nibble mn.  Input 128h + 32f + j is 2-bit field f of
    # qs[32h + j].                           w = (d * sc) * q - (dmin * mn)
    n = b.shape[0]
    sc = b[:, 0:16]
    dl = (_f16(b[:, 80:82]) * (sc & 15).float()).view(n, 16, 1)
    ml = (_f16(b[:, 82:84]) * (sc >> 4).float()).view(n, 16, 1)
    q = _fields(b[:, 16:80].reshape(n, 2, 32), 2).reshape(n, 16, 16).float()
    return (dl * q - ml).view(n, 256)


def _dequantize_q3_k(b: torch.Tensor) -> torch.Tensor:
    # 0 hmask[32] | 32 qs[64] | 96 scales[12] | 108 d; 16 sub-blocks of 16 inputs.
    # Input 128h + 32f + j: low 2 bits field f of qs[32h + j]; input 32f + j: bit f of
    # hmask[j], set meaning "no -4".  Scale s (6 bits, offset 32): low nibble s // 8 of
    # scales[s % 8], high 2 bits field s // 4 of scales[8 + s % 4].
    #                                         w = (d * (sc - 32)) * (q2 - 4 * (1 - hbit))
    n = b.shape[0]
    lo = _fields(b[:, 96:104], 4).reshape(n, 16)
    hi = _fields(b[:, 104:108], 2).reshape(n, 16)
    sc = (lo | (hi << 4)).float() - 32
    dl = (_f16(b[:, 108:110]) * sc).view(n, 16, 1)
    q2 = _fields(b[:, 32:96].reshape(n, 2, 32), 2).reshape(n, 256)
    hbit = _fields(b[:, 0:32], 1).reshape(n, 256)
    q = (q2.to(torch.int16) - 4 * (1 - hbit.to(torch.int16))).float()
    return (dl * q.view(n, 16, 16)).view(n, 256)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> (n, 8) 6-bit scales and mins of the 32-input sub-blocks.
    Sub-block t < 4: sc = s[t] & 63, mn = s[4 + t] & 63; t >= 4 (u = t - 4): the low 4 bits
    are s[8 + u]'s low (sc) / high (mn) nibble, the top 2 bits s[u] >> 6 / s[4 + u] >> 6."""
    a, m, lo = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([a & 63, (lo & 15) | ((a >> 2) & 48)], dim=1)
    mn = torch.cat([m & 63, (lo >> 4) | ((m >> 2) & 48)], dim=1)
    return sc, mn


def _dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    # 0 d | 2 dmin | 4 scales[12] | 16 qs[128]; 8 sub-blocks of 32 inputs.
    # Input 64c + 32h + j: nibble h of qs[32c + j].  w = (d * sc) * q - (dmin * mn)
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (_f16(b[:, 0:2]) * sc.float()).view(n, 8, 1)
    ml = (_f16(b[:, 2:4]) * mn.float()).view(n, 8, 1)
    q = _fields(b[:, 16:144].reshape(n, 4, 32), 4).reshape(n, 8, 32).float()
    return (dl * q - ml).view(n, 256)


def _dequantize_q5_k(b: torch.Tensor) -> torch.Tensor:
    # 0 d | 2 dmin | 4 scales[12] | 16 qh[32] | 48 qs[128]; 8 sub-blocks of 32 inputs.
    # Low 4 bits as Q4_K (from qs), input 32f + j's fifth bit is bit f of qh[j].
    #                                         w = (d * sc) * q - (dmin * mn)
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (_f16(b[:, 0:2]) * sc.float()).view(n, 8, 1)
    ml = (_f16(b[:, 2:4]) * mn.float()).view(n, 8, 1)
    ql = _fields(b[:, 48:176].reshape(n, 4, 32), 4).reshape(n, 8, 32)
    qh = _fields(b[:, 16:48], 1)  # (n, 8, 32)
    q = (ql | (qh << 4)).float()
    return (dl * q - ml).view(n, 256)


def _dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    # 0 ql[128] | 128 qh[64] | 192 scales[16] int8 | 208 d; 16 sub-blocks of 16 inputs.
    # Input 128h + 64f + p (p < 64): low 4 bits nibble f of ql[64h + p]; input 128h + 32f + j:
    # high 2 bits field f of qh[32h + j].    w = (d * sc) * (q - 32)
    n = b.shape[0]
    sc = b[:, 192:208].contiguous().view(torch.int8).float()
    dl = (_f16(b[:, 208:210]) * sc).view(n, 16, 1)
    ql = _fields(b[:, 0:128].reshape(n, 2, 64), 4).reshape(n, 256)
    qh = _fields(b[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 256)
    q = (ql | (qh << 4)).float() - 32
    return (dl * q.view(n, 16, 16)).view(n, 256)


def _iq4_values(q: torch.Tensor) -> torch.Tensor:
    """4-bit indices -> their IQ4 table values, fp32 (exact)."""
    return torch.tensor(IQ4_VALUES, dtype=torch.float32, device=q.device)[q.long()]


def _dequantize_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    # 0 d | 2 qs[16]: input j byte j's low nibble, j + 16 its high one.  w = d * v[q]
    return _f16(b[:, 0:2]) * _iq4_values(_nibbles32(b[:, 2:18]))


def _dequantize_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    # 0 d | 2 scales_h (uint16) | 4 scales_l[4] | 8 qs[128]; 8 sub-blocks of 32 inputs.
    # Sub-block s: ls = nibble s % 2 of scales_l[s // 2] | bits 2s, 2s + 1 of scales_h << 4;
    # its inputs as an IQ4_NL block's from qs[16s : 16s + 16].  w = (d * (ls - 32)) * v[q]
    n = b.shape[0]
    sh = b[:, 2:4].long()
    sh = sh[:, 0] | sh[:, 1] << 8  # (n,)
    shifts = torch.arange(0, 16, 2, device=b.device)
    lo = _fields(b[:, 4:8], 4).transpose(1, 2).reshape(n, 8).long()  # (n, 8) low nibbles
    ls = lo | ((sh[:, None] >> shifts) & 3) << 4
    dl = (_f16(b[:, 0:2]) * (ls - 32).float()).view(n, 8, 1)
    q = _nibbles32(b[:, 8:136].reshape(n * 8, 16)).view(n, 8, 32)
    return (dl * _iq4_values(q)).view(n, 256)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes e (uint8) -> 2^(e - 128) fp32, gguf-py's e8m0_to_fp32_half (llama.cpp's
    ggml_e8m0_to_fp32_half) bit for bit: e = 0, 1 the subnormals 2^-128, 2^-127; e = 255 is
    2^127, not the OCP spec's NaN."""
    e = e.int()
    return torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)


def _dequantize_mxfp4(b: torch.Tensor) -> torch.Tensor:
    # 0 e | 1 qs[16]: input j byte j's low nibble, j + 16 its high one (IQ4_NL's order).
    # w = 2^(e - 128) * v[q]: a power of two times a small integer, exact, or inf where it
    # overflows (from e = 253 for |v| = 12), as gguf-py's
    v = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=b.device)
    return _e8m0_half(b[:, 0:1]) * v[_nibbles32(b[:, 1:17]).long()]


_DEQUANTIZE = {name: globals()[f"_dequantize_{name}"] for name in TYPES}


def mxfp4_from_ocp(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedTensor:
    """OpenAI's MXFP4 (gpt-oss's safetensors, OCP microscaling: blocks (out, G, 16) uint8,
    byte j holding inputs 2j (low nibble) and 2j + 1; scales (out, G) uint8 E8M0 exponents
    e, w = E2M1[q] * 2^(e - 127)) -> GGML MXFP4 rows (out, G * 17), losslessly: the same
    codes (MXFP4_VALUES is E2M1 doubled, its scale 2^(e - 128) halved) and exponents, only
    the nibbles move to GGML's order (input j low, j + 16 high) behind each block's e."""
    out, G, _ = blocks.shape
    assert blocks.dtype == scales.dtype == torch.uint8 and tuple(scales.shape) == (out, G)
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).view(out, G, 32)  # inputs in order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    rows = weight_buffer((out, G * 17), torch.uint8)
    rows.view(out, G, 17)[..., 0] = scales
    rows.view(out, G, 17)[..., 1:] = qs
    return QuantizedTensor("mxfp4", rows, None, None, G * 32)
