"""int4 key codebooks: bit allocation, calibration on the real default model, and the on-disk
cache of calibrated codebooks."""
import pytest
import torch

from qserve.kernels import kv_quant
from qserve.engine import kv_codebook
from qserve.quant.calibration import build_model


def test_allocate_spends_every_bit_where_the_weight_is():
    weight = torch.tensor([[1.0, 100.0, 0.0, 10.0, 1e4, 1e4],
                           [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    bits = kv_codebook.allocate(weight, 24)
    assert bits.sum(-1).tolist() == [24, 24]
    assert int(bits.max()) <= kv_quant.MAX_KEY_WIDTH
    assert bits[0, 2] == 0  # no weight, no bits
    assert bits[1].tolist() == [4] * 6  # equal weights share equally
    # a heavier entry never gets fewer bits
    order = weight[0].argsort()
    assert (bits[0, order].diff() >= 0).all()
    assert bits[0, 4] == bits[0, 5] == kv_quant.MAX_KEY_WIDTH  # capped


def test_codebook_from_energy_gives_rope_pairs_one_width():
    g = torch.Generator().manual_seed(0)
    L, hkv, d = 2, 3, 16
    k2 = torch.rand(L, hkv, d, generator=g) ** 4
    q2 = torch.rand(L, hkv, d, generator=g)
    q2[0, 0, [1, 9]] = 0  # a pair no query reads
    book = kv_codebook.codebook_from_energy(k2, q2)
    w = book["k_width"]
    assert torch.equal(w[..., :d // 2], w[..., d // 2:])
    assert (w.sum(-1) == kv_quant.KEY_BITS * d).all()
    assert w[0, 0, 1] == 0
    torch.testing.assert_close(book["k_sigma"], k2.sqrt())


@pytest.fixture(scope="module")
def small_model(loaded_model):
    return build_model(loaded_model.arch, loaded_model.weights, 256)


@pytest.fixture
def quick_calibration(monkeypatch, tmp_path):
    """One 128-token window (calibration proper reads more), cached under a fresh home."""
    monkeypatch.setattr(kv_codebook, "CALIBRATION_WINDOWS", 1)
    monkeypatch.setattr(kv_codebook, "WINDOW", 128)
    monkeypatch.setenv("QSERVE_HOME", str(tmp_path))
    return tmp_path


def test_calibration_on_the_default_model(small_model, tokenizer, quick_calibration):
    ropes = [layer.self_attn.rope for layer in small_model.layers]
    book = kv_codebook.calibrate(small_model, tokenizer)
    assert [layer.self_attn.rope for layer in small_model.layers] == ropes  # restored
    L, hkv, d = 30, 3, 64
    assert book["k_width"].shape == book["k_sigma"].shape == (L, hkv, d)
    assert (book["k_width"].sum(-1) == kv_quant.KEY_BITS * d).all()
    # Llama keys are far from uniform: some channels get no bits, some the most
    counts = torch.bincount(book["k_width"].flatten(), minlength=9)
    assert counts[0] > 0 and counts[kv_quant.MAX_KEY_WIDTH] > 0 and counts[4] < L * hkv * d


def test_calibration_does_not_depend_on_the_context_length(loaded_model, small_model,
                                                           tokenizer, quick_calibration):
    """An engine built for 64 positions calibrates on the same 128-token windows as one built
    for 256 (the cache key does not hold the context length, so they must agree)."""
    short = build_model(loaded_model.arch, loaded_model.weights, 64)
    a, b = (kv_codebook.calibrate(m, tokenizer) for m in (short, small_model))
    assert all(torch.equal(a[n], b[n]) for n in kv_quant.CODEBOOK)


def _keys_and_queries(model, ids):
    """Post-RoPE (keys (T, hkv, d), queries (T, H, d)) of every layer for one prompt."""
    from qserve.quant.calibration import prefill

    got = []

    class Tap:
        def __init__(self, rope):
            self.rope = rope

        def __call__(self, positions, q, k):
            q, k = self.rope(positions, q, k)
            got.append((k.clone(), q.clone()))
            return q, k

    ropes = [layer.self_attn.rope for layer in model.layers]
    try:
        for layer, rope in zip(model.layers, ropes):
            layer.self_attn.rope = Tap(rope)
        prefill(model, ids)
    finally:
        for layer, rope in zip(model.layers, ropes):
            layer.self_attn.rope = rope
    return got


def test_allocation_beats_uniform_widths_on_attention_scores(small_model, tokenizer,
                                                             quick_calibration):
    """On keys of the eval text (not the calibration text), the calibrated widths give a
    smaller q . k error than 4 bits on every channel with the same sigma."""
    from qserve.eval import default_text

    book = kv_codebook.calibrate(small_model, tokenizer)
    ids = tokenizer.encode(default_text()[:2000], add_special_tokens=False)[:128]
    errs = {"allocated": 0.0, "uniform": 0.0}
    for layer, (k, q) in enumerate(_keys_and_queries(small_model, ids)):
        sigma = book["k_sigma"][layer]
        books = {"allocated": {n: t[layer] for n, t in book.items()},
                 "uniform": kv_quant.key_codebook(sigma, torch.full_like(sigma, 4))}
        g = q.shape[1] // k.shape[1]
        for name, b in books.items():
            kq = kv_quant.dequantize_keys(*kv_quant.quantize_keys(k, **b), **b)
            dk = (kq - k).repeat_interleave(g, 1)  # (T, H, d)
            errs[name] += torch.einsum("thd,shd->hts", q, dk).square().mean().item()
    assert errs["allocated"] < 0.5 * errs["uniform"], errs


def test_codebooks_are_cached_by_weights(small_model, tokenizer, quick_calibration,
                                         monkeypatch):
    book = kv_codebook.for_model(small_model, tokenizer)
    files = list((quick_calibration / "kv-codebooks").iterdir())
    assert len(files) == 1 and files[0].suffix == ".safetensors"

    def no_calibration(*args):
        raise AssertionError("calibrated again")

    with monkeypatch.context() as m:
        m.setattr(kv_codebook, "calibrate", no_calibration)
        again = kv_codebook.for_model(small_model, tokenizer)
    assert all(torch.equal(book[n], again[n]) for n in kv_quant.CODEBOOK)
    # a damaged file is calibrated again and replaced
    files[0].write_bytes(b"not safetensors")
    assert torch.equal(kv_codebook.for_model(small_model, tokenizer)["k_width"],
                       book["k_width"])
    assert files[0].stat().st_size > 100
    # other weights, another fingerprint
    before = kv_codebook.fingerprint(small_model)
    w = small_model.layers[3].self_attn.qkv_proj.weight
    with torch.no_grad():
        w[0, 0] += 1
        changed = kv_codebook.fingerprint(small_model)
        w[0, 0] -= 1
    assert changed != before
