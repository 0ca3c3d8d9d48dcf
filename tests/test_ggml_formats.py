"""GGML block dequantization (qserve/formats/ggml.py) bit for bit against gguf-py's
`gguf.quants.dequantize`, for every type qserve reads: in place through the format registry,
block by block, and (Q4_0 / Q4_1 / Q8_0) through the lossless repack to int4/int8.

Blocks are random bytes (every code and sub-block scale pattern occurs), except the fp16
super-scales (and MXFP4's E8M0 exponents), drawn as finite values of a checkpoint's magnitude
so that no NaN/inf appears (NaN != NaN would hide a mismatch); MXFP4's every exponent has a
test of its own.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from qserve.formats import QuantizedTensor, ggml


def gguf_dequantize(name: str, rows: torch.Tensor) -> torch.Tensor:
    """gguf-py's (out, in) fp32 for GGUF rows of type `name`."""
    w = quants.dequantize(rows.numpy(), GGMLQuantizationType[name.upper()])
    assert w.dtype == np.float32
    return torch.from_numpy(w)


CASES = [(name, out, n_blocks) for name in ggml.TYPES
         for out, n_blocks in ((1, 3), (7, 5), (83, 1))]


@pytest.mark.parametrize("name,out,n_blocks", CASES)
def test_dequantize_matches_gguf(name, out, n_blocks):
    in_features = n_blocks * ggml.TYPES[name].block
    rows = ggml.random_rows(name, out, in_features,
                           torch.Generator().manual_seed(out * 10 + n_blocks))
    ref = gguf_dequantize(name, rows)
    assert ref.shape == (out, in_features) and torch.isfinite(ref).all()

    blocks = rows.view(-1, ggml.TYPES[name].block_bytes)
    assert torch.equal(ggml.dequantize_blocks(name, blocks).view(out, in_features), ref)
    if name in ggml.IN_PLACE:
        qt = QuantizedTensor(name, rows, None, None, in_features)
        assert qt.validate() is None
        w = qt.dequantize()
        assert w.dtype == torch.float32 and torch.equal(w, ref)
    else:
        qt = ggml.repack(name, rows, in_features)
        assert qt.format == ggml.REPACKED[name] and qt.validate() is None
        assert torch.equal(qt.dequantize(), ref)


def test_mxfp4_every_exponent_matches_gguf():
    """MXFP4's E8M0 scale byte e over all 256 values, gguf-py's edges included (llama.cpp's
    ggml_e8m0_to_fp32_half builds the same bits): e = 0 and 1 scale by the subnormals 2^-128
    and 2^-127, e = 255 by 2^127 (not the OCP spec's NaN), so from e = 253 on a code of 12
    overflows to inf, in gguf-py as here. Compared as bits: subnormals and infinities too (no
    NaN can arise, since no value is inf times 0)."""
    g = torch.Generator().manual_seed(39)
    blocks = torch.randint(0, 256, (4 * 256, 17), dtype=torch.uint8, generator=g)
    blocks[:, 0] = torch.arange(256, dtype=torch.uint8).repeat(4)
    with np.errstate(over="ignore"):  # gguf-py's own overflow to inf
        ref = gguf_dequantize("mxfp4", blocks)  # (1024, 32)
    tiny = torch.finfo(torch.float32).tiny
    assert ref.isinf().any() and ((ref != 0) & (ref.abs() < tiny)).any()
    assert not ref.isnan().any()
    got = ggml.dequantize_blocks("mxfp4", blocks)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


def test_dequantize_reads_a_strided_view():
    """Every other row of a matrix (a non-contiguous view) dequantizes the same."""
    rows = ggml.random_rows("q4_k", 12, 512, torch.Generator().manual_seed(3))
    part = rows[1::2]
    assert torch.equal(QuantizedTensor("q4_k", part, None, None, 512).dequantize(),
                       gguf_dequantize("q4_k", part.contiguous()))


@pytest.mark.parametrize("name", ggml.IN_PLACE)
def test_validate_reports_a_wrong_row_width(name):
    t = ggml.TYPES[name]
    rows = ggml.random_rows(name, 3, 2 * t.block, torch.Generator().manual_seed(0))
    assert QuantizedTensor(name, rows, None, None, 2 * t.block).validate() is None
    msg = QuantizedTensor(name, rows[:, :-1], None, None, 2 * t.block).validate()
    assert msg is not None and str(2 * t.block_bytes) in msg
    msg = QuantizedTensor(name, rows, None, None, 2 * t.block + 1).validate()
    assert msg is not None and str(t.block) in msg


def test_type_table_matches_gguf():
    """The loader reads headers without the gguf package: its table of every GGML type's name
    and block geometry must agree with gguf-py's."""
    import gguf

    for qtype in gguf.GGMLQuantizationType:
        assert ggml.ALL_TYPES[qtype.value] == (qtype.name, *gguf.GGML_QUANT_SIZES[qtype])
        assert ggml.GGMLTypeId(qtype.value).name == qtype.name and ggml.GGMLTypeId(qtype.value) == qtype
