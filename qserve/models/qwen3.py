"""Qwen3 (dense): the Llama layout with an RMSNorm over each head of q and k before rope, an
explicit head_dim (heads * head_dim need not be hidden_size), and no q/k/v biases by default."""
from __future__ import annotations

from qserve.models.base import CausalLM, DecoderLayer, RMSNorm


class Qwen3ForCausalLM(CausalLM):
    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)
    gguf_architectures = ("qwen3", "qwen3vl")
    gguf_model_types = {"qwen3vl": "qwen3"}  # Qwen3-VL's language model

    def decoder_layer(self, arch, i):
        return DecoderLayer(arch, self.layer_rope(i), i, qk_norm=RMSNorm,
                            o_bias=arch.attention_bias)
