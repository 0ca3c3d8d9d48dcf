"""`qserve quantize --format gguf | compressed-tensors`: the same weights, read by other tools.

GGUF: every exported tensor read back by qserve's GGUF loader equals the checkpoint's bit for
bit (codes, scales, offsets); llama.cpp's own llama-server, fed the same prompt ids, completes
greedily exactly as qserve does on the checkpoint (qserve's CPU default: int8 activations per
32 inputs, llama.cpp's scheme for Q4_0/Q4_1/Q8_0). Skipped with the reason when native
llama.cpp is not built (scripts/peer.py).

compressed-tensors: the package's own unpacking gives back qserve's codes and scales (and an
AWQ / GPTQ directory's integer zero points, exported as stored); transformers with
compressed-tensors on the CPU decompresses to qserve's weights rounded to fp16 (it
dequantizes in the scale's dtype), and its greedy output equals qserve's.
"""
from __future__ import annotations

import importlib.util
import json
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from qserve import LLM, SamplingParams
from qserve.errors import QServeError
from qserve.formats import QuantizedTensor, unpack_int4
from qserve.loader import load_model
from qserve.quant.quantize import quantize

REPO = Path(__file__).resolve().parent.parent
RECIPES = {  # name -> weights section; the tiny model's inputs (128, 256) divide every group
    "w4g32": {"bits": 4, "group_size": 32, "symmetric": False},  # -> Q4_1
    "w4g32-sym": {"bits": 4, "group_size": 32, "symmetric": True},  # -> Q4_0
    "w8g32": {"bits": 8, "group_size": 32, "symmetric": True},  # -> Q8_0
    "w8": {"bits": 8, "group_size": None, "symmetric": True},  # per channel
    "w4g128-sym": {"bits": 4, "group_size": 128, "symmetric": True},
    "w4g128": {"bits": 4, "group_size": 128, "symmetric": False},
}
PROMPT = [5, 17, 33, 8, 61, 40, 22, 9, 70, 12, 44, 3]


def recipe_file(root: Path, name: str) -> Path:
    path = root / f"{name}.yaml"
    if not path.exists():
        path.write_text(json.dumps({"weights": {"method": "rtn", **RECIPES[name]}}))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny"), "llama")


def make_tiny(path: Path, family: str) -> Path:
    """A random-init transformers Llama with a byte-level BPE tokenizer trained here, on
    ASCII only: every token is whole UTF-8 text (llama-server reports no probabilities for a
    token that ends inside a character)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "tu", "ra", "si", "vo", "de", "pa", "qu", "zi"]
    tok.train_from_iterator([" ".join("".join(rng.choices(syllables, k=rng.randint(1, 4)))
                                      for _ in range(12)) for _ in range(2000)],
                            trainers.BpeTrainer(
        vocab_size=300, min_frequency=1, special_tokens=["<s>", "</s>"], initial_alphabet=[]))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>",
                                                            "eos_token": "</s>"}))
    torch.manual_seed(0)
    common = dict(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, bos_token_id=0, eos_token_id=1,
                  tie_word_embeddings=False, initializer_range=0.1)
    config = {"llama": lambda: LlamaConfig(**common),
              "qwen2": lambda: Qwen2Config(**common, use_sliding_window=False),  # q/k/v biases
              "qwen3": lambda: Qwen3Config(**common, head_dim=64)}[family]()  # q/k norms
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # biases and norms away from their 0 / 1 init
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tiny, tmp_path_factory):
    """recipe name -> the tiny model's qserve checkpoint with it (made once)."""
    root, made = tmp_path_factory.mktemp("ckpt"), {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = root / name
            quantize(str(tiny), made[name], recipe_file(root, name))
        return made[name]
    return get


def same_weights(a: dict, b: dict, exact_dense=True) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, QuantizedTensor) and x.format in ("int4", "int8"):
            assert isinstance(y, QuantizedTensor) and y.format == x.format, name
            for t, u in zip((x.qweight, x.scales, x.offsets), (y.qweight, y.scales, y.offsets)):
                assert (t is None and u is None) or torch.equal(t, u), name
        else:
            deq = lambda w: w.dequantize() if isinstance(w, QuantizedTensor) else w.float()  # noqa: E731
            assert torch.equal(deq(x), deq(y)), name


