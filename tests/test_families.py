"""Each model family against transformers, on tiny random checkpoints that transformers itself
writes, with the family's special features switched on: Qwen3 (q/k norms, head_dim not
hidden / heads; YaRN rope scaling), Phi-3 (fused checkpoint tensors, longrope crossing the
original context mid-generation, rope on 3/4 of each head, a sliding window), Ministral 3
(YaRN, Llama 4's query temperature), SmolLM3 (layers without rope), Granite (scaled
embedding, residuals, scores and logits), Gemma 2 (1 + w
norms, scaled embedding, gelu-tanh, attention and final soft-capping, query_pre_attn_scalar,
sliding and global layers) and Gemma 3 (q/k norms, a local rope base, linear scaling on
global layers).

Greedy tokens through the paged engine equal transformers' greedy loop over its own KV cache,
token for token, from the safetensors directory and from the GGUF that llama.cpp's
convert_hf_to_gguf.py makes of it. fp32 throughout: the two differ only in summation order.

All families share one tiny sentencepiece vocabulary (every converter reads tokenizer.model);
the prompts are token ids, so the vocabulary's quality does not matter.
"""
from __future__ import annotations

import functools
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_reference import assert_layout_comes_from_the_model
from qserve import LLM, SamplingParams

REPO = Path(__file__).resolve().parent.parent
COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, initializer_range=0.15, pad_token_id=None,
              bos_token_id=1, eos_token_id=2)
PROMPT_LEN, NEW_TOKENS = 24, 12  # 36 tokens: past Phi-3's original context of 32, 4+ windows


def configs() -> dict[str, tuple[object, bool]]:
    """name -> (transformers config, whether llama.cpp's GGUF can express it)."""
    from transformers import (Gemma2Config, Gemma3TextConfig, GraniteConfig, Ministral3Config,
                              Phi3Config, Qwen3Config, SmolLM3Config)

    gemma2 = dict(COMMON, num_hidden_layers=3, head_dim=32, sliding_window=8,
                  attn_logit_softcapping=1.5, final_logit_softcapping=5.0)
    return {
        "qwen3": (Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=32,
                              tie_word_embeddings=False), True),
        # YaRN (Qwen's long-context setting): 16 frequencies, the ramp over dims 0-5
        "qwen3-yarn": (Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=32, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
            "rope_theta": 10000.0}), True),
        "phi3-longrope": (Phi3Config(
            **COMMON, num_hidden_layers=2, sliding_window=8, original_max_position_embeddings=32,
            partial_rotary_factor=0.75, rope_scaling={  # 12 of 16 dims rotate: 6 factors
                "rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 13.0]}), True),
        # GGUF has no query_pre_attn_scalar: llama.cpp takes head_dim (as in Gemma 2 2B/9B)
        "gemma2": (Gemma2Config(**gemma2, query_pre_attn_scalar=32), True),
        "gemma2-scalar": (Gemma2Config(**gemma2, query_pre_attn_scalar=24), False),
        # Ministral 3: YaRN, and Llama 4's query temperature from position 8 on (the test's
        # 36 positions take scales 1, 1.07, 1.11, 1.14, 1.16)
        "ministral3": (Ministral3Config(**COMMON, num_hidden_layers=2, head_dim=16,
                                        rope_parameters={
                                            "rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 8,
                                            "rope_theta": 10000.0, "beta_fast": 32.0,
                                            "beta_slow": 1.0, "mscale": 1.0,
                                            "mscale_all_dim": 1.0,
                                            "llama_4_scaling_beta": 0.1}), True),
        # SmolLM3: layers 3 and 7 apply no rope (transformers' default, llama.cpp's fixed one)
        "smollm3": (SmolLM3Config(**COMMON, num_hidden_layers=8, rope_theta=10000.0), True),
        # Granite 3: its four scales, each far from 1 (as granite-3.3-8b's 12, 0.22, 1/128, 16)
        "granite": (GraniteConfig(**COMMON, num_hidden_layers=2, embedding_multiplier=6.0,
                                  residual_multiplier=0.3, attention_multiplier=0.04,
                                  logits_scaling=4.0, tie_word_embeddings=False), True),
        # six layers: five sliding and one global, llama.cpp's fixed Gemma 3 pattern
        "gemma3": (Gemma3TextConfig(
            **COMMON, num_hidden_layers=6, head_dim=32, sliding_window=8,
            query_pre_attn_scalar=32, rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}), True),
    }


@pytest.fixture(scope="module")
def tokenizer_model(tmp_path_factory) -> Path:
    """A 320-piece sentencepiece BPE model trained on seeded nonsense words."""
    import sentencepiece

    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "tu", "ra", "si", "vo", "de", "pa", "qu", "zi"]
    lines = [" ".join("".join(rng.choices(syllables, k=rng.randint(1, 4)))
                      for _ in range(12)) for _ in range(2000)]
    out = tmp_path_factory.mktemp("spm")
    (out / "corpus.txt").write_text("\n".join(lines))
    sentencepiece.SentencePieceTrainer.train(
        input=str(out / "corpus.txt"), model_prefix=str(out / "tok"), vocab_size=320,
        model_type="bpe", character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0,
        minloglevel=2)
    return out / "tok.model"


