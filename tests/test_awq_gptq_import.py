"""AWQ (AutoAWQ GEMM) and GPTQ (AutoGPTQ / GPTQModel, v1 and v2 zeros) checkpoints imported
into qserve's int4 (symmetric GPTQ) and int4z (integer zero points) without re-rounding: the
dequantized weights equal (q - z) * s of the file exactly.

The checkpoints are written here by packers of our own, from the layouts the projects document
(AutoAWQ's WQLinear_GEMM: outputs packed 8 to an int32 in the order 0 2 4 6 1 3 5 7; GPTQ:
inputs packed 8 to an int32 in order, zeros packed along outputs and stored minus one in the v1
format). The intended weights are (q - z) * s of the codes, zeros and scales we chose.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from qserve import LLM, SamplingParams
from qserve.errors import ModelLoadError
from qserve.formats import QuantizedTensor, unpack_int4
from qserve.loader import load_model

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: output column packed at nibble i
VOCAB = 96


def pack_words(q: np.ndarray, order=range(8)) -> np.ndarray:
    """(rows, 8n) codes 0..15 -> (rows, n) int32: word c's nibble i holds column
    8c + order[i]."""
    rows, cols = q.shape
    words = np.zeros((rows, cols // 8), dtype=np.uint32)
    for i, col in enumerate(order):
        words |= q[:, col::8].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def awq_tensors(q, z, s) -> dict[str, torch.Tensor]:
    """codes q (out, in), zeros z (out, G), scales s (out, G) fp16 -> AutoAWQ GEMM tensors."""
    return {"qweight": torch.from_numpy(pack_words(q.T.copy(), AWQ_PACK_ORDER)),
            "qzeros": torch.from_numpy(pack_words(z.T.copy(), AWQ_PACK_ORDER)),
            "scales": s.t().contiguous()}


def gptq_tensors(q, z, s, v1: bool, g_idx=None) -> dict[str, torch.Tensor]:
    """-> GPTQ tensors: qweight (in / 8, out) inputs packed in order, zeros - 1 in v1."""
    n_in, G = q.shape[1], z.shape[1]
    stored = (z - 1) if v1 else z
    assert stored.min() >= 0  # v1 cannot store a zero of 0 (AutoGPTQ's packing overflows)
    g_idx = torch.arange(n_in, dtype=torch.int32) // (n_in // G) if g_idx is None else g_idx
    return {"qweight": torch.from_numpy(pack_words(q.copy()).T.copy()),  # (out, in/8)->(in/8, out)
            "qzeros": torch.from_numpy(pack_words(stored.T.copy())),
            "scales": s.t().contiguous(), "g_idx": g_idx}


def random_quant(out: int, n_in: int, gs: int, sym: bool, v1: bool, rng):
    """codes (out, in), zeros (out, G), fp16 scales (out, G) with random 11-bit mantissas.
    Zeros 0..15, or 1..16 in v1 (stored minus one in 4 bits: 16 is AutoGPTQ's overflowed -1)."""
    G = n_in // gs
    q = rng.integers(0, 16, (out, n_in), dtype=np.uint8)
    lo = 1 if v1 else 0
    z = (np.full((out, G), 8, np.uint8) if sym
         else rng.integers(lo, 16 + lo, (out, G), dtype=np.uint8))
    s = (torch.rand(out, G, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30))))
         * 0.02 + 0.001).half()
    return q, z, s


