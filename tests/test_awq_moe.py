"""AWQ / GPTQ checkpoints of mixtures of experts: every expert's linears packed on their own
under the per-expert names AutoAWQ and GPTQModel write (Mixtral
block_sparse_moe.experts.{e}.w1/w2/w3, Qwen3-MoE mlp.experts.{e}.gate_proj/up_proj/down_proj),
the router (block_sparse_moe.gate, mlp.gate) left dense as both projects leave it. Imported
into qserve's int4 / int4z with codes, scales and zero points as stored, compared exactly
with the intended weights, then served."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from qserve import LLM, SamplingParams
from qserve.formats import unpack_int4
from qserve.loader import load_model
from test_awq_gptq_import import (CASES, VOCAB, awq_tensors, gptq_tensors, intended,
                                  random_quant, write_checkpoint)

pytestmark = pytest.mark.slow  # transformers writes the models

ROUTER = re.compile(r"\.(block_sparse_moe|mlp)\.gate\.weight$")


def tiny_moe(family: str):
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False, initializer_range=0.1)
    config = (MixtralConfig(**common, intermediate_size=96, num_local_experts=4,
                            num_experts_per_tok=2) if family == "mixtral" else
              Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=64,
                             head_dim=32, num_experts=4, num_experts_per_tok=2,
                             norm_topk_prob=True))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def make(path: Path, family: str, case: str):
    """The checkpoint, every decoder linear but the router packed -> name -> (q, z, s)."""
    quant, sym, v1 = CASES[case]
    rng = np.random.default_rng(0)
    method = quant["quant_method"]

    def pack(base, w):
        q, z, s = random_quant(*w.shape, 32, sym, v1, rng)
        return (awq_tensors(q, z, s) if method == "awq" else gptq_tensors(q, z, s, v1)), (q, z, s)
    return write_checkpoint(path, tiny_moe(family),
                            quant | {"group_size": 32, "modules_to_not_convert": ["gate"]},
                            pack, packs=lambda name: not ROUTER.search(name))


@pytest.mark.parametrize("case", ["awq", "gptq-sym-v2", "gptq-asym-v1"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_expert_weights_equal_the_intended(family, case, tmp_path):
    chosen = make(tmp_path, family, case)
    experts = [b for b in chosen if ".experts." in b]
    assert len(experts) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    loaded = load_model(tmp_path)
    fmt = "int4" if CASES[case][1] else "int4z"
    for base, (q, z, s) in chosen.items():
        qt = loaded.weights[base + ".weight"]
        assert qt.format == fmt and qt.group_size == 32, base
        assert torch.equal(unpack_int4(qt.qweight), torch.from_numpy(q)), base
        assert torch.equal(qt.scales.view(torch.int16), s.view(torch.int16)), base
        if fmt == "int4z":
            assert torch.equal(qt.offsets, torch.from_numpy(z)), base
        # (q - z) * s exactly (tests/test_awq_gptq_import.py)
        assert torch.equal(qt.dequantize().double(), intended(q, z, s)), base
    router = next(k for k in loaded.weights.keys() if ROUTER.search(k))
    assert isinstance(loaded.weights[router], torch.Tensor)  # dense, as stored
    llm = LLM(str(tmp_path), kv_cache_memory="8MiB", max_model_len=64, block_size=4)
    expert = llm.engine.model.layers[1].mlp.experts[3]
    base = [f.removesuffix("_x16") for f in  # int4 runs 16 rows interleaved on a 512-bit CPU
            expert.gate_up_proj.formats + expert.down_proj.formats]
    assert base == [fmt, fmt]
    [out] = llm.generate([[5, 9, 17, 33, 8]], SamplingParams(temperature=0, max_tokens=4,
                                                              ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("case", ["awq", "gptq-sym-v2"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_greedy_equals_transformers_on_the_intended_weights(family, case, tmp_path,
                                                            monkeypatch):
    """qserve on the imported mixture against transformers on a copy whose linears hold the
    intended (q - z) * s weights (fp32 activations on both sides: the weights are the same,
    so the only difference is the summation order)."""
    from safetensors.torch import load_file, save_file

    from test_families import transformers_greedy

    monkeypatch.setenv("QSERVE_CPU_ACTIVATIONS", "fp32")
    chosen = make(tmp_path / "q", family, case)
    ref = tmp_path / "ref"
    ref.mkdir()
    stored = load_file(tmp_path / "q" / "model.safetensors")
    dense = {k: v for k, v in stored.items() if not k.endswith((".qweight", ".qzeros",
                                                               ".scales", ".g_idx"))}
    save_file(dense | {b + ".weight": intended(*qzs).float() for b, qzs in chosen.items()},
              str(ref / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    del cfg["quantization_config"]
    (ref / "config.json").write_text(json.dumps(cfg))
    ids = (5, 9, 17, 33, 8, 61, 40, 22, 9, 70)
    want, _ = transformers_greedy(ref, ids, 12)
    llm = LLM(str(tmp_path / "q"), kv_cache_memory="8MiB", max_model_len=64, block_size=4)
    [out] = llm.generate([list(ids)], SamplingParams(temperature=0, max_tokens=12,
                                                      ignore_eos=True))
    assert out.outputs[0].token_ids == want
