"""qserve checkpoints on the real default model: the lossless GGUF import, save/load round
trips with identical logits, generation through the engine, the `quantize` command, and every
bad input (one line, exit 2, nothing written)."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from qserve.models.registry import num_params
from qserve import LLM, SamplingParams, cli
from qserve.errors import ModelLoadError, QServeError
from qserve.formats import QuantizedTensor
from qserve.kernels import cpu_ops
from qserve.loader import load_model
from qserve.quant import calibration
from qserve.quant.quantize import plan_layers, quantize, quantize_weights
from qserve.quant.recipe import load_recipe

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three primary colors:"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, default_model_path):
    """recipe name -> checkpoint directory of the default model, made on first use."""
    made = {}

    def get(recipe: str) -> Path:
        if recipe not in made:
            made[recipe] = tmp_path_factory.mktemp("ckpt") / recipe
            quantize(str(default_model_path), made[recipe], recipe)
        return made[recipe]
    return get


def invoke(*args):
    return CliRunner().invoke(cli.main, list(args))


def assert_user_error(result, *needles):
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_gguf_native_is_lossless(ckpt, loaded_model):
    """Every linear of the Q4_1 model comes back as the same packed g32 blocks, dequantizing bit
    for bit to what the GGUF loader (gguf.quants.dequantize) gives; dense tensors are equal."""
    q = load_model(ckpt("gguf-native"))
    assert q.source_format == "qserve" and q.quant["recipe"]["name"] == "gguf-native"
    layers = q.quant["layers"]
    assert len(layers) == 7 * 30 + 1
    assert layers["model.embed_tokens"] == {"format": "int8", "bits": 8, "group_size": 32,
                                            "symmetric": True}
    for name, w in loaded_model.weights.items():
        layer = name.removesuffix(".weight")
        if layer in layers:
            if layer != "model.embed_tokens":
                assert layers[layer] == {"format": "int4", "bits": 4, "group_size": 32,
                                         "symmetric": False}
            deq = q.weights[name].dequantize()
            assert torch.equal(deq.view(torch.int32), w.view(torch.int32)), name
        else:
            assert torch.equal(q.weights[name], w), name


@pytest.mark.parametrize("recipe", ["w8", "gguf-native"])
def test_engine_generates_from_checkpoint(ckpt, loaded_model, recipe):
    """Through the engine on the pure-torch path: gguf-native greedy tokens equal the fp32
    dequantized model's (same weights, bit for bit); w8 generates, its first tokens those of
    fp32. (The CPU fast path's int8 activations are an approximation of their own, bounded in
    tests/test_cpu_ops.py.)"""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # fp32 KV on both sides: --kv-dtype auto would take the recipe's fp16 for the checkpoint
    kw = dict(kv_cache_memory="128MiB", max_model_len=256, kv_dtype="fp32")
    with cpu_ops.disabled():
        ref = [o.outputs[0].token_ids
               for o in LLM(loaded=loaded_model, **kw).generate(PROMPTS, params)]
        llm = LLM(str(ckpt(recipe)), **kw)
        assert type(llm.engine.model.layers[0].mlp.down_proj).__name__ == "QuantLinear"
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    if recipe == "gguf-native":
        assert got == ref
    else:
        assert [g[:2] for g in got] == [r[:2] for r in ref]


def test_checkpoint_round_trip_identical_logits(ckpt, loaded_model):
    """The tensors quantize_weights makes in memory, and the same after save + load, give
    identical logits (and identical tensors)."""
    recipe = load_recipe("w8")
    tensors, _ = quantize_weights(loaded_model, recipe, plan_layers(loaded_model.arch, recipe))
    q = load_model(ckpt("w8"))
    assert tensors.keys() == q.weights.keys()
    for k in tensors:
        a, b = tensors[k], q.weights[k]
        if hasattr(a, "format"):  # packed: the same format and the same tensors
            assert a.format == b.format and a.tensors().keys() == b.tensors().keys(), k
            assert all(torch.equal(t, b.tensors()[n]) for n, t in a.tensors().items()), k
        else:
            assert torch.equal(a, b), k
    ids = loaded_model.tokenizer.encode("Quantized weights, loaded back, give the same logits.")
    a = calibration.logits(calibration.build_model(q.arch, tensors, 64), ids)
    b = calibration.logits(calibration.build_model(q.arch, q.weights, 64), ids)
    assert torch.equal(a, b)
    assert q.tokenizer.encode("<|im_start|>user 12 héllo") == \
        loaded_model.tokenizer.encode("<|im_start|>user 12 héllo")
    assert q.tokenizer.chat_template == loaded_model.tokenizer.chat_template
    assert q.arch == loaded_model.arch


def test_quantize_command_w4g64(tmp_path, default_model_path):
    """The command end to end: JSON summary per layer (576 inputs divide by 64, no fallback
    note), resident int4 bytes <= 0.30x fp16 without the embedding, and a loadable checkpoint
    whose resident weights match that claim in an fp16 model."""
    out = tmp_path / "w4"
    r = invoke("quantize", str(default_model_path), "-o", str(out), "--recipe", "w4g64", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.output.strip().splitlines()[-1])
    assert len(s["layers"]) == 210 and all(x["scheme"] == "int4 g64 asym" for x in s["layers"])
    assert s["resident_ratio_without_embedding"] <= 0.30
    assert s["quantized_linear_ratio"] == pytest.approx(4.5 / 16)
    assert sorted(p.name for p in out.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"]
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["kv_dtype"] == "fp16" and cfg["recipe"]["weights"]["group_size"] == 64
    q = load_model(out)
    model = calibration.build_model(q.arch, q.weights, 16, dtype=torch.float16)
    resident = sum(t.numel() * t.element_size() for n, t in
                   [*model.named_parameters(), *model.named_buffers()] if "rope" not in n)
    embed = model.embed_tokens.weight.numel() * 2
    fp16 = 2 * num_params(q.arch)
    assert resident == s["resident_bytes_fp16_engine"]
    assert (resident - embed) / (fp16 - embed) <= 0.30
    # and the 128-group recipe pads the 576-input layers, saying so per layer
    r = invoke("quantize", str(default_model_path), "-o", str(tmp_path / "g128"), "-r", "w4g128")
    assert r.exit_code == 0, r.output
    assert "576 inputs: last group of 128 padded (64 real)" in r.output
    assert "resident at --dtype fp16" in r.output


# ---- bad input -----------------------------------------------------------------------------
def test_existing_out_is_refused_without_force(tmp_path, default_model_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_user_error(invoke("quantize", str(default_model_path), "-o", str(out)),
                      "already exists", "--force")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("recipe_text, needle", [
    (None, "unknown recipe 'w5'"),
    ("weights: {bits: 4, group_sise: 64}\n", "unknown key 'weights.group_sise'"),
    ("weights: {bits: 4, group_size: 128, group_fallback: error}\n",
     "group size 128 does not divide model.layers.0.self_attn.q_proj's 576 inputs"),
])
def test_bad_recipe_writes_nothing(tmp_path, default_model_path, recipe_text, needle):
    recipe = "w5"
    if recipe_text is not None:
        recipe = str(tmp_path / "r.yaml")
        Path(recipe).write_text(recipe_text)
    out = tmp_path / "out"
    assert_user_error(invoke("quantize", str(default_model_path), "-o", str(out), "-r", recipe),
                      needle)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == (
        [] if recipe_text is None else ["r.yaml"])


def test_requantizing_a_checkpoint(ckpt, tmp_path):
    """A qserve checkpoint as SRC: another recipe is refused; its own recipe copies it."""
    src = ckpt("w8")
    assert_user_error(invoke("quantize", str(src), "-o", str(tmp_path / "a"), "-r", "w4g64"),
                      "already a qserve checkpoint", "recipe 'w8'")
    assert_user_error(invoke("quantize", str(src), "-o", str(tmp_path / "b"), "-r", "gguf-native"),
                      "not a GGUF file")
    assert not list(tmp_path.iterdir())
    r = invoke("quantize", str(src), "-o", str(tmp_path / "c"), "-r", "w8", "--json")
    assert r.exit_code == 0, r.output
    assert load_file(str(tmp_path / "c" / "model.safetensors")).keys() == \
        load_file(str(src / "model.safetensors")).keys()


def test_interrupted_run_leaves_nothing(tmp_path, default_model_path, monkeypatch):
    from qserve.loader import checkpoint

    def interrupted(out, *args):
        (out / "config.json").parent.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save_checkpoint", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quantize(str(default_model_path), tmp_path / "out", "gguf-native")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("corruption, needle", [
    ("missing", "missing tensor model.layers.3.mlp.down_proj.scales"),
    ("shape", "tensor model.layers.3.mlp.down_proj.scales has shape (576, 47)"),
    ("dtype", "tensor model.layers.3.mlp.down_proj.scales has dtype torch.float32"),
])
def test_corrupt_checkpoint(ckpt, tmp_path, corruption, needle):
    """A damaged tensor is named on load (API: ModelLoadError; CLI: one line, exit 2)."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpt("w8"), bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.3.mlp.down_proj.scales"
    if corruption == "missing":
        del tensors[name]
    elif corruption == "shape":
        tensors[name] = tensors[name].repeat(1, 47)
    else:
        tensors[name] = tensors[name].float()
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.safetensors: "):
        load_model(bad)
    assert_user_error(invoke("quantize", str(bad), "-o", str(tmp_path / "o"), "-r", "w8"), needle)
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """recipe -> a checkpoint of the tiny GGUF (gguf-native keeps its K-quant / Q5_0 blocks)."""
    from test_loader import write_tiny_gguf

    root = tmp_path_factory.mktemp("tiny")
    src = write_tiny_gguf(root / "tiny.gguf")
    for recipe in ("gguf-native", "w4g64", "w8"):
        quantize(str(src), root / recipe, None if recipe == "gguf-native" else recipe)
    return root


