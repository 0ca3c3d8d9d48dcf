"""Mixtures of experts: Mixtral and Qwen3-MoE against transformers, on tiny random checkpoints
that transformers itself writes (6 and 8 experts, top-2 and top-3, two layers), and the sparse
MoE block (layers/moe.py) against a dense reference.

Greedy tokens through the paged engine equal transformers' greedy loop token for token, from
the safetensors directory and from GGUFs that llama.cpp's convert_hf_to_gguf.py makes of it
(F32 and F16: the checkpoints' weights are fp16 values, so F16 loses nothing), and from a
Q4_0 GGUF made by llama-quantize against transformers running that file's dequantized weights.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hf_reference import assert_layout_comes_from_the_model
from qserve import LLM, SamplingParams
from qserve.errors import ModelLoadError
from qserve.formats import QuantizedTensor
from qserve.layers.moe import SparseMoE, route
from qserve.layers.quant_linear import QuantLinear
from qserve.quant.schemes import WeightScheme, quantize as rtn
from test_families import (COMMON, NEW_TOKENS, check, convert_to_gguf, prompt,  # noqa: F401
                           qserve_greedy, tokenizer_model, transformers_greedy)

REPO = Path(__file__).resolve().parent.parent


def configs() -> dict[str, tuple[object, bool]]:
    """name -> (transformers config, whether llama.cpp's GGUF can express it)."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(COMMON, num_hidden_layers=2)
    return {
        # expert intermediate 96: not the hidden size, so a transposed expert cannot load
        "mixtral": (MixtralConfig(**common | {"intermediate_size": 96}, num_local_experts=6,
                                  num_experts_per_tok=2), True),
        "qwen3_moe": (Qwen3MoeConfig(**common, head_dim=32, moe_intermediate_size=64,
                                     num_experts=8, num_experts_per_tok=2,
                                     norm_topk_prob=True), True),
        # llama.cpp always renormalizes Qwen3-MoE's top-k weights: safetensors only
        "qwen3_moe-unnormed": (Qwen3MoeConfig(**common, head_dim=32, moe_intermediate_size=64,
                                              num_experts=8, num_experts_per_tok=3,
                                              norm_topk_prob=False), False),
    }


@pytest.fixture(scope="module")
def checkpoints(tokenizer_model, tmp_path_factory) -> dict[str, Path]:
    """name -> Hugging Face directory of a random-init model whose weights are fp16 values
    (an F16 GGUF of it is exact), norms randomized too."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe")
    dirs = {}
    for name, (config, _) in configs().items():
        config.vocab_size = 320
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1:
                    p.add_(torch.randn_like(p) * 0.3)
                p.copy_(p.half().float())
        path = root / name
        model.save_pretrained(path)
        (path / "tokenizer.model").write_bytes(tokenizer_model.read_bytes())
        dirs[name] = path
    return dirs


def _peer():
    sys.path.insert(0, str(REPO / "scripts"))
    import peer

    return peer


@pytest.fixture(scope="module")
def ggufs(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """'<name>-f32' / '<name>-f16' -> GGUF written by convert_hf_to_gguf.py (one process)."""
    root = tmp_path_factory.mktemp("moe-gguf")
    jobs = [(checkpoints[n], root / f"{n}-{t}.gguf", t)
            for n, (_, convertible) in configs().items() if convertible for t in ("f32", "f16")]
    # The converter reads Qwen3-MoE's vocabulary as GPT-2 BPE only, and refuses one whose
    # pre-tokenizer it does not know; these tests' prompts are token ids, so the shared
    # sentencepiece vocabulary stands in, read as it reads dense Qwen3's.
    convert_to_gguf(jobs, "import conversion.qwen as qwen\n"
                          "qwen.Qwen3MoeModel.set_vocab = lambda self: "
                          "self._set_vocab_sentencepiece()\n")
    return {out.stem: out for _, out, _ in jobs}


# --- the sparse block ---------------------------------------------------------------------

def test_route_normalizes_as_each_family_does():
    logits = torch.tensor([[1.0, 3.0, 0.5, 2.0], [0.0, -1.0, 4.0, 4.5]])
    w, ids = route(logits, 2, norm_topk_prob=True)
    assert ids.tolist() == [[1, 3], [3, 2]]
    # Mixtral: renormalizing the top-k of a softmax is the softmax of the top-k logits
    torch.testing.assert_close(w, torch.softmax(logits.gather(1, ids), dim=-1))
    w, ids = route(logits, 2, norm_topk_prob=False)  # Qwen3-MoE's default: plain probabilities
    torch.testing.assert_close(w, torch.softmax(logits, dim=-1).gather(1, ids))


class _Expert(nn.Module):
    """A gated MLP whose linears are int4 QuantLinears, counting the rows it is given."""

    def __init__(self, hidden: int, inter: int, gen: torch.Generator):
        super().__init__()
        scheme = WeightScheme(4, 32, False)
        self.gate_up = QuantLinear([rtn(torch.randn(2 * inter, hidden, generator=gen) * 0.2,
                                        scheme, 32)])
        self.down = QuantLinear([rtn(torch.randn(hidden, inter, generator=gen) * 0.2,
                                     scheme, 32)])
        # the weights as they run
        self.dense = [lin.segments[0].dequantize() for lin in (self.gate_up, self.down)]
        self.rows_seen = 0

    def forward(self, x):
        self.rows_seen += x.shape[0]
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)

    def reference(self, x):
        gate, up = (x @ self.dense[0].T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ self.dense[1].T


@pytest.mark.parametrize("T", [1, 2, 7, 40])  # 40 rows: past the kernels' decode-sized batch
@pytest.mark.parametrize("top_k, norm", [(2, True), (3, False)])
def test_sparse_moe_equals_dense_reference_and_runs_only_chosen_experts(T, top_k, norm):
    gen = torch.Generator().manual_seed(T)
    hidden, inter, E = 64, 96, 7
    experts = [_Expert(hidden, inter, gen) for _ in range(E)]
    gate = nn.Linear(hidden, E, bias=False)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(E, hidden, generator=gen))
    moe = SparseMoE(gate, experts, top_k, norm)
    x = torch.randn(T, hidden, generator=gen)
    out = moe(x)
    # reference: every expert on every token, weighted by the (dense) routing matrix
    w, ids = route(x @ gate.weight.T, top_k, norm)
    dense_w = torch.zeros(T, E).scatter_(1, ids, w)  # (T, E)
    ref = sum(dense_w[:, e:e + 1] * experts[e].reference(x) for e in range(E))
    # int4 weights dequantized on both sides; the C kernels may quantize activations to int8
    # per 32 inputs (about 1e-2 relative on a dot product): a few percent of the output's scale
    torch.testing.assert_close(out, ref, atol=3e-2 * ref.abs().max().item(), rtol=0)
    # each (token, choice) pair runs once, in the expert it picked; the others see no rows
    picked = torch.bincount(ids.flatten(), minlength=E).tolist()
    assert [e.rows_seen for e in experts] == picked


# --- families against transformers --------------------------------------------------------

@pytest.mark.parametrize("name", list(configs()))
def test_safetensors_greedy_equals_transformers(name, checkpoints):
    check(checkpoints[name], checkpoints[name])


@pytest.mark.parametrize("kind", ["f32", "f16"])
@pytest.mark.parametrize("name", [n for n, (_, gguf) in configs().items() if gguf])
def test_gguf_greedy_equals_transformers(name, kind, checkpoints, ggufs):
    check(ggufs[f"{name}-{kind}"], checkpoints[name])


def test_gguf_experts_keep_the_file_format(checkpoints, ggufs):
    """An F16 GGUF's stacked experts load as one f16 QuantLinear each, not widened to fp32."""
    llm = LLM(str(ggufs["qwen3_moe-f16"]), kv_cache_memory="16MiB", max_model_len=256)
    moe = llm.engine.model.layers[1].mlp
    assert isinstance(moe, SparseMoE) and len(moe.experts) == 8
    for expert in moe.experts:
        assert expert.gate_up_proj.formats == ["f16"] and expert.down_proj.formats == ["f16"]


@pytest.fixture(scope="module")
def q4_0(checkpoints, ggufs, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (a Q4_0 GGUF made by llama-quantize from the F32 one, a Hugging Face directory
    of its weights dequantized to fp32 by the gguf package: the transformers reference)."""
    from qserve.loader import load_model

    peer = _peer()
    try:
        tool = peer.llama_cpp_dir(build=False) / "build" / "bin" / "llama-quantize"
    except peer.PeerError:
        tool = None
    if tool is None or not tool.exists():
        pytest.skip("native llama.cpp is not built here (python scripts/peer.py builds it)")
    root, out = tmp_path_factory.mktemp("moe-q4"), {}
    for name in ("mixtral", "qwen3_moe"):
        gguf = root / f"{name}-q4_0.gguf"
        r = subprocess.run([str(tool), str(ggufs[f"{name}-f32"]), str(gguf), "Q4_0"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        ref = root / f"{name}-q4_0-dequantized"
        # the loader's native=False dequantizes with the gguf package and puts rows in HF order
        dequantized_copy(checkpoints[name], load_model(gguf, native=False).weights, ref)
        out[name] = gguf, ref
    return out


def dequantized_copy(checkpoint: Path, weights, out: Path) -> None:
    """A Hugging Face directory of `checkpoint`'s config with `weights` (HF names), each
    QuantizedTensor dequantized to fp32: what transformers runs as the reference."""
    from safetensors.torch import save_file

    out.mkdir()
    save_file({k: (w.dequantize() if isinstance(w, QuantizedTensor) else w).float().contiguous()
               for k, w in weights.items()}, str(out / "model.safetensors"))
    for f in ("config.json", "tokenizer.model"):
        shutil.copy(checkpoint / f, out / f)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_q4_0_gguf_greedy_equals_transformers_on_its_weights(name, q4_0, monkeypatch):
    """Q4_0 experts run as int4 through the kernels; with fp32 activations the tokens are
    transformers' on the same (dequantized) weights. With int8 activations (llama.cpp's CPU
    scheme, the default) tokens may part where two logits nearly tie: the first six agree
    (all twelve did when written), and their log-probabilities stay close."""
    gguf, ref = q4_0[name]
    monkeypatch.setenv("QSERVE_CPU_ACTIVATIONS", "fp32")
    check(gguf, ref)
    monkeypatch.setenv("QSERVE_CPU_ACTIVATIONS", "int8")
    ref_tokens, ref_logprobs = transformers_greedy(ref, prompt(), NEW_TOKENS)
    tokens, logprobs = qserve_greedy(gguf, prompt(), NEW_TOKENS)
    assert tokens[:6] == ref_tokens[:6]
    # int8 activations round each input to 1/254 of its group's largest: on these random
    # weights the chosen tokens' log-probabilities moved by up to 0.08 (fp32: 1e-6)
    assert logprobs[:6] == pytest.approx(ref_logprobs[:6], abs=0.15)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_k_quant_experts_through_a_gguf_native_checkpoint(name, q4_0, ggufs, tmp_path):
    """A Q4_K_M file of the mixture (llama-quantize on the F32 one: K-quant, Q5_0 or Q8_0
    blocks where rows are short; the routers F32) imported by `qserve quantize` with no recipe:
    gguf-native, every expert stored as its blocks, and greedy tokens the GGUF's own."""
    from qserve.formats import ggml
    from qserve.loader import load_model
    from qserve.quant.quantize import quantize

    del q4_0  # its fixture skips where llama-quantize is not built
    tool = _peer().llama_cpp_dir(build=False) / "build" / "bin" / "llama-quantize"
    src = tmp_path / f"{name}-q4_k_m.gguf"
    r = subprocess.run([str(tool), str(ggufs[f"{name}-f32"]), str(src), "Q4_K_M"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = quantize(str(src), tmp_path / "ck")
    assert summary["recipe"] == "gguf-native"
    layers, file = load_model(tmp_path / "ck").quant["layers"], load_model(src).weights
    experts = {n: e["format"] for n, e in layers.items() if ".experts." in n}
    assert experts and {n: file[n + ".weight"].format for n in experts} == experts
    assert set(experts.values()) & set(ggml.IN_PLACE), experts  # blocks kept, not repacked
    runs = []
    for model in (src, tmp_path / "ck"):  # one KV dtype: the checkpoint's recipe suggests fp16
        llm = LLM(str(model), kv_cache_memory="16MiB", max_model_len=256, kv_dtype="fp32")
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        [out] = llm.generate([list(prompt())], params)
        runs.append(out.outputs[0].token_ids)
    assert runs[0] == runs[1] and len(runs[0]) == NEW_TOKENS


# --- the engine around it -----------------------------------------------------------------

def test_moe_takes_the_per_layer_path(checkpoints, monkeypatch):
    """The fused CPU decode step implements the dense Llama layer: a mixture never builds it,
    and a batch-1 decode step runs exactly top_k experts per layer."""
    from qserve.kernels import cpu_ops

    def refuse(*args):
        raise AssertionError("the fused decode step was built for a mixture of experts")

    monkeypatch.setattr(cpu_ops.CpuDecoder, "build", classmethod(refuse))
    llm = LLM(str(checkpoints["mixtral"]), kv_cache_memory="16MiB", max_model_len=256)
    calls = []
    for i, layer in enumerate(llm.engine.model.layers):
        for e, expert in enumerate(layer.mlp.experts):
            expert.register_forward_hook(
                lambda m, args, out, i=i, e=e: calls.append((i, e, len(args[0]))))
    [out] = llm.generate([list(prompt())], SamplingParams(temperature=0, max_tokens=3,
                                                          ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3
    decode = calls[-2 * 2:]  # the last step: 2 layers x top-2, one row each
    assert [(i, n) for i, _, n in decode] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert len({e for i, e, _ in decode if i == 0}) == 2


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_int4_kv_serves(name, checkpoints):
    llm = LLM(str(checkpoints[name]), kv_cache_memory="16MiB", max_model_len=256,
              block_size=16, kv_dtype="int4")
    assert llm.engine.cache_engine.codebooks[0]["k_width"].float().mean().item() == (
        pytest.approx(4.0))
    [out] = llm.generate([list(prompt())], SamplingParams(temperature=0, max_tokens=8,
                                                          ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 8


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_w4_recipe_quantizes_every_expert(name, checkpoints, tmp_path, monkeypatch):
    """`qserve quantize` with an int4 recipe packs each expert's linears like any linear, and
    the checkpoint's greedy tokens (fp32 activations) are transformers' on its dequantized
    weights."""
    from qserve.loader import load_model
    from qserve.quant.quantize import quantize

    summary = quantize(str(checkpoints[name]), tmp_path / "q", "w4g32")
    assert summary["recipe"] == "w4g32"
    quant = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    experts = [n for n in quant["layers"] if ".experts." in n]
    E = configs()[name][0].num_local_experts
    assert len(experts) == 2 * E * 3  # 2 layers x E experts x gate, up, down
    monkeypatch.setenv("QSERVE_CPU_ACTIVATIONS", "fp32")
    llm = LLM(str(tmp_path / "q"), kv_cache_memory="16MiB", max_model_len=256, block_size=4,
              kv_dtype="fp32")  # the recipe suggests an fp16 cache, which transformers lacks
    expert = llm.engine.model.layers[0].mlp.experts[E - 1]
    base = [f.removesuffix("_x16") for f in  # int4 runs 16 rows interleaved on a 512-bit CPU
            expert.gate_up_proj.formats + expert.down_proj.formats]
    assert base == ["int4", "int4"]
    dequantized_copy(checkpoints[name], load_model(tmp_path / "q").weights, tmp_path / "ref")
    [out] = llm.generate([list(prompt())], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                          ignore_eos=True, logprobs=1))
    tokens = out.outputs[0].token_ids
    ref_tokens, ref_logprobs = transformers_greedy(tmp_path / "ref", prompt(), NEW_TOKENS)
    assert tokens == ref_tokens
    logprobs = [lp[t] for t, lp in zip(tokens, out.outputs[0].logprobs)]
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)  # fp32: summation order only


# --- what a checkpoint holds --------------------------------------------------------------

def test_checkpoint_layout_comes_from_the_model(checkpoints, tmp_path):
    """transformers saves exactly the per-expert tensors the meta-built model asks for, and a
    qserve checkpoint's config.json reads back the same arch."""
    assert_layout_comes_from_the_model(checkpoints, tmp_path)


def test_gguf_reads_the_same_arch(checkpoints, ggufs):
    from qserve.loader import load_arch

    for name in ("mixtral", "qwen3_moe"):
        hf, gguf = load_arch(checkpoints[name]), load_arch(ggufs[f"{name}-f32"])
        assert gguf.architecture == hf.architecture, name
        for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "norm_topk_prob", "num_layers", "head_dim"):
            assert getattr(gguf, field) == getattr(hf, field), (name, field)


@pytest.mark.parametrize("name, dropped", [
    ("mixtral", "model.layers.1.block_sparse_moe.experts.5.w2.weight"),
    ("qwen3_moe", "model.layers.0.mlp.experts.3.up_proj.weight"),
])
def test_missing_expert_is_named(name, dropped, checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    from qserve.loader import load_model

    shutil.copytree(checkpoints[name], tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors[dropped]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=rf": missing tensor {dropped}$"):
        load_model(tmp_path)


@pytest.mark.parametrize("name, bad, shape, message", [
    ("mixtral", "model.layers.1.block_sparse_moe.experts.2.w3.weight", (64, 96),
     r"has shape \(64, 96\), expected \(96, 64\) from the model's config$"),  # transposed
    ("qwen3_moe", "model.layers.0.mlp.gate.weight", (7, 64),  # a router for 7 of 8 experts
     r"has shape \(7, 64\), expected \(8, 64\) from the model's config$"),
])
def test_moe_tensor_of_the_wrong_shape_is_named(name, bad, shape, message, checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    from qserve.loader import load_model

    shutil.copytree(checkpoints[name], tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors[bad] = torch.zeros(shape)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=rf": tensor {bad} {message}"):
        load_model(tmp_path)


@pytest.mark.parametrize("key, value, message", [
    # an expert count the stacked tensors do not hold (0 had failed an assert building the
    # model, 2**31 - 1 hung building every expert's name)
    ("expert_count", 9, r"metadata key qwen3moe\.expert_count is 9, but "
                        r"blk\.0\.ffn_gate_exps\.weight stacks 8 experts$"),
    ("expert_count", 0, r"metadata key qwen3moe\.expert_count is 0, but "
                        r"blk\.0\.ffn_gate_exps\.weight stacks 8 experts$"),
    ("expert_count", 2**31 - 1, r"metadata key qwen3moe\.expert_count is 2147483647, but "
                                r"blk\.0\.ffn_gate_exps\.weight stacks 8 experts$"),
    # experts narrower than the stored ones: the first that disagrees is named
    ("expert_feed_forward_length", 48, r"tensor model\.layers\.0\.mlp\.experts\.0\.gate_proj"
                                       r"\.weight has shape \(64, 64\), expected \(48, 64\)"),
])
def test_gguf_expert_that_disagrees_with_the_metadata_is_named(key, value, message, ggufs,
                                                                tmp_path):
    """A Qwen3-MoE GGUF rewritten with one `qwen3moe.` key changed, tensors as they were."""
    from gguf import GGUFReader, GGUFWriter

    from qserve.loader import load_model

    reader = GGUFReader(ggufs["qwen3_moe-f32"])
    out = tmp_path / "bad.gguf"
    writer = GGUFWriter(str(out), "qwen3moe")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        v = value if field.name == f"qwen3moe.{key}" else field.contents()
        writer.add_key_value(field.name, v, field.types[0],
                             field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=list(reversed([int(d) for d in t.shape])),
                          raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=f"^{re.escape(str(out))}: {message}"):
        load_model(out)


@pytest.mark.parametrize("experts", [5, 10**12])
def test_hf_expert_count_must_match_the_weights(experts, checkpoints, tmp_path):
    """config.json's expert count against the experts layer 0's tensors number (a corrupt
    10**12 had hung building every expert's name)."""
    from qserve.loader import load_arch

    shutil.copytree(checkpoints["mixtral"], tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    held = cfg["num_local_experts"]
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"num_local_experts": experts}))
    with pytest.raises(ModelLoadError, match=rf"config\.json: the config has {experts} experts "
                                             rf"a layer, but the checkpoint's layer 0 has "
                                             rf"{held}$"):
        load_arch(tmp_path)


def test_unsupported_qwen3_moe_layout_is_one_line(tmp_path):
    from qserve.loader import load_arch

    cfg = json.loads(json.dumps(configs()["qwen3_moe"][0].to_dict()))
    cfg["mlp_only_layers"] = [0]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config.json: mlp_only_layers=\[0\] with "
                                             r"decoder_sparse_step=1: qserve runs Qwen3-MoE with "
                                             r"experts in every layer"):
        load_arch(tmp_path)


def _prompts() -> list[list[int]]:
    """Six prompts: three share their first 16 tokens (four blocks of 4), and one repeats
    itself, so prompt-lookup drafts get accepted."""
    base = list(prompt())
    return [base, base[:16] + base[20:], base[:16] + base[3:9], base[8:] + base[:5],
            base[:12] * 3, base[::-1]]


ENGINE_FEATURES = [dict(preemption_mode="recompute"), dict(preemption_mode="swap"),
                   dict(draft="ngram", num_speculative_tokens=3)]


def check_engine_features(path: Path, options: dict, drafts_accepted: bool = True) -> None:
    """Each of _prompts() gets its solo greedy tokens through the engine with `options` (one
    of ENGINE_FEATURES) and prefix hits, and the engine's counters show the feature happened
    (drafts verified and, where `drafts_accepted`, some accepted)."""
    from qserve.engine.cache_engine import KV_STORAGE, bytes_per_block
    from qserve.loader import load_arch

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    solo = LLM(str(path), kv_cache_memory="16MiB", max_model_len=256, block_size=4)
    want = [solo.generate([p], params)[0].outputs[0].token_ids for p in _prompts()]
    if "draft" in options:
        llm = LLM(str(path), kv_cache_memory="16MiB", max_model_len=256, block_size=4,
                  spec_max_batch_size=8, **options)
    else:  # 20 blocks of 4 for six sequences of up to 48 tokens
        per_block = bytes_per_block(load_arch(path), 4, KV_STORAGE["fp32"])
        llm = LLM(str(path), kv_cache_memory=20 * per_block, max_model_len=64, block_size=4,
                  swap_space="16MiB", watermark=0.0, **options)
    llm.generate(_prompts()[:1], params)  # its blocks are the others' prefix hits
    got = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params)]
    assert got == want
    stats = llm.engine.stats()
    assert stats["prefix_cache_hit_blocks"] > 0
    if "draft" in options:
        assert stats["spec_accepted_tokens" if drafts_accepted else "spec_draft_tokens"] > 0
    else:
        assert stats["swap_outs" if options["preemption_mode"] == "swap" else "recomputes"] > 0


@pytest.mark.parametrize("options", ENGINE_FEATURES, ids=["recompute", "swap", "ngram-draft"])
def test_batched_engine_features_keep_greedy_tokens(options, checkpoints):
    """Batched decode (several tokens in one MoE call, grouped by expert), prefix hits, both
    preemption modes under a KV pool too small for the batch, and speculative verification
    (several positions of one sequence at once) give each prompt its solo greedy tokens."""
    check_engine_features(checkpoints["qwen3_moe"], options)
