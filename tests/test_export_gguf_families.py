"""`qserve quantize --format gguf` for the families beyond Llama/Qwen: Phi-3 (fused qkv and
gate_up), Gemma 2 and 3 (1 + w norms, soft-caps, sliding layers, a local rope base), SmolLM3
(every fourth layer without rope), Granite (four scales) and the mixtures Mixtral and Qwen3-MoE
(experts stacked into 3-D tensors, each in its GGML type).

Each tiny checkpoint is quantized with w4g32 (int4 g32 asym -> Q4_1) and exported; qserve
reads the export back with the same architecture and, bit for bit, the same codes, scales
and offsets; llama.cpp's llama-server, fed the same prompt ids, completes greedily as qserve
does on the export (skipped with its reason when native llama.cpp is not built). The
checkpoints use only what llama.cpp runs exactly as transformers does: no Phi-3 window or
longrope (llama.cpp ignores the window and picks long or short factors by context size, not
by position), Gemma's query_pre_attn_scalar equal to head_dim. What a GGUF cannot say is
refused in one line. A qserve checkpoint of a sentencepiece model (which keeps only its
tokenizer.json) exports a "llama" vocabulary that tokenizes as the checkpoint does.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np

import pytest
import torch

from qserve.errors import QServeError
from qserve.loader import load_arch, load_model
from qserve.quant.quantize import quantize
from test_export import (PROMPT, assert_same_greedy, llama_cpp_greedy, make_tiny, qserve_greedy,
                         recipe_file, same_weights)
from test_families import COMMON

pytestmark = pytest.mark.slow  # transformers writes the checkpoints


def configs() -> dict[str, object]:
    from transformers import (Gemma2Config, Gemma3TextConfig, GraniteConfig, MixtralConfig,
                              Phi3Config, Qwen3MoeConfig, SmolLM3Config)

    two = dict(COMMON, num_hidden_layers=2)
    gemma = dict(COMMON, head_dim=32, sliding_window=8, query_pre_attn_scalar=32)
    return {
        "phi3": Phi3Config(**two, sliding_window=None, partial_rotary_factor=0.75),
        "phi3-longrope": Phi3Config(
            **two, sliding_window=None, original_max_position_embeddings=32,
            rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5,
                                                                     1.2, 1.4],
                          "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 13.0, 2.5, 4.0]}),
        "gemma2": Gemma2Config(**gemma, num_hidden_layers=3, attn_logit_softcapping=1.5,
                               final_logit_softcapping=5.0),
        "gemma3": Gemma3TextConfig(**gemma, num_hidden_layers=6, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        "gemma3-layers": Gemma3TextConfig(  # not llama.cpp's five-to-one: written as a list
            **gemma, num_hidden_layers=3, layer_types=[
                "sliding_attention", "full_attention", "sliding_attention"]),
        "mixtral": MixtralConfig(**two | {"intermediate_size": 96}, num_local_experts=4,
                                 num_experts_per_tok=2),
        "qwen3_moe": Qwen3MoeConfig(**two, head_dim=32, moe_intermediate_size=64, num_experts=4,
                                    num_experts_per_tok=2, norm_topk_prob=True),
        "smollm3": SmolLM3Config(**COMMON, num_hidden_layers=8),  # no rope in layers 3, 7
        "granite": GraniteConfig(**two, embedding_multiplier=6.0, residual_multiplier=0.3,
                                 attention_multiplier=0.04, logits_scaling=4.0),
        # refused: llama.cpp cannot say these
        "smollm3-layers": SmolLM3Config(**two, no_rope_layers=[0, 1]),
        "gemma2-scalar": Gemma2Config(**gemma | {"query_pre_attn_scalar": 24},
                                      num_hidden_layers=2),
        "gemma2-nowindow": Gemma2Config(**gemma | {"sliding_window": None},
                                        num_hidden_layers=2),
        "qwen3_moe-unnormed": Qwen3MoeConfig(**two, head_dim=32, moe_intermediate_size=64,
                                             num_experts=4, num_experts_per_tok=2,
                                             norm_topk_prob=False),
    }


RUN = ["phi3", "gemma2", "gemma3", "gemma3-layers", "mixtral", "qwen3_moe",  # llama.cpp runs
       "smollm3", "granite"]
# these exactly (Phi-3 longrope: it picks long or short factors by context size)
READ_BACK = RUN + ["phi3-longrope"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """name -> HF directory of a random-init model with tests/test_export.py's byte-level BPE
    vocabulary (llama.cpp loads no sentencepiece vocabulary without a newline byte token)."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("export-families")
    vocab = make_tiny(root / "vocab", "llama")
    dirs = {}
    for name, config in configs().items():
        config.vocab_size = Tokenizer.from_file(str(vocab / "tokenizer.json")).get_vocab_size()
        config.bos_token_id, config.eos_token_id = 0, 1  # <s>, </s>
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # norms and biases away from their init
            for p in model.parameters():
                if p.ndim == 1:
                    p.add_(torch.randn_like(p) * 0.3)
        path = root / name
        model.save_pretrained(path)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (path / f).write_bytes((vocab / f).read_bytes())
        dirs[name] = path
    return dirs


