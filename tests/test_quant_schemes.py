"""Weight formats: packing round-trips, quantize/dequantize error bounds per scheme on random
and real weights, fused stacking, padded groups, QuantLinear against F.linear, and the lossless
GGUF import (bit-exact against the gguf package's own dequantization)."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize
from torch.nn import functional as F

from qserve.formats import ggml
from qserve.kernels import cpu_ops
from qserve.layers.quant_linear import QuantLinear
from qserve.formats import QuantizedTensor, pack_int4, unpack_int4
from qserve.formats.qtensor import cat_quantized
from qserve.quant.schemes import WeightScheme, quantize


def import_blocks(raw, qtype, in_features):
    return ggml.repack(qtype.name.lower(), torch.from_numpy(np.array(raw)), in_features)

SCHEMES = [WeightScheme(8, None, True), WeightScheme(8, 32, True),
           WeightScheme(4, 32, False), WeightScheme(4, 64, False), WeightScheme(4, 128, False),
           WeightScheme(4, 32, True), WeightScheme(4, 64, True), WeightScheme(4, 128, True)]


def test_pack_int4_round_trip_and_nibble_order():
    q = torch.randint(0, 16, (7, 130), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (7, 65)
    assert torch.equal(unpack_int4(packed), q)
    assert pack_int4(torch.tensor([[3, 10]], dtype=torch.uint8)).item() == 3 | 10 << 4


def _step(scheme: WeightScheme, qt: QuantizedTensor) -> torch.Tensor:
    """The rounding step of every input column, (out, in): one scale of its group."""
    gs = qt.group_size
    return qt.scales.float().repeat_interleave(gs, dim=1)[:, :qt.in_features]


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
@pytest.mark.parametrize("shape", [(1, 128), (7, 576), (83, 1536)])
def test_round_to_nearest_error_bound(scheme, shape):
    """|w - Q(w)| <= step / 2 (+ fp16 slack: the offset is rounded to fp16, and a scale of
    fp16 precision lets the top of the range land up to ~2^-11 relative off the grid)."""
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 0.1
    w[0, 5] = 0.5  # an outlier within one group
    qt = quantize(w, scheme)
    deq = qt.dequantize()
    assert deq.shape == w.shape and deq.dtype == torch.float32
    bound = _step(scheme, qt) * 0.5 + w.abs().amax() * 2 ** -9
    assert (deq - w).abs().le(bound).all()
    # and it is useful: relative Frobenius error of Gaussian weights, 8 bit << 4 bit
    g = torch.randn(shape)
    rel = ((quantize(g, scheme).dequantize() - g).norm() / g.norm()).item()
    assert rel < (0.01 if scheme.bits == 8 else 0.15)


def test_group_size_not_dividing_pads_the_last_group():
    """576 inputs in groups of 128: 5 groups, the last one 64 real + 64 padding columns
    (copies of the last, so the real ones quantize as in a group of their own)."""
    w = torch.randn(4, 576)
    qt = quantize(w, WeightScheme(4, 128, False))
    assert qt.scales.shape == (4, 5) and qt.qweight.shape == (4, 320) and qt.padded_in == 640
    assert qt.dequantize().shape == (4, 576)
    tail = quantize(w[:, 512:], WeightScheme(4, 64, False))
    assert torch.equal(qt.dequantize()[:, 512:], tail.dequantize())


def test_real_weights_error(loaded_model):
    """On the default model's q_proj (dequantized Q4_1, itself on a 4-bit grid): int8 is near
    lossless, int4 g32 asym close to it, larger groups worse, all bounded."""
    w = loaded_model.weights["model.layers.3.self_attn.q_proj.weight"]
    rel = {}
    for s in SCHEMES:
        rel[str(s)] = ((quantize(w, s).dequantize() - w).norm() / w.norm()).item()
    assert rel["int8 per-channel sym"] < 0.01
    assert rel["int4 g32 asym"] < rel["int4 g128 asym"] < 0.12
    assert all(v < 0.15 for v in rel.values()), rel


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_cat_along_output_is_exact_and_linear_matches(scheme):
    """Fusing q/k/v stacks rows; the fused module computes exactly F.linear with the
    dequantized weights of the parts (on the reference path; the CPU kernels are compared with
    it in tests/test_cpu_ops.py)."""
    parts = [torch.randn(n, 192) for n in (64, 32, 32)]
    qts = [quantize(p, scheme) for p in parts]
    fused = cat_quantized(qts)
    assert torch.equal(fused.dequantize(), torch.cat([q.dequantize() for q in qts]))
    bias = torch.randn(128)
    mod = QuantLinear([fused], bias)
    x = torch.randn(5, 192)
    with cpu_ops.disabled():
        assert torch.equal(mod(x), F.linear(x, fused.dequantize(), bias))
    assert QuantLinear([fused])(x.half()).dtype == torch.float16  # output in x's dtype
    # nothing but the packed tensors (and bias) is resident
    assert {n for n, _ in mod.named_buffers()} <= {"s0_qweight", "s0_scales", "s0_offsets", "bias"}


def test_cat_refuses_mixed_formats():
    a = quantize(torch.randn(4, 64), WeightScheme(4, 32, False))
    b = quantize(torch.randn(4, 64), WeightScheme(4, 32, True))
    with pytest.raises(ValueError):
        cat_quantized([a, b])


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(1, 32), (5, 96), (64, 576)])
def test_gguf_import_is_bit_exact(qtype, shape):
    """Blocks made by the gguf package, imported and dequantized by qserve: every fp32 value
    identical, bit for bit, to gguf.quants.dequantize."""
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    blocks = gguf_quantize(w, qtype)  # (out, in / 32 * block bytes)
    qt = import_blocks(blocks, qtype, shape[1])
    ref = torch.from_numpy(gguf_dequantize(blocks, qtype))
    assert torch.equal(qt.dequantize().view(torch.int32), ref.view(torch.int32))
    assert qt.group_size == 32 and (qt.offsets is not None) == (qtype == QT.Q4_1)
    assert qt.nbytes == blocks.nbytes  # the same bytes, rearranged


def test_gguf_import_default_model_bit_exact(default_model_path):
    """The default model's own Q4_1 and Q8_0 tensors."""
    from qserve.loader.gguf_loader import GGUFFile

    gguf = GGUFFile(default_model_path)
    for name in ("blk.0.attn_k.weight", "blk.29.ffn_down.weight", "token_embd.weight"):
        info, raw = gguf.blocks(name)
        assert info.ggml_type in (QT.Q4_1, QT.Q8_0)
        qt = import_blocks(raw, info.ggml_type, info.shape[-1])
        ref = torch.from_numpy(gguf_dequantize(raw, info.ggml_type))
        assert torch.equal(qt.dequantize().view(torch.int32), ref.view(torch.int32)), name


@pytest.mark.parametrize("scheme", [WeightScheme(8, 32, True), WeightScheme(4, 64, False)], ids=str)
def test_quant_embedding_lookup_and_tied_logits(scheme, monkeypatch):
    from qserve.layers.quant_linear import QuantEmbedding

    table = quantize(torch.randn(1000, 96), scheme)
    emb = QuantEmbedding(table, torch.float32)
    monkeypatch.setattr(QuantEmbedding, "ROWS_PER_SLICE", 300)  # 4 slices, the last short
    ids = torch.tensor([0, 999, 5, 5])
    assert torch.equal(emb(ids), table.dequantize()[ids])
    h = torch.randn(3, 96)
    # slicing the vocabulary changes no dot product, only which call computes it; allow for a
    # BLAS that blocks the reduction differently for different output widths
    with cpu_ops.disabled():
        torch.testing.assert_close(emb.logits(h), h @ table.dequantize().T, rtol=1e-6,
                                   atol=1e-5)
    assert {n for n, _ in emb.named_buffers()} <= {"qweight", "scales", "offsets"}
