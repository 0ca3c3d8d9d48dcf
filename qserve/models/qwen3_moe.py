"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k norms, explicit
head_dim) with a sparse mixture of experts in every layer's MLP (mlp.gate, mlp.experts.{e}),
num_experts_per_tok of num_experts chosen per token by the router's softmax; their weights
are renormalized when norm_topk_prob says so (layers/moe.py).

llama.cpp's "qwen3moe" GGUF stacks each layer's experts into 3-D ffn_{gate,up,down}_exps
tensors and always renormalizes (there is no key for it unless `expert_weights_norm`).
"""
from __future__ import annotations

from qserve.errors import ConfigError
from qserve.models.base import GGUF_NAMES, CausalLM, DecoderLayer, RMSNorm
from qserve.models.mixtral import moe_fields, sparse_moe


class Qwen3MoeForCausalLM(CausalLM):
    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)
    gguf_architectures = ("qwen3moe",)
    moe = True
    gguf_names = GGUF_NAMES | {
        "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps",
        "mlp.experts.up_proj": "ffn_up_exps", "mlp.experts.down_proj": "ffn_down_exps"}
    # transformers' Qwen3MoeConfig defaults
    hf_defaults = {"norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}

    @classmethod
    def hf_config(cls, cfg: dict) -> dict:
        if cfg["mlp_only_layers"] or cfg["decoder_sparse_step"] != 1:
            raise ConfigError(f"mlp_only_layers={cfg['mlp_only_layers']!r} with "
                              f"decoder_sparse_step={cfg['decoder_sparse_step']!r}: qserve runs "
                              f"Qwen3-MoE with experts in every layer (mlp_only_layers [], "
                              f"decoder_sparse_step 1)")
        return moe_fields(cfg, "moe_intermediate_size")

    @classmethod
    def gguf_config(cls, arch, key, tensor):
        return {"num_experts": key("expert_count"), "num_experts_per_tok": key("expert_used_count"),
                "moe_intermediate_size": key("expert_feed_forward_length"),
                "norm_topk_prob": bool(key("expert_weights_norm", True))}

    def decoder_layer(self, arch, i):
        return DecoderLayer(arch, self.layer_rope(i), i, qk_norm=RMSNorm,
                            o_bias=arch.attention_bias, mlp=sparse_moe(arch))
