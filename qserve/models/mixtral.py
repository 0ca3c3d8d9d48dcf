"""Mixtral: Mistral's layout with a sparse mixture of experts in place of each MLP. A router
(block_sparse_moe.gate) picks num_experts_per_tok of num_local_experts gated MLPs per token
(w1 gate, w3 up, w2 down), their weights renormalized over the chosen ones (layers/moe.py).

llama.cpp converts Mixtral as "llama" with `llama.expert_count` set, and stacks each layer's
experts into 3-D ffn_{gate,up,down}_exps tensors; the GGUF loader reads expert e's matrix as
the e-th slice, in the file's own format. MoE layers run one by one: the fused CPU decode step
(kernels/cpu_ops.py CpuDecoder) is the dense Llama layer's alone.
"""
from __future__ import annotations

import re

from torch import nn

from qserve.config import ModelArchConfig, is_count
from qserve.errors import ConfigError
from qserve.layers.moe import SparseMoE
from qserve.models.base import GGUF_NAMES, MLP, CausalLM, DecoderLayer


def sparse_moe(arch: ModelArchConfig) -> SparseMoE:
    """A layer's mixture: the router and num_experts gated MLPs of moe_intermediate_size."""
    return SparseMoE(nn.Linear(arch.hidden_size, arch.num_experts, bias=False),
                     [MLP(arch, arch.moe_intermediate_size) for _ in range(arch.num_experts)],
                     arch.num_experts_per_tok, arch.norm_topk_prob)


def moe_fields(cfg: dict, intermediate_key: str) -> dict:
    """The ModelArchConfig MoE fields of a config.json (transformers >= 5 writes
    num_local_experts for every family; Qwen's own configs say num_experts)."""
    def count(name: str) -> int:
        value = cfg.get(name)
        if not is_count(value):
            raise ConfigError(f"{name} is {value!r}; it must be a positive integer")
        return value

    experts = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
    return dict(num_experts=count(experts), num_experts_per_tok=count("num_experts_per_tok"),
                moe_intermediate_size=count(intermediate_key),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))


class MixtralForCausalLM(CausalLM):
    architectures = ("MixtralForCausalLM",)
    model_types = ("mixtral",)
    gguf_architectures = ("llama",)
    gguf_permuted_qk = ("mixtral",)  # a llama GGUF: q/k rows interleaved for its rope
    moe = True
    packed_modules_mapping = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                              "gate_up_proj": ("w1", "w3")}
    gguf_names = GGUF_NAMES | {
        "block_sparse_moe.gate": "ffn_gate_inp", "block_sparse_moe.experts.w1": "ffn_gate_exps",
        "block_sparse_moe.experts.w3": "ffn_up_exps",
        "block_sparse_moe.experts.w2": "ffn_down_exps"}

    @classmethod
    def hf_config(cls, cfg: dict) -> dict:
        # every expert is intermediate_size wide, and the chosen weights always renormalized
        return moe_fields(cfg | {"norm_topk_prob": True}, "intermediate_size")

    @classmethod
    def gguf_config(cls, arch, key, tensor):
        return {"num_experts": key("expert_count"), "num_experts_per_tok": key("expert_used_count"),
                "moe_intermediate_size": arch["intermediate_size"]}

    def decoder_layer(self, arch, i):
        return DecoderLayer(arch, self.layer_rope(i), i, mlp=sparse_moe(arch))

    @staticmethod
    def hf_name(name: str) -> str:
        """mlp.gate -> block_sparse_moe.gate, mlp.experts.{e}.down_proj -> ...experts.{e}.w2
        (gate_up_proj's parts are w1 and w3: packed_modules_mapping)."""
        name = CausalLM.hf_name(name).replace(".mlp.", ".block_sparse_moe.")
        return re.sub(r"(\.experts\.\d+)\.down_proj", r"\1.w2", name)