def intended(q, z, s, g_idx=None) -> torch.Tensor:
    """(q - z) * s in float64, each input with its group's zero and scale."""
    n_in = q.shape[1]
    g = (torch.arange(n_in) // (n_in // z.shape[1])) if g_idx is None else g_idx.long()
    zz, ss = torch.from_numpy(z.astype(np.int64))[:, g], s.double()[:, g]
    return (torch.from_numpy(q.astype(np.int64)) - zz).double() * ss


def write_checkpoint(path: Path, model, quant: dict, pack, packs=None) -> dict[str, tuple]:
    """Save `model`'s config and dense tensors, every decoder linear (a 2-D `*_proj.weight`,
    or what `packs(name)` accepts) replaced by pack(name, weight) -> (tensors, intended
    weight). Returns name -> (q, z, s) per linear."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    model.save_pretrained(path)
    sd = {}  # as saved: transformers writes a mixture's experts one by one
    for f in path.glob("*.safetensors"):
        sd |= load_file(f)
    chosen, tensors = {}, {}
    for name, w in sd.items():
        if ".layers." in name and w.dim() == 2 and (
                packs(name) if packs else name.endswith("_proj.weight")):
            base = name.removesuffix(".weight")
            packed, qzs = pack(base, w)
            tensors |= {f"{base}.{k}": v for k, v in packed.items()}
            chosen[base] = qzs
        else:
            tensors[name] = w.contiguous()
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return chosen


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False, initializer_range=0.1)
    return LlamaForCausalLM(cfg).eval()


CASES = {  # name -> (quantization_config, sym, v1)
    "awq": ({"quant_method": "awq", "bits": 4, "version": "gemm", "zero_point": True}, False, False),
    "gptq-sym-v1": ({"quant_method": "gptq", "bits": 4, "sym": True, "desc_act": False,
                     "checkpoint_format": "gptq"}, True, True),
    "gptq-asym-v1": ({"quant_method": "gptq", "bits": 4, "sym": False, "desc_act": False},
                     False, True),
    "gptq-asym-v2": ({"quant_method": "gptq", "bits": 4, "sym": False, "desc_act": False,
                      "checkpoint_format": "gptq_v2"}, False, False),
    "gptq-sym-v2": ({"quant_method": "gptq", "bits": 4, "sym": True, "desc_act": True,
                     "format": "gptq_v2"}, True, False),  # desc_act with a trivial g_idx
}


def make(path: Path, case: str, gs: int, seed: int = 0):
    quant, sym, v1 = CASES[case]
    rng = np.random.default_rng(seed)
    method = quant["quant_method"]

    def pack(base, w):
        q, z, s = random_quant(*w.shape, gs, sym, v1, rng)
        t = awq_tensors(q, z, s) if method == "awq" else gptq_tensors(q, z, s, v1)
        return t, (q, z, s)
    return write_checkpoint(path, tiny_llama(seed), quant | {"group_size": gs}, pack)


def assert_as_stored(qt: QuantizedTensor, q, z, s, sym: bool, gs: int) -> None:
    """qt holds the codes q, scales s and (int4z) zero points z bit for bit: symmetric GPTQ
    as int4, w = (q - 8) * s (qserve's symmetric layout), the rest as int4z."""
    assert qt.format == ("int4" if sym else "int4z") and qt.group_size == gs, qt.format
    assert torch.equal(unpack_int4(qt.qweight), torch.from_numpy(q))
    assert torch.equal(qt.scales.view(torch.int16), s.view(torch.int16))
    if sym:
        assert qt.offsets is None
    else:
        assert qt.offsets.dtype == torch.uint8 and torch.equal(qt.offsets, torch.from_numpy(z))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_dequantized_weights_equal_the_intended(case, gs, tmp_path):
    chosen = make(tmp_path, case, gs)
    loaded = load_model(tmp_path)
    for base, (q, z, s) in chosen.items():
        qt = loaded.weights[base + ".weight"]
        assert_as_stored(qt, q, z, s, CASES[case][1], gs)
        # (q - z) * s exactly: fp32 holds each product of a 5-bit integer and an fp16 scale
        assert torch.equal(qt.dequantize().double(), intended(q, z, s)), base


def _packed_bytes(weights) -> dict[str, dict[str, int]]:
    """format -> {"tensors", "bytes"} of the QuantizedTensors among weights, as held."""
    out: dict[str, dict[str, int]] = {}
    for w in weights.values():
        if isinstance(w, QuantizedTensor):
            row = out.setdefault(w.format, {"tensors": 0, "bytes": 0})
            row["tensors"] += 1
            row["bytes"] += w.nbytes
    return out


@pytest.mark.parametrize("case", ["awq", "gptq-asym-v1", "gptq-sym-v2"])
def test_planner_counts_the_imported_linears_as_held(case, tmp_path):
    """The memory planner (and `qserve info`) counts each packed linear from the headers alone
    as the importer will hold it: int4 / int4z codes, fp16 scales, uint8 zero points."""
    from qserve.engine.memory_plan import resident_weights

    make(tmp_path, case, 64)
    loaded = load_model(tmp_path)
    held = _packed_bytes(loaded.weights)
    assert list(held) == ["int4" if CASES[case][1] else "int4z"]
    planned = resident_weights(tmp_path, loaded.arch, torch.float32, native=True)
    assert {f: planned[f] for f in held} == held


@pytest.mark.parametrize("case", ["awq", "gptq-asym-v1"])
def test_int4z_round_trips_through_a_qserve_checkpoint(case, tmp_path):
    """The imported weights saved as a qserve checkpoint (int4z linears, their uint8 zero
    points stored as `<name>.offsets`) load back bit for bit, and the planner counts them
    as held."""
    from qserve.engine.memory_plan import resident_weights
    from qserve.loader.checkpoint import save_checkpoint

    make(tmp_path / "src", case, 32)
    loaded = load_model(tmp_path / "src")
    weights = dict(loaded.weights)
    layers = {n.removesuffix(".weight"): {"format": "int4z", "bits": 4, "group_size": 32,
                                          "symmetric": False}
              for n, w in weights.items() if isinstance(w, QuantizedTensor)}
    save_checkpoint(tmp_path / "ckpt", loaded.arch, loaded.tokenizer, weights,
                    {"layers": layers})
    back = load_model(tmp_path / "ckpt")
    assert back.source_format == "qserve" and back.weights.keys() == weights.keys()
    for name, w in weights.items():
        got = back.weights[name]
        if isinstance(w, QuantizedTensor):
            assert got.format == "int4z" and got.offsets.dtype == torch.uint8, name
            assert all(torch.equal(a, b) for a, b in zip(got.tensors().values(),
                                                          w.tensors().values())), name
        else:
            assert torch.equal(got.float(), w.float()), name
    planned = resident_weights(tmp_path / "ckpt", loaded.arch, torch.float32, native=True)
    assert planned["int4z"] == _packed_bytes(weights)["int4z"]


def invoke(*args: str):
    """The qserve CLI, in process."""
    from click.testing import CliRunner

    from qserve import cli

    return CliRunner().invoke(cli.main, list(args))


def assert_user_error(result, *needles: str) -> None:
    """Exit 2 with one line, `error: ...`, holding every needle."""
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), \
        result.output
    assert all(n in lines[0] for n in needles), lines[0]


@pytest.mark.parametrize("case", ["awq", "gptq-asym-v1", "gptq-sym-v1"])
def test_quantize_copies_an_import_into_a_checkpoint_bit_for_bit(case, tmp_path):
    """`qserve quantize AWQ_DIR -o OUT` (no recipe) writes the file's own codes, scales and
    zero points (GPTQ v1's zero of 16 included) into a qserve checkpoint, and copying that
    checkpoint again keeps them: each layers entry names its tensor's format, int4z or int4
    (taken from the bits, an int4z entry said int4 and the copy failed validation on load)."""
    src, ckpt, again = tmp_path / "src", tmp_path / "ckpt", tmp_path / "again"
    chosen = make(src, case, 32)
    _, sym, _ = CASES[case]
    fmt = "int4" if sym else "int4z"
    r = invoke("quantize", str(src), "-o", str(ckpt), "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output.strip().splitlines()[-1])
    assert summary["recipe"] == CASES[case][0]["quant_method"] + "-import"
    copied = {row["name"]: row["scheme"] for row in summary["layers"] if row["note"] == "copied"}
    assert copied == {base: f"{fmt} g32 {'sym' if sym else 'asym'}" for base in chosen}
    r = invoke("quantize", str(ckpt), "-o", str(again))
    assert r.exit_code == 0, r.output
    source = load_model(src).weights
    for path in (ckpt, again):
        layers = json.loads((path / "config.json").read_text())["quantization_config"]["layers"]
        assert layers == {base: {"format": fmt, "bits": 4, "group_size": 32, "symmetric": sym}
                          for base in chosen}
        weights = load_model(path).weights
        assert weights.keys() == source.keys()
        for name, w in weights.items():
            base = name.removesuffix(".weight")
            if base in chosen:
                assert_as_stored(w, *chosen[base], sym, 32)
            else:
                assert torch.equal(w, source[name]), name


def test_quantize_refuses_to_round_an_import_again(tmp_path):
    """A recipe (or calibration text) for an already-quantized source is one line, and nothing
    is written; only the copy (no --recipe) applies."""
    src, ckpt = tmp_path / "src", tmp_path / "ckpt"
    make(src, "awq", 64)
    assert_user_error(invoke("quantize", str(src), "-o", str(tmp_path / "a"), "-r", "w4g64"),
                      f"{src} is already a quantized AWQ checkpoint", "pass no --recipe")
    assert_user_error(invoke("quantize", str(src), "-o", str(tmp_path / "a"),
                             "--calib-text", str(src / "config.json")),
                      "--calib-text applies to AWQ recipes", "copied as stored")
    assert invoke("quantize", str(src), "-o", str(ckpt)).exit_code == 0
    assert_user_error(invoke("quantize", str(ckpt), "-o", str(tmp_path / "a"), "-r", "w4g64"),
                      "already a qserve checkpoint (recipe 'awq-import')", "pass no --recipe")
    assert not (tmp_path / "a").exists()


def test_awq_nibble_order_is_not_sequential(tmp_path):
    """A packer that ignores AWQ's interleave must read back different weights: the test
    above would catch a loader that reads the words in order."""
    chosen = make(tmp_path, "awq", 32)
    base, (q, z, s) = next(iter(chosen.items()))
    words = pack_words(q.T.copy(), AWQ_PACK_ORDER)
    assert not np.array_equal(words, pack_words(q.T.copy()))
    assert torch.equal(unpack_int4(load_model(tmp_path).weights[base + ".weight"].qweight),
                       torch.from_numpy(q))


def test_act_order_g_idx_is_refused(tmp_path):
    quant = {"quant_method": "gptq", "bits": 4, "sym": True, "desc_act": True,
             "group_size": 32}
    rng = np.random.default_rng(0)

    def pack(base, w):
        q, z, s = random_quant(*w.shape, 32, True, True, rng)
        g_idx = torch.from_numpy(rng.permutation(w.shape[1]) // 32).to(torch.int32)
        return gptq_tensors(q, z, s, True, g_idx), (q, z, s)
    write_checkpoint(tmp_path, tiny_llama(), quant, pack)
    with pytest.raises(ModelLoadError, match=r"g_idx reorders inputs .*desc_act false"):
        load_model(tmp_path).weights["model.layers.0.self_attn.q_proj.weight"]


@pytest.mark.parametrize("change, message", [
    ({"bits": 3}, "bits 3"), ({"version": "gemv"}, "GEMM layout"),
    ({"group_size": 48}, "group size 48"), ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
])
def test_unsupported_configs_are_one_line_errors(change, message, tmp_path):
    make(tmp_path, "awq", 32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] |= change
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message) as e:
        w = load_model(tmp_path).weights
        w["model.layers.0.self_attn.q_proj.weight"]
    assert "\n" not in str(e.value)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make(tmp_path, "gptq-sym-v1", 64)
    f = tmp_path / "model.safetensors"
    sd = load_file(str(f))
    del sd["model.layers.1.mlp.up_proj.qzeros"]
    save_file(sd, str(f))
    with pytest.raises(ModelLoadError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.qzeros"):
        load_model(tmp_path)


@torch.no_grad()
def hf_greedy_on(model, weights: dict[str, torch.Tensor], ids: list[int], n: int) -> list[int]:
    """transformers' greedy loop with the decoder linears set to `weights` (fp32)."""
    for name, w in weights.items():
        model.get_parameter(name + ".weight").copy_(w.float())
    out, past, x = [], None, torch.tensor([ids])
    for _ in range(n):
        res = model(input_ids=x, cache=past, use_cache=True)
        past, tok = res.past_key_values, int(res.logits[0, -1].argmax())
        out.append(tok)
        x = torch.tensor([[tok]])
    return out


@pytest.mark.parametrize("case, gs", [("gptq-sym-v1", 128), ("awq", 64), ("gptq-asym-v2", 32)])
def test_greedy_equals_transformers_on_the_intended_weights(case, gs, tmp_path, monkeypatch):
    """qserve on the imported checkpoint against transformers on the intended (q - z) * s
    weights, fp32 activations on both sides."""
    monkeypatch.setenv("QSERVE_CPU_ACTIVATIONS", "fp32")
    chosen = make(tmp_path, case, gs, seed=1)
    ids = list(np.random.default_rng(2).integers(3, VOCAB, 12))
    ids = [int(i) for i in ids]
    want = hf_greedy_on(tiny_llama(1), {b: intended(*qzs) for b, qzs in chosen.items()}, ids, 16)
    llm = LLM(str(tmp_path), kv_cache_memory="8MiB", max_model_len=128, block_size=4)
    formats = {f.removesuffix("_x16")  # int4 runs 16 rows interleaved on a 512-bit CPU
               for m in llm.engine.model.modules() for f in getattr(m, "formats", [])}
    assert formats == {"int4" if CASES[case][1] else "int4z"}, formats  # packed, as imported
    [out] = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert out.outputs[0].token_ids == want
