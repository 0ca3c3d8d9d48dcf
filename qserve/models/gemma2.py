"""Gemma 2: RMSNorms that scale by (1 + w), a norm after attention and after the MLP as well as
before each, the embedding scaled by sqrt(hidden), a gelu-tanh gated MLP, scores scaled by
query_pre_attn_scalar^-1/2 and soft-capped (cap * tanh(s / cap)), soft-capped final logits,
and layers that alternate between a sliding window (even layers) and global attention.

Soft-capped scores take the pure-torch attention path (kernels/paged_attention.py
_attend_scored).
"""
from __future__ import annotations

import torch
from torch import nn

from qserve.models.base import GGUF_NAMES, MLP, Attention, CausalLM


class GemmaRMSNorm(nn.Module):
    """Scales by (1 + w) in fp32, then casts: the stored weight is the offset from 1."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GemmaDecoderLayer(nn.Module):
    """x + post_norm(attn(norm(x))), then x + post_norm(mlp(norm(x)))."""

    def __init__(self, arch, rope, layer: int, qk_norm: type[nn.Module] | None = None):
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = Attention(arch, rope, layer, qk_norm, o_bias=arch.attention_bias)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = MLP(arch)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x, positions, cache, meta):
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), positions, cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2ForCausalLM(CausalLM):
    architectures = ("Gemma2ForCausalLM",)
    model_types = ("gemma2",)
    gguf_architectures = ("gemma2",)
    gguf_names = GGUF_NAMES | {"post_attention_layernorm": "post_attention_norm",
                               "pre_feedforward_layernorm": "ffn_norm",
                               "post_feedforward_layernorm": "post_ffw_norm"}
    gguf_norm_offset = 1.0
    hf_defaults = {"hidden_activation": "gelu_pytorch_tanh", "head_dim": 256,
                   "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                   "final_logit_softcapping": 30.0, "sliding_window": 4096,
                   "tie_word_embeddings": True}
    sliding_window_pattern = 2
    norm_class = GemmaRMSNorm
    qk_norm: type[nn.Module] | None = None
    gguf_27b_layers = 46  # llama.cpp recognises the 27B by its depth (below)

    @classmethod
    def gguf_config(cls, arch, key, tensor):
        # GGUF has no query_pre_attn_scalar: llama.cpp scales the 27B's scores by
        # hidden / heads and every other size's by head_dim, which is what their configs say
        big = arch["num_layers"] == cls.gguf_27b_layers
        return {"hidden_act": "gelu_pytorch_tanh",
                "query_pre_attn_scalar": (arch["hidden_size"] // arch["num_heads"] if big
                                          else arch["head_dim"])}

    def decoder_layer(self, arch, i):
        return GemmaDecoderLayer(arch, self.layer_rope(i), i, self.qk_norm)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (T, hidden)
        # sqrt(hidden) rounded to the activations' dtype first, as transformers does
        return x * torch.tensor(self.arch.hidden_size ** 0.5).to(x.dtype)