def write_checkpoint(config, path: Path, tokenizer_model: Path,
                     auto: str = "AutoModelForCausalLM") -> Path:
    """A random-init model of `config` (built by transformers' `auto` class) saved at `path`
    with the tiny vocabulary, norms and biases randomized too (Gemma initializes its norms to
    0, which would hide a missing 1 + w)."""
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, auto).from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    (path / "tokenizer.model").write_bytes(tokenizer_model.read_bytes())
    return path


@pytest.fixture(scope="module")
def checkpoints(tokenizer_model, tmp_path_factory) -> dict[str, Path]:
    """name -> Hugging Face directory of a random-init model (write_checkpoint)."""
    root = tmp_path_factory.mktemp("families")
    dirs = {}
    for name, (config, _) in configs().items():
        config.vocab_size = 320
        dirs[name] = write_checkpoint(config, root / name, tokenizer_model)
    return dirs


def convert_to_gguf(jobs: list[tuple], prelude: str = "") -> None:
    """Each (Hugging Face directory, .gguf[, outtype]) of `jobs` written by llama.cpp's
    convert_hf_to_gguf.py (outtype f32 unless given), in one process that first runs
    `prelude` (code that adjusts the converter for a test's vocabulary); skips the test where
    the converter is not here."""
    sys.path.insert(0, str(REPO / "scripts"))
    import peer

    try:
        script = peer.source_dir(download=False) / "convert_hf_to_gguf.py"
    except peer.PeerError as e:
        pytest.skip(f"llama.cpp's converter is not here ({e})")
    jobs = [(str(src), str(out), rest[0] if rest else "f32") for src, out, *rest in jobs]
    code = ("import runpy, sys\n"
            f"sys.path.insert(0, {str(script.parent)!r})  # its conversion package\n"
            + prelude +
            f"for src, out, t in {jobs!r}:\n"
            f"    sys.argv = [{str(script)!r}, src, '--outfile', out, '--outtype', t]\n"
            f"    runpy.run_path(sys.argv[0], run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", code], env=peer.convert_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="module")