@pytest.fixture(scope="module")
def exports(checkpoints, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (w4g32 qserve checkpoint, its GGUF export), made once."""
    root, made = tmp_path_factory.mktemp("gguf"), {}
    for name in READ_BACK:
        # general.name is the directory's: llama.cpp gives a model named "phi3" Phi-3's own
        # special tokens, which this vocabulary lacks
        ckpt, out = root / f"tiny-{name.replace('phi3', 'phi')}", root / f"{name}.gguf"
        quantize(str(checkpoints[name]), ckpt, "w4g32")
        quantize(str(ckpt), out, "w4g32", fmt="gguf")
        made[name] = ckpt, out
    return made


def fp32(value):
    """Every float in a nested structure rounded to fp32, as GGUF metadata stores them."""
    if isinstance(value, float):
        return float(np.float32(value))
    if isinstance(value, dict):
        return {k: fp32(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [fp32(v) for v in value]
    return value


@pytest.mark.parametrize("name", READ_BACK)
def test_export_reads_back_bit_for_bit(name, exports):
    import gguf

    ckpt, out = exports[name]
    assert fp32(asdict(load_arch(out))) == fp32(asdict(load_arch(ckpt)))
    ours, theirs = load_model(ckpt).weights, load_model(out).weights
    if name.startswith("gemma"):  # stored as 1 + w: what the norm multiplies by is the same
        ours, theirs = (
            {k: (1 + w.float() if k.endswith("norm.weight") else w) for k, w in ws.items()}
            for ws in (ours, theirs))
    same_weights(ours, theirs)
    reader = gguf.GGUFReader(out)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.1.ffn_down.weight" if "exps" not in str(types) else
                 "blk.1.ffn_down_exps.weight"] == "Q4_1"
    if load_arch(ckpt).num_experts:  # one 3-D tensor per layer and kind: (E, out, in)
        [exps] = [t for t in reader.tensors if t.name == "blk.0.ffn_gate_exps.weight"]
        E, inter = load_arch(ckpt).num_experts, load_arch(ckpt).moe_intermediate_size
        assert [int(d) for d in exps.shape] == [64, inter, E]


def clear_prompt(model: Path) -> list[int]:
    """Of a few rotations of PROMPT, the one whose first 4 greedy steps (qserve on `model`)
    are furthest from a tie: these random models' top tokens are often within 0.05 nats, which
    int8 activations summed in another order may flip at the first step."""
    from qserve import LLM, SamplingParams

    llm = LLM(str(model), kv_cache_memory="8MiB", max_model_len=128, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(0, len(PROMPT), 2)]

    def margin(out) -> float:
        return min(float(np.subtract(*sorted(lp.values(), reverse=True)[:2]))
                   for lp in out.outputs[0].logprobs)
    return max(zip(llm.generate(prompts, params), prompts), key=lambda op: margin(op[0]))[1]


@pytest.mark.parametrize("name", RUN)
def test_llama_cpp_completes_the_export_as_qserve(name, exports):
    _, out = exports[name]
    prompt = clear_prompt(out)
    assert_same_greedy(llama_cpp_greedy(out, prompt, 16), qserve_greedy(out, prompt, 16), 4)


@pytest.mark.parametrize("recipe, ggml_type", [("w4g32-sym", "Q4_0"), ("w8g32", "Q8_0")])
def test_experts_export_in_every_lossless_type(recipe, ggml_type, checkpoints, tmp_path):
    """Mixtral's stacked experts as Q4_0 and Q8_0 blocks: read back bit for bit, and llama.cpp
    completes them as qserve does."""
    import gguf

    ckpt, out = tmp_path / "tiny-mixtral", tmp_path / "m.gguf"
    quantize(str(checkpoints["mixtral"]), ckpt, recipe_file(tmp_path, recipe))
    quantize(str(ckpt), out, recipe_file(tmp_path, recipe), fmt="gguf")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert {types[f"blk.1.ffn_{k}_exps.weight"] for k in ("gate", "up", "down")} == {ggml_type}
    same_weights(load_model(ckpt).weights, load_model(out).weights)
    prompt = clear_prompt(out)
    assert_same_greedy(llama_cpp_greedy(out, prompt, 16), qserve_greedy(out, prompt, 16), 4)


@pytest.mark.parametrize("name, message", [
    ("gemma2-scalar", r"^GGUF export: query_pre_attn_scalar 24 \(llama\.cpp takes 32 for this "
                      r"shape\), which llama\.cpp would run differently; this model is not "
                      r"exported$"),
    ("gemma2-nowindow", r"^GGUF export: Gemma 2 without a sliding window \(llama\.cpp then "
                        r"slides 4096\), which"),
    ("qwen3_moe-unnormed", r"^GGUF export: norm_topk_prob false \(llama\.cpp always "
                           r"renormalizes the chosen experts\), which"),
    ("smollm3-layers", r"^GGUF export: layers without rope other than every fourth \(llama\.cpp's "
                       r"fixed SmolLM3 step\), which"),
])
def test_what_llama_cpp_cannot_say_is_refused(name, message, checkpoints, tmp_path):
    with pytest.raises(QServeError, match=message):
        quantize(str(checkpoints[name]), tmp_path / "m.gguf", "w4g32", fmt="gguf")
    assert not list(tmp_path.iterdir())


def test_gguf_architecture_comes_from_the_family():
    """The llama.cpp architecture each model_type exports as is read off its family's
    declaration (as convert_hf_to_gguf.py names them), and reads back as the same model_type
    (a Mistral GGUF says llama: it reads back as Llama). Ministral 3 is not exported (its
    attention temperature is refused: test_families.py); its name here is the family's."""
    from qserve.models.registry import FAMILIES, gguf_architecture, gguf_family, supported

    assert {t: gguf_architecture(t) for t in supported()} == {
        "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "ministral3": "llama",
        "qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3",
        "mixtral": "llama", "qwen3_moe": "qwen3moe", "smollm3": "smollm3",
        "granite": "granite", "gpt_oss": "gpt-oss"}
    for family in FAMILIES:
        for t in family.model_types:
            got, model_type = gguf_family(gguf_architecture(t), 8 if family.moe else 0)
            llama = t in ("mistral", "ministral3")
            assert got is family and model_type == ("llama" if llama else t)


def test_cli_refusal_is_one_line(checkpoints, tmp_path):
    import subprocess
    import sys

    env = {"QSERVE_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    out = tmp_path / "x.gguf"
    r = subprocess.run([sys.executable, "-m", "qserve", "quantize",
                        str(checkpoints["qwen3_moe-unnormed"]), "-o", str(out), "--format",
                        "gguf", "-r", "w4g32"], capture_output=True, text=True, env=env,
                       cwd=Path(__file__).resolve().parent.parent, timeout=300)
    assert r.returncode != 0 and r.stderr.startswith("error: GGUF export: norm_topk_prob false")
    assert r.stderr.count("\n") == 1 and not out.exists()


# ---- a sentencepiece vocabulary kept as tokenizer.json -----------------------------------
TEXTS = ["kalo mine tura\nsivo", "depa quzi  ka\n\nlo"]


@pytest.fixture(scope="module")
def spm_dirs(tmp_path_factory) -> dict[str, Path]:
    """family -> HF directory whose vocabulary is a sentencepiece BPE tokenizer.model with byte
    fallback (llama.cpp needs a newline token; the converter reads tokenizer.model for these
    families), norms randomized."""
    import random

    import sentencepiece
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("spm")
    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "tu", "ra", "si", "vo", "de", "pa", "qu", "zi"]
    (root / "corpus.txt").write_text("\n".join(
        " ".join("".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(12))
        for _ in range(2000)))
    sentencepiece.SentencePieceTrainer.train(
        input=str(root / "corpus.txt"), model_prefix=str(root / "tok"), vocab_size=400,
        model_type="bpe", character_coverage=1.0, byte_fallback=True, bos_id=1, eos_id=2,
        unk_id=0, minloglevel=2)
    dirs = {}
    for name in ("phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe"):
        config = configs()[name]
        config.vocab_size, config.bos_token_id, config.eos_token_id = 400, 1, 2
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1:
                    p.add_(torch.randn_like(p) * 0.3)
        dirs[name] = root / name
        model.save_pretrained(dirs[name])
        (dirs[name] / "tokenizer.model").write_bytes((root / "tok.model").read_bytes())
    return dirs


@pytest.fixture(scope="module")
def spm_checkpoint(spm_dirs, tmp_path_factory) -> Path:
    """The Gemma 2 quantized to a qserve checkpoint, which keeps the vocabulary only as
    tokenizer.json."""
    out = tmp_path_factory.mktemp("spm-ckpt") / "tiny-spm"
    quantize(str(spm_dirs["gemma2"]), out, "w4g32")
    assert not (out / "tokenizer.model").exists()
    return out


def test_sentencepiece_tokenizer_json_exports_as_llama_vocabulary(spm_checkpoint, tmp_path):
    """The export's "llama" vocabulary (scores from the merge order) tokenizes as the
    checkpoint does, in qserve and in llama.cpp (the same greedy completion of the text)."""
    import gguf

    out = tmp_path / "m.gguf"
    quantize(str(spm_checkpoint), out, "w4g32", fmt="gguf")
    fields = gguf.GGUFReader(out).fields
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    ours, theirs = load_model(spm_checkpoint).tokenizer, load_model(out).tokenizer
    for text in TEXTS:
        ids = ours.encode(text)
        assert len(ids) > 4 and theirs.encode(text) == ids
        assert theirs.decode(ids) == ours.decode(ids)
    for text in TEXTS:
        assert_same_greedy(llama_cpp_greedy(out, text, 8),
                           qserve_greedy(out, ours.encode(text), 8), 2)


# ---- the converter's own files, exported again ---------------------------------------------
# Keys a re-export may differ in: names and size labels the converter derives from the source
# directory, the vocabulary size and defaults it leaves out, Phi-3's original context (read
# only beside longrope factors, which these checkpoints have none of)
NAMING_KEYS = {"general.name", "general.size_label", "general.type", "GGUF.kv_count"}


@pytest.fixture(scope="module")
def converter_q8_0(spm_dirs, tmp_path_factory) -> dict[str, Path]:
    """family -> the Q8_0 GGUF llama.cpp's convert_hf_to_gguf.py writes (one process)."""
    import subprocess
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import peer

    try:
        script = peer.source_dir(download=False) / "convert_hf_to_gguf.py"
    except peer.PeerError as e:
        pytest.skip(f"llama.cpp's converter is not here ({e})")
    root = tmp_path_factory.mktemp("converter")
    jobs = [(str(path), str(root / f"{name}.gguf")) for name, path in spm_dirs.items()]
    # the converter reads Qwen3-MoE's vocabulary as GPT-2 BPE only: read it as dense Qwen3's
    code = ("import runpy, sys\n"
            f"sys.path.insert(0, {str(script.parent)!r})  # its conversion package\n"
            "import conversion.qwen as qwen\n"
            "qwen.Qwen3MoeModel.set_vocab = lambda self: self._set_vocab_sentencepiece()\n"
            f"for src, out in {jobs!r}:\n"
            f"    sys.argv = [{str(script)!r}, src, '--outfile', out, '--outtype', 'q8_0']\n"
            f"    runpy.run_path(sys.argv[0], run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", code], env=peer.convert_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return {Path(out).stem: Path(out) for _, out in jobs}


@pytest.mark.parametrize("name", ["phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe"])
def test_converter_q8_0_file_exports_byte_for_byte(name, converter_q8_0, tmp_path):
    """A Q8_0 GGUF written by llama.cpp's convert_hf_to_gguf.py, exported by qserve with the
    gguf-native recipe, holds every tensor byte for byte (Gemma's 1 + w norms, Mixtral's and
    Qwen3-MoE's stacked experts included) and every key the converter wrote, with its value."""
    import gguf

    theirs, ours = converter_q8_0[name], tmp_path / "qserve.gguf"
    quantize(str(theirs), ours, "gguf-native", fmt="gguf")
    a, b = gguf.GGUFReader(theirs), gguf.GGUFReader(ours)
    mine = {t.name: t for t in b.tensors}
    assert sorted(mine) == sorted(t.name for t in a.tensors)
    for x in a.tensors:
        y = mine[x.name]
        assert x.tensor_type == y.tensor_type and np.array_equal(x.data, y.data), x.name
    expected_missing = NAMING_KEYS | {"phi3.rope.scaling.original_context_length"}
    for key, field in a.fields.items():
        if key not in expected_missing:
            assert key in b.fields and b.fields[key].contents() == field.contents(), key
