"""Granite 3.x: the Llama layout with four scales: the embedding's output
(embedding_multiplier), each layer's attention and MLP outputs before their residual adds
(residual_multiplier), the attention scores (attention_multiplier, in place of head_dim^-1/2)
and the logits (divided by logits_scaling). The fused C decode step takes the residual scale
per layer."""
from __future__ import annotations

import torch

from qserve.models.llama import LlamaForCausalLM

_SCALES = ("embedding_multiplier", "residual_multiplier", "logits_scaling")


class GraniteForCausalLM(LlamaForCausalLM):
    architectures = ("GraniteForCausalLM",)
    model_types = ("granite",)
    gguf_architectures = ("granite",)
    gguf_model_types = {}
    gguf_permuted_qk = ("granite",)  # converted as llama: q/k rows interleaved

    @classmethod
    def fill_hf_config(cls, cfg: dict) -> dict:
        cfg = super().fill_hf_config(cfg)
        # scores scale by query_pre_attn_scalar^-1/2 (a qserve checkpoint writes it back)
        if cfg.get("query_pre_attn_scalar") is None:
            cfg = cfg | {"query_pre_attn_scalar": cfg.get("attention_multiplier", 1.0) ** -2}
        return cfg

    @classmethod
    def hf_config(cls, cfg):
        return super().hf_config(cfg) | {k: cfg.get(k, 1.0) for k in _SCALES}

    @classmethod
    def gguf_config(cls, arch, key, tensor):
        return super().gguf_config(arch, key, tensor) | {
            "query_pre_attn_scalar": key("attention.scale", arch["head_dim"] ** -0.5) ** -2,
            "embedding_multiplier": key("embedding_scale", 1.0),
            "residual_multiplier": key("residual_scale", 1.0),
            "logits_scaling": key("logit_scale", 1.0)}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.arch.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.arch.logits_scaling
