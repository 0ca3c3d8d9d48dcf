"""Lossless import of GGUF Q4_0 / Q4_1 / Q8_0 blocks into qserve's packed format.

A block covers 32 consecutive inputs of one row (ggml's layout, little-endian):

    Q4_0  d fp16 | qs 16 B          w = d * (q - 8)     -> int4 g32 symmetric, scale d
    Q4_1  d fp16 | m fp16 | qs 16 B w = d * q + m       -> int4 g32 asymmetric, scale d, offset m
    Q8_0  d fp16 | qs 32 x int8     w = d * q           -> int8 g32, scale d

In a Q4 block byte j holds input j in its low nibble and input j + 16 in its high nibble; qserve
pairs inputs 2j, 2j + 1 in a byte, so only the nibbles move. Codes, scales and offsets are the
file's own, never re-rounded, and qserve dequantizes with the same fp32 arithmetic as gguf-py,
so every value comes out bit for bit as `gguf.quants.dequantize` gives it.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from qserve.quant.schemes import QuantizedTensor, pack_int4

IMPORTABLE = {QT.Q4_0: 18, QT.Q4_1: 20, QT.Q8_0: 34}  # type -> bytes per block of 32
SCHEME_NAMES = {QT.Q4_0: "int4 g32 sym", QT.Q4_1: "int4 g32 asym", QT.Q8_0: "int8 g32 sym"}


def import_blocks(raw: np.ndarray, ggml_type: QT, in_features: int) -> QuantizedTensor:
    """raw: (out, in / 32 * block_bytes) uint8 rows of one tensor -> the packed matrix."""
    nbytes = IMPORTABLE[ggml_type]
    out = raw.shape[0]
    blocks = torch.from_numpy(np.array(raw).reshape(out, in_features // 32, nbytes))
    scales = blocks[..., 0:2].contiguous().view(torch.float16).view(out, -1)  # (out, G)
    if ggml_type == QT.Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).reshape(out, in_features)
        return QuantizedTensor(q, scales, None, in_features)
    offsets = None
    if ggml_type == QT.Q4_1:
        offsets = blocks[..., 2:4].contiguous().view(torch.float16).view(out, -1)
    qs = blocks[..., nbytes - 16:]  # (out, G, 16)
    q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(out, in_features)  # inputs in order
    return QuantizedTensor(pack_int4(q), scales, offsets, in_features)


def unpermute_packed(qt: QuantizedTensor, n_head: int) -> QuantizedTensor:
    """llama.cpp's q/k row order undone on packed rows (see gguf_loader._unpermute)."""
    from qserve.loader.gguf_loader import _unpermute

    return QuantizedTensor(_unpermute(qt.qweight, n_head), _unpermute(qt.scales, n_head),
                           None if qt.offsets is None else _unpermute(qt.offsets, n_head),
                           qt.in_features)
