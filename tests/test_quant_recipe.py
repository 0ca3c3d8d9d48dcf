"""Recipes: the shipped ones load; bad ones fail naming the key; group-size fallbacks are
planned per layer (pad / divisor / error) on the default model's shapes (576 = 4.5 x 128)."""
import pytest

from qserve.config import ModelArchConfig
from qserve.errors import ConfigError
from qserve.quant.quantize import plan_layers
from qserve.quant.recipe import available, load_recipe, parse_recipe

SMOL = ModelArchConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                       tie_word_embeddings=True)


def test_shipped_recipes():
    names = available()
    assert {"w8", "w4g32", "w4g64", "w4g128", "w4g64-awq", "w4g64-sym", "w4g64-all",
            "gguf-native"} <= set(names)
    for name in names:
        r = load_recipe(name)
        assert r.name == name and r.kv_dtype != "auto"
    assert load_recipe("w8").scheme.bits == 8 and load_recipe("w8").group_size is None
    assert load_recipe("w4g64-awq").method == "awq"


def test_recipe_by_path(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("weights: {bits: 4, group_size: 32, symmetric: true}\nkv_dtype: fp16\n")
    r = load_recipe(str(p))
    assert (r.name, r.bits, r.group_size, r.symmetric, r.keep) == ("mine", 4, 32, True, ["lm_head"])


@pytest.mark.parametrize("data, needle", [
    ({"weights": {"bits": 4}, "kvdtype": "fp16"}, "unknown key 'kvdtype'"),
    ({"weights": {"bits": 4, "groupsize": 64}}, "unknown key 'weights.groupsize'"),
    ({"weights": {"bits": 3}}, "key 'weights.bits' is 3"),
    ({"weights": {"bits": 4, "group_size": 48}}, "key 'weights.group_size' is 48"),
    ({"weights": {"bits": 4, "group_size": None}}, "key 'weights.group_size' is None"),
    ({"weights": {"bits": 8, "symmetric": False}}, "weights.symmetric"),
    ({"weights": {"method": "gptq"}}, "key 'weights.method' is 'gptq'"),
    ({"weights": {"method": "gguf", "bits": 4}}, "weights.bits' does not apply"),
    ({"weights": {"group_fallback": "round"}}, "weights.group_fallback"),
    ({"weights": {"keep": "lm_head"}}, "weights.keep"),
    ({"weights": {"embedding": "int4"}}, "key 'weights.embedding' is 'int4'"),
    ({"weights": {}, "kv_dtype": "fp8"}, "key 'kv_dtype' is 'fp8'"),
    ({"kv_dtype": "fp16"}, "key 'weights'"),
    (["not", "a", "mapping"], "YAML mapping"),
    ({"weights": {"keep": ["{bogus}"]}}, "weights.keep' has the pattern '{bogus}'"),
    ({"weights": {"keep": ["model.layers.{0}.*"]}}, "the only placeholders are {first}"),
    ({"weights": {"keep": ["lm_head{"]}}, "weights.keep' has the pattern 'lm_head{'"),
])
def test_bad_recipes_name_the_key(data, needle):
    with pytest.raises(ConfigError, match=None) as e:
        parse_recipe(data)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown recipe 'w3'.*w4g64"):
        load_recipe("w3")


def test_bad_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("weights: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_recipe(str(p))


@pytest.mark.parametrize("data, needle", [
    (bytes(range(256)) * 4, "is not UTF-8 text"),
    (b"weights:\x00\x01\x02 binary\n", "not valid YAML"),
])
def test_binary_recipe_file(tmp_path, data, needle):
    p = tmp_path / "binary.yaml"
    p.write_bytes(data)
    with pytest.raises(ConfigError, match=needle) as e:
        load_recipe(str(p))
    assert "\n" not in str(e.value)


def _plans(**weights):
    return {p.name: p for p in plan_layers(SMOL, parse_recipe({"weights": weights}))}


def test_group_fallback_pad_divisor_error():
    q, down = "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"
    pad = _plans(bits=4, group_size=128, group_fallback="pad")
    assert pad[q].group_size == 128 and "padded" in pad[q].note  # 576 inputs
    assert pad[down].group_size == 128 and pad[down].note == ""  # 1536 = 12 x 128
    div = _plans(bits=4, group_size=128, group_fallback="divisor")
    assert div[q].group_size == 64 and "used 64" in div[q].note
    with pytest.raises(ConfigError, match="group size 128 does not divide .*576 inputs"):
        _plans(bits=4, group_size=128, group_fallback="error")
    assert all(p.note == "" for p in _plans(bits=4, group_size=64).values())


def test_keep_patterns_and_fused_consistency():
    plans = _plans(bits=8, keep=["model.layers.{first}.*", "model.layers.{last}.mlp.*"])
    assert plans["model.layers.0.self_attn.o_proj"].scheme is None
    assert plans["model.layers.29.mlp.up_proj"].scheme is None
    assert plans["model.layers.29.self_attn.q_proj"].scheme is not None
    with pytest.raises(ConfigError, match="fused"):
        _plans(bits=8, keep=["*.q_proj"])


def test_embedding_quantized_on_request():
    plans = _plans(bits=4, group_size=128, embedding="quantize")
    emb = plans["model.embed_tokens"]
    assert emb.shape == (49152, 576) and emb.group_size == 128 and "padded" in emb.note
    assert "model.embed_tokens" not in _plans(bits=4)
    assert load_recipe("gguf-native").embedding == "quantize"


# ---- what a checkpoint made with a recipe brings to the engine ------------------------------
@pytest.fixture(scope="module")
def w4g128(tmp_path_factory, default_model_path):
    """The default model through the w4g128 recipe: (checkpoint dir, quantize summary)."""
    from qserve.quant.quantize import quantize

    out = tmp_path_factory.mktemp("ckpt") / "w4g128"
    return out, quantize(str(default_model_path), out, "w4g128")


def _engine(model=None, loaded=None, **flags):
    from qserve.config import engine_config
    from qserve.engine.llm_engine import LLMEngine

    return LLMEngine(engine_config(model, max_model_len=64, kv_cache_memory="8MiB",
                                   swap_space="1MiB", **flags), loaded=loaded)


def test_auto_kv_dtype_is_the_recipes(w4g128, loaded_model):
    """--kv-dtype auto uses the kv_dtype a checkpoint's recipe names; a given one wins."""
    import dataclasses

    import torch

    path, _ = w4g128
    assert _engine(str(path)).kv_dtype == torch.float16  # recipes/w4g128.yaml: kv_dtype fp16
    assert _engine(str(path), kv_dtype="int4").kv_dtype == torch.uint8
    assert _engine(loaded=loaded_model).kv_dtype == torch.float32  # not a checkpoint: --dtype
    int8 = dataclasses.replace(loaded_model, quant={"kv_dtype": "int8"})
    assert _engine(loaded=int8).kv_dtype == torch.int8
    assert _engine(loaded=int8, kv_dtype="fp32").kv_dtype == torch.float32


def test_resident_bytes_from_the_header(w4g128):
    """qserve info's resident figures (read from the safetensors header) are the quantize
    summary's; int4 g128 keeps the linears under the issue's 0.30x of fp16."""
    import json

    from click.testing import CliRunner

    from qserve.cli import main
    from qserve.loader import load_arch
    from qserve.quant.quantize import resident_bytes

    path, summary = w4g128
    res = resident_bytes(path, load_arch(path))
    for key, value in res.items():
        assert value == pytest.approx(summary[key], rel=1e-12), key
    assert res["resident_ratio_without_embedding"] <= 0.30 < res["resident_ratio"]
    out = CliRunner().invoke(main, ["info", str(path), "--json", "--kv-cache-memory", "8MiB"])
    assert out.exit_code == 0, out.output
    info = json.loads(out.output)
    assert info["weight_bytes"]["resident_fp16_engine"] == summary["resident_bytes_fp16_engine"]
    # this engine (fp32 activations) keeps the same bytes but for the norms, in fp32 here
    norms = (2 * load_arch(path).num_layers + 1) * load_arch(path).hidden_size
    assert info["weight_bytes"]["resident"] == summary["resident_bytes_fp16_engine"] + 2 * norms
    assert info["resident_vs_fp16"]["without_embedding"] == round(
        summary["resident_ratio_without_embedding"], 4)
    assert (info["recipe"], info["recipe_kv_dtype"]) == ("w4g128", "fp16")