def ggufs(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """name -> fp32 GGUF written by llama.cpp's convert_hf_to_gguf.py (one process for all)."""
    root = tmp_path_factory.mktemp("gguf")
    names = [n for n, (_, convertible) in configs().items() if convertible]
    convert_to_gguf([(checkpoints[n], root / f"{n}.gguf") for n in names])
    return {n: root / f"{n}.gguf" for n in names}


def prompt() -> tuple[int, ...]:
    return tuple(random.Random(1).choices(range(3, 320), k=PROMPT_LEN))


@functools.cache
@torch.no_grad()
def transformers_greedy(path: Path, ids: tuple[int, ...], n: int,
                        auto: str = "AutoModelForCausalLM") -> tuple[list[int], list[float]]:
    """Greedy through transformers' own KV cache, one token per step (as generate() would,
    without its EOS handling): the tokens and their log-probabilities. Eager attention: the
    only one that soft-caps scores. `auto`: the transformers class that loads the whole
    checkpoint (AutoModelForImageTextToText for a vision-language one, fed text alone)."""
    import transformers

    model = getattr(transformers, auto).from_pretrained(path, dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    out = model(input_ids=torch.tensor([list(ids)]), use_cache=True)
    tokens, logprobs = [], []
    while True:
        lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        tokens.append(int(lp.argmax()))
        logprobs.append(lp[tokens[-1]].item())
        if len(tokens) == n:
            return tokens, logprobs
        out = model(input_ids=torch.tensor([tokens[-1:]]), cache=out.past_key_values,
                    use_cache=True)


def qserve_greedy(model: Path, ids: tuple[int, ...], n: int) -> tuple[list[int], list[float]]:
    # K/V in fp32 as transformers keeps them (an F16 file would get fp16 K/V by default)
    llm = LLM(str(model), kv_cache_memory="16MiB", max_model_len=256, block_size=4,
              kv_dtype="fp32")
    [out] = llm.generate([list(ids)], SamplingParams(temperature=0, max_tokens=n,
                                                     ignore_eos=True, logprobs=1))
    tokens = out.outputs[0].token_ids
    return tokens, [lp[t] for t, lp in zip(tokens, out.outputs[0].logprobs)]


def check(model: Path, checkpoint: Path, auto: str = "AutoModelForCausalLM") -> None:
    ids = prompt()
    ref_tokens, ref_logprobs = transformers_greedy(checkpoint, ids, NEW_TOKENS, auto)
    tokens, logprobs = qserve_greedy(model, ids, NEW_TOKENS)
    assert tokens == ref_tokens
    # Greedy tokens alone cannot see a final soft-cap (tanh keeps the order) and barely see
    # the attention's; the log-probabilities do. fp32 on both sides: differences come from
    # summation order alone, around 1e-6 on these small activations.
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)


@pytest.mark.parametrize("name", list(configs()))
def test_safetensors_greedy_equals_transformers(name, checkpoints):
    check(checkpoints[name], checkpoints[name])


@pytest.mark.parametrize("name", [n for n, (_, gguf) in configs().items() if gguf])
def test_gguf_greedy_equals_transformers(name, checkpoints, ggufs):
    check(ggufs[name], checkpoints[name])


# --- the registry: what a checkpoint holds comes from the model ------------------------------

def test_checkpoint_layout_comes_from_the_model(checkpoints, tmp_path):
    """The tensors transformers saved are exactly the ones the meta-built model asks for, the
    parameter count is theirs, and a qserve checkpoint's config.json reads back the same."""
    assert_layout_comes_from_the_model(checkpoints, tmp_path)


@pytest.mark.parametrize("original", [0, 1])
def test_gguf_longrope_without_an_original_context_is_one_line(original, ggufs, tmp_path):
    """A Phi-3 GGUF whose original context is 0 or 1 (longrope divides by its log) is refused
    in one line; it had raised ZeroDivisionError."""
    import re
    import shutil

    from qserve.errors import ModelLoadError
    from qserve.loader import load_arch
    from test_loader import _patch_metadata

    path = tmp_path / "phi3.gguf"
    shutil.copy(ggufs["phi3-longrope"], path)
    _patch_metadata(path, "phi3.rope.scaling.original_context_length", original)
    with pytest.raises(ModelLoadError, match=rf"^{re.escape(str(path))}: metadata key phi3\.rope"
                                             rf"\.scaling\.original_context_length is {original}; "
                                             r"longrope scaling needs the original context, an "
                                             r"integer of at least 2$"):
        load_arch(path)


def test_unsupported_architecture_is_one_line(tmp_path):
    import json

    from qserve.errors import ModelLoadError
    from qserve.loader import load_arch

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    with pytest.raises(ModelLoadError, match=r"model_type 'deepseek_v3' is not supported; qserve "
                                             r"runs llama, mistral, qwen2, ministral3, qwen3, "
                                             r"phi3, gemma2, "
                                             r"gemma3_text, mixtral, qwen3_moe, smollm3, "
                                             r"granite, gpt_oss, and the "
                                             r"language model of gemma3, mistral3, llava, "
                                             r"qwen2_vl, qwen2_5_vl, qwen3_vl checkpoints$"):
        load_arch(tmp_path)


@pytest.mark.parametrize("change, message", [
    ("drop", "missing tensor model.layers.1.self_attn.k_norm.weight"),
    ("shape", r"tensor model.layers.1.self_attn.k_norm.weight has shape \(16,\), expected \(32,\) "
              r"from the model's config"),
])
def test_tensor_that_disagrees_with_the_config_is_named(checkpoints, tmp_path, change, message):
    import shutil

    from safetensors.torch import load_file, save_file

    from qserve.errors import ModelLoadError
    from qserve.loader import load_model

    shutil.copytree(checkpoints["qwen3"], tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    bad = "model.layers.1.self_attn.k_norm.weight"
    if change == "drop":
        del tensors[bad]
    else:
        tensors[bad] = tensors[bad][:16]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=message):
        load_model(tmp_path)


@pytest.mark.parametrize("name", list(configs()))
def test_int4_kv_calibrates_for_every_family(name, checkpoints):
    """int4 KV calibrates its key codebook through each family's own rope (Phi-3's partial
    rotation and longrope, Gemma 3's local base on sliding layers) and then serves."""
    llm = LLM(str(checkpoints[name]), kv_cache_memory="16MiB", max_model_len=256,
              block_size=16, kv_dtype="int4")
    widths = llm.engine.cache_engine.codebooks[0]["k_width"]  # (hkv, head_dim)
    assert widths.float().mean().item() == pytest.approx(4.0)  # 4 bits a channel on average
    [out] = llm.generate([list(prompt())], SamplingParams(temperature=0, max_tokens=8,
                                                          ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 8


def test_ministral3_keeps_its_temperature_through_a_checkpoint_not_a_gguf(checkpoints, tmp_path):
    """A quantized checkpoint writes the temperature where transformers keeps it (the rope's
    parameters) and reads it back; GGUF export, which would write a plain llama, refuses."""
    from qserve.errors import QServeError
    from qserve.loader import load_arch
    from qserve.quant.quantize import quantize

    src = checkpoints["ministral3"]
    quantize(str(src), tmp_path / "w8", recipe="w8")
    back = load_arch(tmp_path / "w8")
    assert (back.attn_temperature_beta, back.attn_temperature_length) == (0.1, 8)
    assert back.rope_scaling["rope_type"] == "yarn"
    with pytest.raises(QServeError, match=r"GGUF export: an attention temperature \(Ministral "
                                          r"3's\), which llama.cpp would run differently"):
        quantize(str(src), tmp_path / "m.gguf", recipe="w4g32", fmt="gguf")
    assert not (tmp_path / "m.gguf").exists()