@pytest.mark.parametrize("recipe, layer, change, problem", [
    # (each had been a traceback: KeyError, AttributeError or TypeError in the memory plan,
    # `info` or the loader, or a shape error that printed "expected (320, 256.5)")
    ("gguf-native", None, {"kv_dtype": "int3"},
     r"kv_dtype is 'int3'; it must be one of auto, fp32, fp16, bf16, int8, int4"),
    ("gguf-native", None, {"layers": []}, r"has no 'layers' mapping"),
    ("gguf-native", None, {"recipe": 5}, r"recipe is int, not an object"),
    ("gguf-native", None, {"format_version": True}, r"format_version is True; this qserve "
                                                    r"reads 1"),
    ("gguf-native", "model.layers.1.self_attn.q_proj", 5, r"is not an object"),
    ("gguf-native", "model.layers.1.self_attn.q_proj", {"format": "q4_0"},
     r"format 'q4_0' is not one a checkpoint holds \(int4, int4z, int8, q5_0"),
    ("w4g64", "model.layers.0.mlp.up_proj", {"group_size": 1.5},
     r"group_size 1\.5 is not a positive even integer or null"),
    ("w4g64", "model.layers.0.mlp.up_proj", {"bits": 8}, r"bits 8 do not fit format int4"),
    ("w4g64", "model.layers.0.mlp.up_proj", {"symmetric": "x"},
     r"symmetric 'x' is not true or false"),
    ("w8", "model.layers.1.self_attn.o_proj", {"symmetric": False},
     r"symmetric False does not fit int8"),
])
def test_checkpoint_config_values_no_qserve_wrote(tiny_checkpoints, tmp_path, recipe, layer,
                                                   change, problem):
    """quantization_config values of the wrong kind: one line naming config.json, from the
    loader and from `generate` / `info` (whose memory plans read the layers first)."""
    import re
    import shutil

    bad = shutil.copytree(tiny_checkpoints / recipe, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    q = cfg["quantization_config"]
    if layer is None:
        q |= change
    else:
        q["layers"][layer] = change if not isinstance(change, dict) else (
            q["layers"][layer] | change)
    (bad / "config.json").write_text(json.dumps(cfg))
    where = f"layer {layer}: " if layer else ""
    line = rf"{re.escape(f'{bad}/config.json: quantization_config {where}')}{problem}"
    with pytest.raises(ModelLoadError, match=line):
        load_model(bad)
    for args in (["generate", "-m", str(bad), "--max-tokens", "1", "to"], ["info", str(bad)]):
        result = invoke(*args)
        assert result.exit_code == 2 and re.search(line, result.output), result.output
        assert "Traceback" not in result.output


def test_checkpoint_tensors_the_config_does_not_describe(tiny_checkpoints, tmp_path):
    """A layer marked symmetric whose file still holds its offsets ran without them (on wrong
    weights), and stray tensors were ignored: the file must hold exactly what the config says."""
    import shutil

    bad = shutil.copytree(tiny_checkpoints / "w4g64", tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["layers"]["model.layers.0.mlp.up_proj"]["symmetric"] = True
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: tensor model\.layers\.0\.mlp"
                                             r"\.up_proj\.offsets is not one the config's model "
                                             r"and quantization layers describe$"):
        load_model(bad)
    shutil.copy(tiny_checkpoints / "w4g64" / "config.json", bad / "config.json")
    tensors = load_file(str(bad / "model.safetensors"))
    save_file(tensors | {"a.b": torch.zeros(1), "c.d": torch.zeros(1)},
              str(bad / "model.safetensors"))
    assert_user_error(invoke("generate", "-m", str(bad), "--max-tokens", "1", "to"),
                      "tensor a.b is not one the config's model and quantization layers "
                      "describe (nor 1 more)")


def test_calib_text_errors(tmp_path, default_model_path):
    out = tmp_path / "o"
    assert_user_error(invoke("quantize", str(default_model_path), "-o", str(out), "-r", "w8",
                             "--calib-text", str(tmp_path / "x.txt")),
                      "--calib-text applies to AWQ recipes")
    assert_user_error(invoke("quantize", str(default_model_path), "-o", str(out), "-r",
                             "w4g64-awq", "--calib-text", str(tmp_path / "missing.txt")),
                      "missing.txt", "cannot be read")
    assert not out.exists()


def test_gguf_native_keeps_every_quantized_type_as_its_blocks(tmp_path):
    """A GGUF of K-quants, Q5_0 and IQ4 (beside Q4_0 / Q4_1 / Q8_0 and dense tensors) through
    the default recipe, gguf-native: every quantized tensor comes back as the file's own blocks
    (repacked, or kept byte for byte), the checkpoint loads with the same weights, a GGUF export
    of it holds the file's tensors byte for byte, and a copy of it keeps them too."""
    import gguf
    from test_loader import write_tiny_gguf

    types = {"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.IQ4_XS,
             "blk.1.ffn_down.weight": gguf.GGMLQuantizationType.IQ4_NL,
             "blk.1.ffn_up.weight": gguf.GGMLQuantizationType.Q3_K,
             "blk.0.attn_q.weight": gguf.GGMLQuantizationType.Q4_K,  # F32 and F16 there
             "blk.0.attn_k.weight": gguf.GGMLQuantizationType.Q2_K}  # by default
    src = write_tiny_gguf(tmp_path / "mixed.gguf", types=types)
    loaded = load_model(src)
    summary = quantize(str(src), tmp_path / "ck")  # no recipe: gguf-native, all lossless
    assert summary["recipe"] == "gguf-native"
    q = load_model(tmp_path / "ck")
    layers = q.quant["layers"]
    want = {"model.layers.0.mlp.up_proj": "iq4_xs", "model.layers.1.mlp.down_proj": "iq4_nl",
            "model.layers.1.mlp.up_proj": "q3_k", "model.layers.1.mlp.gate_proj": "q5_0",
            "model.layers.1.self_attn.q_proj": "q4_k", "model.layers.1.self_attn.k_proj": "q6_k",
            "lm_head": "q6_k", "model.layers.0.self_attn.v_proj": "int4",
            "model.layers.0.self_attn.k_proj": "q2_k"}
    for name, fmt in want.items():
        assert layers[name]["format"] == fmt, (name, layers[name])
    assert layers["model.layers.0.mlp.gate_proj"]["format"] == "q4_k"  # beside IQ4_XS: segments
    for name, w in loaded.weights.items():
        got = q.weights[name]
        if isinstance(w, QuantizedTensor):
            assert got.format == w.format, name
            assert all(torch.equal(a, b) for a, b in zip(got.tensors().values(),
                                                         w.tensors().values())), name
        else:
            assert torch.equal(got.float(), w.float()), name
    runs = [LLM(model=str(m), kv_dtype="fp32", kv_cache_memory="8MiB", max_model_len=64)
            .generate([[0, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=8,
                                                     ignore_eos=True))[0].outputs[0].token_ids
            for m in (src, tmp_path / "ck")]  # the fused projections run as mixed segments
    assert runs[0] == runs[1] and len(runs[0]) == 8
    out = tmp_path / "back.gguf"
    quantize(str(tmp_path / "ck"), out, fmt="gguf")  # copied as stored, written as GGUF
    theirs = {t.name: t for t in gguf.GGUFReader(src).tensors}
    for t in gguf.GGUFReader(out).tensors:
        if theirs[t.name].tensor_type not in (gguf.GGMLQuantizationType.F32,
                                              gguf.GGMLQuantizationType.F16,
                                              gguf.GGMLQuantizationType.BF16):
            assert t.tensor_type == theirs[t.name].tensor_type, t.name
            assert np.array_equal(t.data, theirs[t.name].data), t.name
    copy = tmp_path / "copy"
    quantize(str(tmp_path / "ck"), copy)
    assert load_model(copy).quant["layers"] == layers
    with pytest.raises(QServeError, match="compressed-tensors"):  # refused, nothing written
        quantize(str(tmp_path / "ck"), tmp_path / "ct", fmt="compressed-tensors")
    assert not (tmp_path / "ct").exists()
    from qserve.quant import export_compressed
    from qserve.quant.quantize import _copy

    plans = [p for p in _copy(q)[1] if p.name != "model.embed_tokens"]  # its own refusal
    with pytest.raises(QServeError, match=r"is GGUF \S+ blocks, which compressed-tensors "
                                          r"cannot hold"):
        export_compressed.check_plans(q.arch, plans)
