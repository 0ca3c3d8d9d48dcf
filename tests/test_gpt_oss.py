"""gpt-oss against transformers, on tiny random checkpoints that transformers itself writes:
attention sinks, biases on every projection, a sliding window on every other layer, YaRN
without truncation, a mixture of experts with a biased router and biased experts whose
clamped SwiGLU the weights drive past its limit, and the experts stacked as transformers saves
them (gate and up columns interleaved, each matrix transposed).

Greedy tokens through the paged engine equal transformers' greedy loop token for token, from
the safetensors directory and from the GGUFs llama.cpp's convert_hf_to_gguf.py makes of it
(F32, F16: the weights are fp16 values, so F16 loses nothing). gpt-oss's converter reads a
GPT-2 style tokenizer.json, so these checkpoints carry a tiny byte-level BPE vocabulary.
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from hf_reference import assert_layout_comes_from_the_model
from qserve import LLM, SamplingParams
from test_families import NEW_TOKENS, check, convert_to_gguf, prompt
from test_moe import ENGINE_FEATURES, check_engine_features

VOCAB = 320


def configs() -> dict[str, tuple[object, bool]]:
    """name -> (transformers config, whether llama.cpp's GGUF can express it)."""
    from transformers import GptOssConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, tie_word_embeddings=False, initializer_range=0.15)
    yarn = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 150000.0}
    return {
        # a window of 8 over 36 positions; experts 96 wide (not hidden: a transposed expert
        # cannot load; whole MXFP4 blocks)
        "gpt_oss": (GptOssConfig(**common, num_hidden_layers=4, intermediate_size=96,
                                 num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                 rope_parameters=yarn), True),
        # top 3 of 6
        "gpt_oss-top3": (GptOssConfig(**common, num_hidden_layers=2, intermediate_size=32,
                                      num_local_experts=6, num_experts_per_tok=3,
                                      sliding_window=5, rope_parameters=yarn), True),
        # the config's own limit and alpha: llama.cpp fixes them (7.0, 1.702), safetensors only
        "gpt_oss-clamp": (GptOssConfig(**common, num_hidden_layers=2, intermediate_size=32,
                                       num_local_experts=4, num_experts_per_tok=2,
                                       sliding_window=5, rope_parameters=yarn, swiglu_limit=3.0,
                                       swiglu_alpha=1.2), False),
    }


def write_bpe_tokenizer(path: Path) -> None:
    """A 320-token byte-level BPE (GPT-2 style) tokenizer trained on seeded nonsense words,
    saved as transformers saves one (tokenizer.json, tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "tu", "ra", "si", "vo", "de", "pa", "qu", "zi"]
    lines = [" ".join("".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(12))
             for _ in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|pad|>", "<|start|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|start|>",
                            eos_token="<|end|>").save_pretrained(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """name -> Hugging Face directory of a random-init model whose weights are fp16 values,
    biases randomized, sinks around the scores' own size (so they take a real share of each
    softmax) and the experts' gate/up weights large enough that the clamps bite."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gpt_oss")
    dirs = {}
    for name, (config, _) in configs().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("sinks"):
                    p.copy_(torch.randn_like(p) * 2)
                elif "experts.gate_up_proj" in pname:
                    p.copy_(torch.randn_like(p) * (1.0 if pname.endswith("bias") else 0.6))
                elif p.ndim == 1:
                    p.add_(torch.randn_like(p) * 0.3)
                p.copy_(p.half().float())
        path = root / name
        model.save_pretrained(path)
        write_bpe_tokenizer(path)
        dirs[name] = path
    return dirs


