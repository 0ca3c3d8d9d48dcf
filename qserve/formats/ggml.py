"""GGML quantization blocks: the layouts of a GGUF tensor's rows, and their pure-torch
dequantization, bit-exact with `gguf.quants.dequantize` (tests/test_ggml_formats.py).

A row of `in` inputs is in / block consecutive blocks of block_bytes bytes (little-endian).
Q4_0 / Q4_1 / Q8_0 have an exact qserve scheme and are repacked at load (`repack`); the other
types run in place: their kernels read these bytes as the file has them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qserve.formats.qtensor import QuantizedTensor, pack_int4


@dataclass(frozen=True)
class GGMLType:
    type_id: int  # GGMLQuantizationType value
    block: int  # inputs per block
    block_bytes: int


TYPES = {
    "q4_0": GGMLType(2, 32, 18), "q4_1": GGMLType(3, 32, 20),
    "q5_0": GGMLType(6, 32, 22), "q5_1": GGMLType(7, 32, 24),
    "q8_0": GGMLType(8, 32, 34),
    "q2_k": GGMLType(10, 256, 84), "q3_k": GGMLType(11, 256, 110),
    "q4_k": GGMLType(12, 256, 144), "q5_k": GGMLType(13, 256, 176),
    "q6_k": GGMLType(14, 256, 210),
}
REPACKED = {"q4_0": "int4", "q4_1": "int4", "q8_0": "int8"}  # GGML type -> qserve format
IN_PLACE = ("q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")


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


# ---- per-type dequantization (n, block_bytes) uint8 -> (n, block) fp32 ----------------------
def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 little-endian fp16 -> (n, 1) fp32."""
    return b.contiguous().view(torch.float16).float()


def _not_yet(blocks: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError


_DEQUANTIZE = {name: _not_yet for name in TYPES}