def qserve_greedy(model: Path, ids: list[int], n: int) -> list[int]:
    """n greedy tokens, EOS masked (min_tokens) as llama-server's ignore_eos masks it."""
    # K/V in fp32: a random model's near ties flip with fp16 K/V as early as the first token
    llm = LLM(str(model), kv_cache_memory="8MiB", max_model_len=128, block_size=4,
              kv_dtype="fp32")
    [out] = llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, min_tokens=n))
    return out.outputs[0].token_ids


# ---- GGUF --------------------------------------------------------------------------------
@pytest.mark.parametrize("name, ggml_type", [("w4g32", "Q4_1"), ("w4g32-sym", "Q4_0"),
                                             ("w8g32", "Q8_0")])
def test_gguf_export_holds_the_checkpoint_bit_for_bit(name, ggml_type, checkpoint, tmp_path):
    import gguf

    ckpt = checkpoint(name)
    out = tmp_path / "model.gguf"
    summary = quantize(str(ckpt), out, recipe_file(ckpt.parent, name), fmt="gguf")
    assert summary["format"] == "gguf"
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == ggml_type
    assert types["output.weight"] == "F16"  # kept dense by the recipe (lm_head)
    same_weights(load_model(ckpt).weights, load_model(out).weights)


@pytest.mark.parametrize("name", ["w4g64", "w8", "w4g128"])
def test_gguf_refuses_what_no_ggml_type_holds(name, tiny, tmp_path):
    recipe = name if name == "w4g64" else recipe_file(tmp_path, name)
    with pytest.raises(QServeError, match=r"no GGUF type holds exactly; GGUF export takes "
                                          r"w4g32 .*Q4_1.*Q4_0.*Q8_0"):
        quantize(str(tiny), tmp_path / "x.gguf", recipe, fmt="gguf")
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("fmt, out, takes", [
    ("gguf", "x.gguf", "GGUF export takes w4g32"),
    ("compressed-tensors", "ct", "compressed-tensors export takes w8 (int8 per channel), "
                                 "int8 with group_size 32/64/128, and int4 with symmetric: "
                                 "true (w4g64-sym"),
])
def test_cli_format_refusal_is_one_line(fmt, out, takes, tiny, tmp_path):
    env = {"QSERVE_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "qserve", "quantize", str(tiny), "-o",
                        str(tmp_path / out), "--format", fmt, "-r", "w4g64"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    assert takes in r.stderr and not (tmp_path / out).exists(), r.stderr


def _llama_server() -> Path | None:
    spec = importlib.util.spec_from_file_location("peer", REPO / "scripts" / "peer.py")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    try:
        path = peer.llama_cpp_dir(build=False) / "build" / "bin" / "llama-server"
    except peer.PeerError:
        return None
    return path if path.exists() else None


def llama_cpp_greedy(model: Path, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy completion of prompt ids by llama.cpp's llama-server (on loopback, stopped
    after): the tokens, and at each step the log-probability gap to the runner-up (None where
    the server leaves a step out of completion_probabilities: a token that ends inside a
    UTF-8 character)."""
    server = _llama_server()
    if server is None:
        pytest.skip("native llama.cpp is not built here (python scripts/peer.py builds it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(server), "-m", str(model), "--host", "127.0.0.1", "--port",
                             str(port), "-t", "2", "-c", "256", "-np", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(240):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail(f"llama-server exited: {proc.stderr.read()[-2000:]}")
                time.sleep(0.25)
        body = json.dumps({"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1,
                           "return_tokens": True, "cache_prompt": False, "n_probs": 2,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(url + "/completion", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            reply = json.loads(r.read())
        tokens, steps, gaps = reply["tokens"][:n], reply["completion_probabilities"], []
        for t in tokens:  # steps are the tokens' subsequence, in order
            top = steps[0]["top_logprobs"] if steps and steps[0]["id"] == t else None
            gaps.append(None if top is None else top[0]["logprob"] - top[1]["logprob"])
            steps = steps[1:] if top is not None else steps
        return tokens, gaps
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# nats between llama.cpp's top two tokens. Activation rounding moves logits that much: on the
# default model's w4g32 export, qserve with int8 activations and with fp32 activations
# themselves pick differently where the top two are 0.24 nats apart, and llama.cpp (int8
# activations too, in its own order) sides with either one.
NEAR_TIE = 0.3


def assert_same_greedy(theirs: tuple[list[int], list[float]], ours: list[int],
                       min_agree: int,
                       resume: Callable[[list[int], int], list[int]] | None = None) -> None:
    """Token for token, up to a step where llama.cpp's top two are within NEAR_TIE: both
    engines round activations to int8 per 32 inputs, but sum in their own order, which can
    flip a near tie (and everything after it), never a clear choice. There the comparison
    ends, unless `resume(prefix, k)` is given (qserve's k greedy tokens after the prompt and
    llama.cpp's tokens `prefix`): then qserve goes on from llama.cpp's choice and every later
    step is checked the same way. At least min_agree tokens must agree (without `resume`,
    the first min_agree)."""
    tokens, gaps = theirs
    ours, i, agree = list(ours), 0, 0
    while i < min(len(tokens), len(ours)):
        if tokens[i] != ours[i]:
            near_tie = gaps[i] is not None and gaps[i] < NEAR_TIE
            assert near_tie, (i, tokens, ours, gaps[i])
            if resume is None:
                break
            rest = len(tokens) - i - 1
            ours = ours[:i] + [tokens[i]] + (resume(tokens[:i + 1], rest) if rest else [])
        else:
            agree += 1
        i += 1
    else:
        assert len(tokens) == len(ours)
    assert agree >= min_agree, (agree, tokens, ours)


@pytest.mark.slow
def test_llama_cpp_completes_the_default_model_export_as_qserve(tmp_path, default_model_path):
    """The real model (SmolLM2-135M), w4g32 -> Q4_1: llama.cpp's greedy equals qserve's at
    every step where llama.cpp's choice is clear."""
    if _llama_server() is None:
        pytest.skip("native llama.cpp is not built here (python scripts/peer.py builds it)")
    ckpt, out = tmp_path / "ckpt", tmp_path / "w4g32.gguf"
    quantize(str(default_model_path), ckpt, "w4g32")
    quantize(str(ckpt), out, "w4g32", fmt="gguf")
    tok = load_model(ckpt).tokenizer
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        ids = tok.encode(prompt)
        # a near tie as early as the sixth token parted them on a Zen 3 (0.07 nats): qserve
        # then continues llama.cpp's tokens, so all 16 steps are checked
        assert_same_greedy(llama_cpp_greedy(out, ids, 16), qserve_greedy(out, ids, 16), 8,
                           resume=lambda prefix, k: qserve_greedy(out, ids + prefix, k))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_gguf_export_of_other_families(family, tmp_path):
    """Qwen2 (q/k/v biases, HF's q/k row order) and Qwen3 (q/k norms, head_dim 64 with
    hidden 128 / 4 heads): read back bit for bit, and llama.cpp agrees."""
    src, ckpt, out = make_tiny(tmp_path / "src", family), tmp_path / "ckpt", tmp_path / "m.gguf"
    quantize(str(src), ckpt, "w4g32")
    quantize(str(ckpt), out, "w4g32", fmt="gguf")
    same_weights(load_model(ckpt).weights, load_model(out).weights)
    assert_same_greedy(llama_cpp_greedy(out, PROMPT, 16), qserve_greedy(out, PROMPT, 16), 2)


@pytest.mark.parametrize("name", ["w4g32", "w4g32-sym", "w8g32"])
def test_llama_cpp_completes_the_tiny_export_as_qserve(name, checkpoint, tmp_path):
    ckpt = checkpoint(name)
    out = tmp_path / "model.gguf"
    quantize(str(ckpt), out, recipe_file(ckpt.parent, name), fmt="gguf")
    # a random model's logits are flat: near ties come early (min_agree 2)
    assert_same_greedy(llama_cpp_greedy(out, PROMPT, 16), qserve_greedy(out, PROMPT, 16), 2)


def test_gguf_export_of_a_symmetric_gptq_directory(tiny, tmp_path):
    """A symmetric GPTQ g32 directory exports as stored (no recipe): its int4 is Q4_0's
    layout, read back bit for bit, and llama.cpp completes the file as qserve does."""
    import shutil

    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM

    from test_awq_gptq_import import (CASES, gptq_tensors, invoke, random_quant,
                                      write_checkpoint)

    rng = np.random.default_rng(0)

    def pack(base, w):
        q, z, s = random_quant(*w.shape, 32, True, True, rng)
        return gptq_tensors(q, z, s, True), (q, z, s)
    src, out = tmp_path / "src", tmp_path / "m.gguf"
    write_checkpoint(src, AutoModelForCausalLM.from_pretrained(tiny),
                     CASES["gptq-sym-v1"][0] | {"group_size": 32}, pack)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # byte-level BPE, as GGUF takes
        shutil.copy(tiny / name, src / name)
    r = invoke("quantize", str(src), "-o", str(out), "--format", "gguf")
    assert r.exit_code == 0, r.output
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == "Q4_0"
    same_weights(load_model(src).weights, load_model(out).weights)
    assert_same_greedy(llama_cpp_greedy(out, PROMPT, 16), qserve_greedy(out, PROMPT, 16), 2)


# ---- compressed-tensors ------------------------------------------------------------------
needs_ct = pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None,
                              reason="compressed-tensors is not installed "
                                     "(pip install -e '.[export]')")


@needs_ct
@pytest.mark.parametrize("name", ["w8", "w4g128-sym"])
def test_compressed_tensors_export_is_read_back_by_the_package_and_transformers(
        name, checkpoint, tmp_path, monkeypatch):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    ckpt = checkpoint(name)
    out = tmp_path / "ct"
    quantize(str(ckpt), out, recipe_file(ckpt.parent, name), fmt="compressed-tensors")
    ours = load_model(ckpt).weights
    stored = load_file(str(out / "model.safetensors"))
    bits = RECIPES[name]["bits"]
    for key in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        qt = ours[key + ".weight"]
        codes = unpack_from_int32(stored[key + ".weight_packed"], bits,
                                  torch.Size(stored[key + ".weight_shape"].tolist()))
        want = unpack_int4(qt.qweight).to(torch.int8) - 8 if bits == 4 else qt.qweight
        assert torch.equal(codes, want) and torch.equal(stored[key + ".weight_scale"], qt.scales)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["ignore"] == ["lm_head"] and cfg["format"] == "pack-quantized"

    want = transformers_reads_back(out, ours)
    monkeypatch.setenv("QSERVE_CPU_ACTIVATIONS", "fp32")  # transformers' precision
    assert qserve_greedy(ckpt, PROMPT, 16) == want


def transformers_reads_back(out: Path, ours: dict, compressed: bool = True) -> list[int]:
    """Check that transformers decompresses the export `out` to qserve's weights `ours`
    rounded to fp16 (it dequantizes in the scales' dtype); return its 16 greedy tokens on the
    model loaded compressed (decompressed at its first forward), or else on that one."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    hf = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))
    sd = hf.state_dict()
    for key, qt in ours.items():
        if isinstance(qt, QuantizedTensor):
            assert torch.equal(sd[key], qt.dequantize().half().float()), key
    if compressed:
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    hf.eval()
    want, x, cache = [], torch.tensor([PROMPT]), None
    with torch.no_grad():
        for _ in range(16):
            res = hf(input_ids=x, cache=cache, use_cache=True)
            cache = res.past_key_values
            want.append(int(res.logits[0, -1].argmax()))
            x = torch.tensor([want[-1:]])
    return want


@needs_ct
@pytest.mark.parametrize("case, gs", [("awq", 64), ("gptq-asym-v2", 128), ("gptq-sym-v1", 32)])
def test_compressed_tensors_export_of_an_awq_gptq_directory_is_exact(case, gs, tmp_path,
                                                                     monkeypatch):
    """`qserve quantize AWQ_DIR -o OUT --format compressed-tensors` (no recipe) exports the
    import as stored: int4z as asymmetric pack-quantized whose zero points are the file's own
    (the package unpacks the codes, scales and zero points), int4 as symmetric, and the same
    bytes by way of a qserve checkpoint of the import. transformers decompresses it to
    qserve's weights (in fp16) and its greedy output equals qserve's on the AWQ / GPTQ
    directory. Loaded compressed, transformers 5.24 with compressed-tensors 0.20.1 refuses an
    asymmetric model (its meta-device layout keeps the zero points unpacked, (out, G), where
    the package's own export packs them (out / 8, G), as this one does: a model the package
    exports itself fails the same way), so greedy runs on the decompressed load there."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    from test_awq_gptq_import import CASES, invoke, make

    src, out = tmp_path / "src", tmp_path / "ct"
    chosen = make(src, case, gs)
    r = invoke("quantize", str(src), "-o", str(out), "--format", "compressed-tensors")
    assert r.exit_code == 0, r.output
    stored = load_file(str(out / "model.safetensors"))
    for base, (q, z, s) in chosen.items():
        shape = torch.Size(stored[base + ".weight_shape"].tolist())
        codes = unpack_from_int32(stored[base + ".weight_packed"], 4, shape)
        assert torch.equal(codes, torch.from_numpy(q).to(torch.int8) - 8), base
        assert torch.equal(stored[base + ".weight_scale"], s), base
        if CASES[case][1]:
            assert base + ".weight_zero_point" not in stored
        else:
            zp = unpack_from_int32(stored[base + ".weight_zero_point"], 4,
                                   torch.Size([shape[0], shape[1] // gs]), packed_dim=0)
            assert torch.equal(zp, torch.from_numpy(z).to(torch.int8) - 8), base
    config = (out / "config.json").read_text()
    [group] = json.loads(config)["quantization_config"]["config_groups"].values()
    assert group["weights"]["symmetric"] == CASES[case][1] and group["weights"]["group_size"] == gs

    ckpt, again = tmp_path / "ckpt", tmp_path / "ct-again"  # a qserve checkpoint in between
    assert invoke("quantize", str(src), "-o", str(ckpt)).exit_code == 0
    r = invoke("quantize", str(ckpt), "-o", str(again), "--format", "compressed-tensors")
    assert r.exit_code == 0, r.output
    assert (again / "config.json").read_text() == config
    stored_again = load_file(str(again / "model.safetensors"))
    assert stored_again.keys() == stored.keys()
    assert all(torch.equal(stored_again[k], stored[k]) for k in stored)

    want = transformers_reads_back(out, dict(load_model(src).weights), compressed=CASES[case][1])
    monkeypatch.setenv("QSERVE_CPU_ACTIVATIONS", "fp32")  # transformers' precision
    assert qserve_greedy(src, PROMPT, 16) == want


@pytest.mark.parametrize("fmt, out, message", [
    ("compressed-tensors", "ct", "has a zero point of 16 (GPTQ v1's stored -1)"),
    ("gguf", "x.gguf", "would be int4z g32 asym, which no GGUF type holds exactly"),
])
def test_an_import_a_format_cannot_hold_is_refused(fmt, out, message, tmp_path):
    """GPTQ v1 stores zero - 1 in 4 bits, so its -1 reads back as a zero of 16: no 4-bit zp in
    compressed-tensors; and no GGUF type holds integer zero points (Q4_1's fp16 minimum would
    round -z s). One line, nothing written."""
    from test_awq_gptq_import import assert_user_error, invoke, make

    chosen = make(tmp_path / "src", "gptq-asym-v1", 32)
    assert any((z == 16).any() for _, z, _ in chosen.values())
    assert_user_error(invoke("quantize", str(tmp_path / "src"), "-o", str(tmp_path / out),
                             "--format", fmt), message)
    assert not (tmp_path / out).exists()


@pytest.mark.parametrize("name, message", [
    ("w4g128", "integer zero point cannot hold without re-rounding"),
])
def test_compressed_tensors_refuses_asymmetric_int4(name, message, tiny, tmp_path):
    with pytest.raises(QServeError, match=message):
        quantize(str(tiny), tmp_path / "ct", recipe_file(tmp_path, name),
                 fmt="compressed-tensors")
    assert not (tmp_path / "ct").exists()


def test_force_replaces_only_an_export(tiny, checkpoint, tmp_path):
    ckpt = checkpoint("w8")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(QServeError, match="not a GGUF file"):
        quantize(str(ckpt), tmp_path / "notes.txt", "w8", force=True, fmt="gguf")
    with pytest.raises(QServeError, match="not a compressed-tensors export"):
        quantize(str(ckpt), tmp_path, "w8", force=True, fmt="compressed-tensors")
    assert (tmp_path / "notes.txt").read_text() == "mine"