def test_clamps_bite(checkpoints):
    """The checkpoints drive some expert's gate past the limit (else the clamp would go
    untested): layer 0's experts over random hidden states."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoints["gpt_oss"], dtype=torch.float32)
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    gate_up = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert (gate_up[:, ::2] > experts.limit).any() and (gate_up[:, 1::2].abs() > experts.limit).any()


@pytest.mark.parametrize("name", list(configs()))
def test_safetensors_greedy_equals_transformers(name, checkpoints):
    check(checkpoints[name], checkpoints[name])


# The converter names a BPE vocabulary's pre-tokenizer by a hash of how it splits a test text,
# and refuses one it does not know: the tiny vocabulary is written under gpt-oss's own
# ("gpt-4o"), which llama.cpp would apply; the tests' prompts are token ids.
GPT_4O = ("from conversion.base import TextModel\n"
          "TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-4o'\n")


@pytest.fixture(scope="module")
def ggufs(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """'<name>-f32' / '<name>-f16' -> the GGUF convert_hf_to_gguf.py writes."""
    root = tmp_path_factory.mktemp("gpt_oss-gguf")
    jobs = [(checkpoints[n], root / f"{n}-{t}.gguf", t)
            for n, (_, convertible) in configs().items() if convertible for t in ("f32", "f16")]
    convert_to_gguf(jobs, GPT_4O)
    return {out.stem: out for _, out, _ in jobs}


@pytest.mark.parametrize("kind", ["f32", "f16"])
@pytest.mark.parametrize("name", [n for n, (_, gguf) in configs().items() if gguf])
def test_gguf_greedy_equals_transformers(name, kind, checkpoints, ggufs):
    check(ggufs[f"{name}-{kind}"], checkpoints[name])


def test_gguf_reads_the_same_arch(checkpoints, ggufs):
    """The GGUF's metadata gives the arch config.json does (its rms_norm_eps is an fp32)."""
    import dataclasses

    from qserve.loader import load_arch

    for name in ("gpt_oss", "gpt_oss-top3"):
        hf, gguf = load_arch(checkpoints[name]), load_arch(ggufs[f"{name}-f32"])
        assert hf.attention_sinks and hf.swiglu_limit == 7.0 and hf.layer_types[:2] == [
            "sliding_attention", "full_attention"]
        assert dataclasses.replace(gguf, rms_norm_eps=hf.rms_norm_eps) == hf


# --- what a checkpoint holds --------------------------------------------------------------

def test_stacked_experts_are_read_as_the_model_asks(checkpoints, tmp_path):
    """transformers' stacked tensors give exactly the per-expert tensors the meta-built model
    asks for, holding all their values (the parameter count is the file's), and a qserve
    checkpoint's config.json reads back the same arch."""
    from safetensors import safe_open

    for path in checkpoints.values():
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            assert any(".experts.gate_up_proj" in k for k in f.keys())  # stacked, as saved
    assert_layout_comes_from_the_model(checkpoints, tmp_path)


def stacked_copy(checkpoint: Path, weights, out: Path) -> None:
    """A Hugging Face directory of `checkpoint`'s config with `weights` (per-expert names, as
    qserve reads them) dequantized to fp32 and stacked back as transformers keeps experts:
    the reference for a quantized checkpoint."""
    import shutil

    from safetensors.torch import save_file

    from qserve.formats import QuantizedTensor

    def dense(name: str) -> torch.Tensor:
        w = weights[name]
        return (w.dequantize() if isinstance(w, QuantizedTensor) else w).float()

    tensors, stacks = {}, {}
    for name in weights:
        if ".experts." not in name:
            tensors[name] = dense(name)
            continue
        prefix, e, proj, param = re.match(r"(.*\.experts)\.(\d+)\.(\w+)\.(\w+)$", name).groups()
        stacks.setdefault(prefix, {})[(int(e), proj, param)] = dense(name)
    for prefix, parts in stacks.items():
        E = 1 + max(e for e, _, _ in parts)
        gate_up, gate_up_bias, down, down_bias = [], [], [], []
        for e in range(E):
            g, u = parts[e, "gate_proj", "weight"], parts[e, "up_proj", "weight"]  # (I, H)
            gate_up.append(torch.stack([g.t(), u.t()], dim=-1).flatten(-2))  # (H, 2I) interleaved
            gate_up_bias.append(torch.stack([parts[e, "gate_proj", "bias"],
                                             parts[e, "up_proj", "bias"]], dim=-1).flatten())
            down.append(parts[e, "down_proj", "weight"].t())  # (I, H)
            down_bias.append(parts[e, "down_proj", "bias"])
        for suffix, rows in (("gate_up_proj", gate_up), ("gate_up_proj_bias", gate_up_bias),
                             ("down_proj", down), ("down_proj_bias", down_bias)):
            tensors[f"{prefix}.{suffix}"] = torch.stack(rows).contiguous()
    out.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        if (checkpoint / f).exists():
            shutil.copy(checkpoint / f, out / f)


