"""What a load costs in memory: every tensor read once, the load's freed temporaries handed
back, and the random Q4_K_M files scripts/make_shaped_model.py --direct writes for measuring it
at 8B size (llama-quantize's type mix, finite blocks, loadable)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from qserve.loader import gguf_loader, load_model
from qserve.loader.weights import LazyWeights, trim_heap
from qserve.models.build import build_model

REPO = Path(__file__).resolve().parent.parent


def test_build_reads_every_tensor_once(default_model_path, monkeypatch):
    """Building a model looks each weight up once; `name in weights` must not read it (the
    Mapping default does: it doubled a load's reads and its freed temporaries)."""
    loaded = load_model(default_model_path)
    assert isinstance(loaded.weights, LazyWeights)
    reads: list[str] = []
    real = gguf_loader.read_tensor

    def counting(gguf, name, *a, **k):
        reads.append(name)
        return real(gguf, name, *a, **k)

    sliced: dict[str, list[tuple[int, int]]] = {}  # matrices read by row slices
    real_rows = gguf_loader.tensor_rows

    def row_counting(gguf, name, *a, **k):
        read = real_rows(gguf, name, *a, **k)
        if read is None:
            return None

        def rows(r0, r1):
            sliced.setdefault(name, []).append((r0, r1))
            return read(r0, r1)
        return rows

    monkeypatch.setattr(gguf_loader, "read_tensor", counting)
    monkeypatch.setattr(gguf_loader, "tensor_rows", row_counting)
    assert "model.norm.weight" in loaded.weights and "no.such.weight" not in loaded.weights
    assert reads == []
    build_model(loaded.arch, loaded.weights, 64)
    assert any(len(spans) > 1 for spans in sliced.values()), (
        "no matrix was read in slices (the embedding and the MLP have over 256 rows)")
    reads += list(sliced)
    assert sorted(reads) == sorted(set(reads)) and len(reads) == len(loaded.weights)
    hf = gguf_loader.hf_names(loaded.arch)
    for name, spans in sliced.items():  # each row once, in order
        rows = loaded.weights.shapes[hf[name]][0]
        assert [r0 for r0, _ in spans] == [0] + [r1 for _, r1 in spans[:-1]], name
        assert spans[-1][1] == rows, name


def test_row_slices_reuse_one_buffer_and_never_trim(default_model_path, monkeypatch):
    """Whole tensors trim the heap before each read (their file copies and re-layouts are
    freed); row slices never do: a matrix's slices are read into one buffer and laid out in
    place, so nothing is freed between them. (Trimming every 64 MiB of slices once that held
    changed the peak by under 2 MiB on 1B and 8B-4L Q4_K_M; a trim walks the whole heap, and
    one before every slice had loaded the full 8B shape in 42 s against 11.5.)"""
    from qserve.loader import weights as lw

    loaded = load_model(default_model_path)
    weights = loaded.weights
    trims = []
    buffers: dict[str, set[int]] = {}  # GGUF name -> addresses its slices were read into
    real = gguf_loader.GGUFFile.read_rows

    def read_rows(self, name, r0, r1, out=None):
        buffers.setdefault(name, set()).add(None if out is None else out.data_ptr())
        return real(self, name, r0, r1, out)

    monkeypatch.setattr(lw, "trim_heap", lambda: trims.append(1))
    monkeypatch.setattr(gguf_loader.GGUFFile, "read_rows", read_rows)
    build_model(loaded.arch, weights, 64)
    sliced = [n for n in weights if weights.row_reader(n) is not None]
    assert len(buffers) == len(sliced) and all(len(b) == 1 and None not in b
                                               for b in buffers.values()), buffers
    assert len(trims) == len(weights) - len(sliced)


def test_sliced_load_gives_the_same_model(default_model_path):
    """A model built from matrices read and laid out 256 rows at a time (the default) holds
    exactly the buffers of one built from whole-read matrices."""
    loaded = load_model(default_model_path)
    whole = LazyWeights(loaded.weights.shapes, loaded.weights._read)  # no row reader
    a = build_model(loaded.arch, loaded.weights, 64).state_dict()
    b = build_model(loaded.arch, whole, 64).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_laid_out_stacks_slices_in_place_as_the_reference():
    """QuantLinear.laid_out over parts read by readers that reuse one buffer (as a GGUF's do):
    alike neighbours share one output, each slice laid out straight into its place, and the
    segments are the torch reference's layout (ggml.interleave) of the parts stacked whole; a
    part of a row count off the 16-row groups stays in the file's layout, on its own."""
    from qserve.formats import QuantizedTensor, ggml
    from qserve.formats.qtensor import cat_quantized
    from qserve.kernels import cpu_ops
    from qserve.layers.quant_linear import QuantLinear

    g = torch.Generator().manual_seed(0)

    def part(fmt: str, rows: int) -> QuantizedTensor:
        width = 768 // 256 * ggml.TYPES[fmt].block_bytes
        return QuantizedTensor(fmt, torch.randint(0, 256, (rows, width), dtype=torch.uint8,
                                                  generator=g), None, None, 768)

    def reader(qt: QuantizedTensor):
        buf = torch.empty_like(qt.qweight)

        def read(r0, r1):  # every slice in one buffer, valid until the next read
            buf[:r1 - r0] = qt.qweight[r0:r1]
            return QuantizedTensor(qt.format, buf[:r1 - r0], None, None, qt.in_features)
        return read

    parts = [part("q4_k", 1040), part("q4_k", 2064), part("q6_k", 48), part("q4_k", 1041)]
    cpu = torch.device("cpu")
    got = QuantLinear.laid_out([(p.shape[0], reader(p)) for p in parts], cpu)
    groups = [parts[:2], parts[2:3], parts[3:]]
    assert len(got) == len(groups)
    for seg, group in zip(got, groups):
        whole = cat_quantized(group)
        want = whole if cpu_ops.layout_format(whole) == whole.format else ggml.interleave(whole)
        assert seg.format == want.format and torch.equal(seg.qweight, want.qweight)
    assert got[2].format == "q4_k"  # 1041 rows: read whole, in the file's layout


def _rss_kib() -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status")
                if line.startswith("VmRSS"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_trim_heap_returns_freed_holes():
    """Small blocks freed between live ones stay resident until trimmed (glibc)."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size = 64 << 10  # under glibc's mmap threshold: from the heap
    blocks = [libc.malloc(size) for _ in range(1600)]  # 100 MiB
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks[:-1]:  # the last one pins the heap's top: nothing trims by itself
        libc.free(b)
    before = _rss_kib()
    trim_heap()
    freed = before - _rss_kib()
    libc.free(blocks[-1])
    assert freed > 50 << 10, f"trim_heap gave back {freed} KiB of ~100 MiB freed"


# ---- scripts/make_shaped_model.py --direct -------------------------------------------------
@pytest.fixture(scope="module")
def shaped():
    sys.path.insert(0, str(REPO / "scripts"))
    import make_shaped_model

    return make_shaped_model


def test_q4_k_m_type_mix_is_llama_quantizes(shaped):
    """llama-quant.cpp's use_more_bits over 32 layers: Q6_K attn_v / ffn_down in layers 0-3,
    28-31 and every third from 6 (16 of 32, as in Llama-3.1-8B-Instruct-Q4_K_M.gguf)."""
    more = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}
    for name in ("attn_v", "ffn_down"):
        assert {i for i in range(32) if shaped.q4_k_m_type(name, i, 32, False) == "Q6_K"} == more
    for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
        assert {shaped.q4_k_m_type(name, i, 32, False) for i in range(32)} == {"Q4_K"}
    assert shaped.q4_k_m_type("output", None, 32, False) == "Q6_K"
    assert shaped.q4_k_m_type("token_embd", None, 32, False) == "Q4_K"
    assert shaped.q4_k_m_type("token_embd", None, 16, True) == "Q6_K"  # tied: the output's
    # 16 layers: the attn_v types of llama-quantize's own Q4_K_M of the 1B shape
    assert "".join(shaped.q4_k_m_type("attn_v", i, 16, True)[1] for i in range(16)) == (
        "6644644644644666")


def test_direct_q4_k_m_file_loads(shaped, tmp_path, default_model_path):
    """A small Llama written directly: llama-quantize's types, finite N(0, 0.02)-sized blocks,
    the default tokenizer padded to the asked vocabulary, and qserve runs it."""
    fields = shaped.PRESETS["llama-3.1-8b"] | dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, num_hidden_layers=8)
    vocab = 49152 + 300
    out = tmp_path / "tiny-Q4_K_M.gguf"
    shaped.write_direct("llama-3.1-8b", None, out, seed=1, fields=fields, vocab=vocab)
    reader = GGUFReader(out)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    q6 = {i for i in range(8) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"}
    assert q6 == {0, 3, 6, 7} and types["output.weight"] == "Q6_K"
    assert types["token_embd.weight"] == "Q4_K" and types["blk.5.attn_norm.weight"] == "F32"
    for t in reader.tensors:
        w = np.asarray(t.data)
        if t.tensor_type.name != "F32":
            w = dequantize(w[:64], t.tensor_type)
        assert np.isfinite(w).all(), t.name
        if t.name.startswith("blk.") and w.ndim == 2:
            assert 0.015 < w.std() < 0.03, (t.name, w.std())
    loaded = load_model(out)
    assert loaded.arch.vocab_size == vocab and loaded.arch.num_layers == 8
    assert loaded.arch.rope_scaling["rope_type"] == "llama3"
    assert len(loaded.tokenizer.encode("The quick brown fox")) > 1
    model = build_model(loaded.arch, loaded.weights, 64)
    ids = torch.tensor(loaded.tokenizer.encode("The quick brown fox"))
    from qserve.models.build import prefill

    hidden = prefill(model, ids.tolist())
    assert torch.isfinite(model.compute_logits(hidden[-1:])).all()