def test_w4_recipe_quantizes_every_expert(checkpoints, tmp_path, monkeypatch):
    """`qserve quantize` with an int4 recipe packs each expert's linears (biases kept), and
    the checkpoint's greedy tokens (fp32 activations) are transformers' on its weights,
    dequantized and stacked back."""
    from qserve.loader import load_model
    from qserve.quant.quantize import quantize

    quantize(str(checkpoints["gpt_oss"]), tmp_path / "q", "w4g32")
    quant = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert len([n for n in quant["layers"] if ".experts." in n]) == 4 * 4 * 3  # layers x E x 3
    monkeypatch.setenv("QSERVE_CPU_ACTIVATIONS", "fp32")
    llm = LLM(str(tmp_path / "q"), kv_cache_memory="16MiB", max_model_len=256, block_size=4,
              kv_dtype="fp32")
    expert = llm.engine.model.layers[0].mlp.experts[3]
    assert [f.removesuffix("_x16") for f in expert.gate_up_proj.formats] == ["int4"]
    stacked_copy(checkpoints["gpt_oss"], load_model(tmp_path / "q").weights, tmp_path / "ref")
    check(tmp_path / "q", tmp_path / "ref")


# --- the engine ---------------------------------------------------------------------------

def test_decode_runs_the_cpu_kernel_with_sinks(checkpoints, monkeypatch):
    """A decode step's attention is the C kernel's, handed each layer's sinks (not the
    reference's), where the kernels built."""
    from qserve.kernels import cpu_ops

    if cpu_ops.lib() is None:
        pytest.skip("the CPU kernels did not build here")
    seen = []
    kernel = cpu_ops.paged_decode

    def spy(q, cache, tables, lens, scale, window, sinks=None):
        seen.append((window, None if sinks is None else sinks.tolist()))
        return kernel(q, cache, tables, lens, scale, window, sinks)

    monkeypatch.setattr(cpu_ops, "paged_decode", spy)
    llm = LLM(str(checkpoints["gpt_oss"]), kv_cache_memory="16MiB", max_model_len=256)
    llm.generate([list(prompt())], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    layers = llm.engine.model.layers
    want = [(layer.self_attn.window, layer.self_attn.sinks.tolist()) for layer in layers]
    assert seen == want  # one decode step, every layer, its own window and sinks


@pytest.mark.parametrize("options", ENGINE_FEATURES, ids=["recompute", "swap", "ngram-draft"])
def test_batched_engine_features_keep_greedy_tokens(options, checkpoints):
    """Batched decode (the kernel's sinks over several sequences), prefix hits (a chunk that
    attends to cached context), both preemption modes under a KV pool too small for the
    batch, and speculative verification give each prompt its solo greedy tokens. This random
    model does not copy its prompt, so its drafts are rejected: the rejected positions' K/V
    must not change what follows."""
    check_engine_features(checkpoints["gpt_oss"], options, drafts_accepted=False)


# --- OpenAI's MXFP4 release format ----------------------------------------------------------

def ocp_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., out, in) weights -> (blocks (..., out, in / 32, 16), scales (..., out, in / 32))
    uint8 as OpenAI's checkpoints store MXFP4: gguf-py's quantizer's codes and exponents, each
    byte holding inputs 2j (low nibble) and 2j + 1."""
    import gguf.quants

    *lead, out, n_in = w.shape
    rows = torch.from_numpy(gguf.quants.quantize(w.reshape(-1, n_in).numpy(),
                                                 gguf.GGMLQuantizationType.MXFP4))
    blocks = rows.view(-1, n_in // 32, 17)  # GGML: e | 16 bytes, input j and j + 16 a byte
    codes = torch.cat([blocks[..., 1:] & 15, blocks[..., 1:] >> 4], dim=-1)  # inputs in order
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return (packed.reshape(*lead, out, n_in // 32, 16).contiguous(),
            blocks[..., 0].reshape(*lead, out, n_in // 32).contiguous())


@pytest.fixture(scope="module")
def mxfp4(checkpoints, tmp_path_factory) -> Path:
    """The gpt_oss checkpoint with its experts' matrices in MXFP4 as OpenAI ships gpt-oss
    (quantization_config quant_method "mxfp4"); everything else as it was."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, out = checkpoints["gpt_oss"], tmp_path_factory.mktemp("mxfp4") / "gpt_oss-mxfp4"
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # stored (E, in, out) for the experts' own matmul; MXFP4 as a linear's (E, out, in)
        blocks, scales = ocp_mxfp4(tensors.pop(name).transpose(1, 2))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


@torch.no_grad()
def transformers_mxfp4_greedy(path: Path, ids: tuple[int, ...], n: int) -> tuple[list, list]:
    """transformers' greedy loop on an MXFP4 checkpoint, which it dequantizes itself."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager",
        quantization_config=Mxfp4Config(dequantize=True)).eval()
    out = model(input_ids=torch.tensor([list(ids)]), use_cache=True)
    tokens, logprobs = [], []
    while len(tokens) < n:
        lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        tokens.append(int(lp.argmax()))
        logprobs.append(lp[tokens[-1]].item())
        out = model(input_ids=torch.tensor([tokens[-1:]]), cache=out.past_key_values,
                    use_cache=True)
    return tokens, logprobs


def test_mxfp4_checkpoint_runs_its_experts_natively(mxfp4, monkeypatch):
    """OpenAI's MXFP4 experts load as GGML MXFP4 rows (no dequantized copy), the plan counts
    them at 17 bytes a block, and the greedy tokens (fp32 activations) are transformers' on
    the same file, which dequantizes it."""
    from qserve.engine.memory_plan import resident_tensors
    from qserve.loader import load_arch

    monkeypatch.setenv("QSERVE_CPU_ACTIVATIONS", "fp32")
    llm = LLM(str(mxfp4), kv_cache_memory="16MiB", max_model_len=256, block_size=4,
              kv_dtype="fp32")
    for layer in llm.engine.model.layers:
        for expert in layer.mlp.experts:
            assert expert.gate_up_proj.formats == ["mxfp4"]
            assert expert.down_proj.formats == ["mxfp4"]
    arch = load_arch(mxfp4)
    planned = {name: (fmt, nbytes) for name, fmt, nbytes, _ in
               resident_tensors(mxfp4, arch, torch.float32, native=True)}
    assert planned["model.layers.0.mlp.experts.1.down_proj.weight"] == ("mxfp4", 64 * 96 // 32 * 17)
    [out] = llm.generate([list(prompt())], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                          ignore_eos=True, logprobs=1))
    tokens = out.outputs[0].token_ids
    ref_tokens, ref_logprobs = transformers_mxfp4_greedy(mxfp4, prompt(), NEW_TOKENS)
    assert tokens == ref_tokens
    logprobs = [lp[t] for t, lp in zip(tokens, out.outputs[0].logprobs)]
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)


def test_mxfp4_gguf_equals_the_checkpoint(mxfp4, tmp_path):
    """llama.cpp's converter keeps the MXFP4 experts as GGUF MXFP4 (its repack of OpenAI's
    layout); qserve reads them natively and generates the checkpoint's tokens."""
    import gguf

    out = tmp_path / "gpt_oss-mxfp4.gguf"
    convert_to_gguf([(mxfp4, out)], GPT_4O)
    reader = gguf.GGUFReader(str(out))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_down_exps.weight"] == types["blk.0.ffn_gate_exps.weight"] == "MXFP4"
    llm = LLM(str(out), kv_cache_memory="16MiB", max_model_len=256)
    assert llm.engine.model.layers[0].mlp.experts[0].down_proj.formats == ["mxfp4"]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    want = LLM(str(mxfp4), kv_cache_memory="16MiB", max_model_len=256).generate(
        [list(prompt())], params)[0].outputs[0].token_ids
    assert llm.generate([list(prompt())], params)[0].outputs[0].token_ids == want
