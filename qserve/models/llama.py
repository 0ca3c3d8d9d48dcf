"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Tokens arrive packed flat (T tokens from any number of sequences, no padding). Q/K/V and
gate/up projections are fused into one matmul each. The norm and rope arithmetic follows
Hugging Face's order of operations, so fp32 outputs match it to rounding.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from qserve.config import ModelArchConfig
from qserve.errors import ModelLoadError
from qserve.kernels.paged_attention import PagedAttentionMetadata, paged_attention, write_kv
from qserve.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, arch: ModelArchConfig, rope: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads, arch.num_kv_heads, arch.head_dim)
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=arch.attention_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.rope = rope
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: dict[str, torch.Tensor],
                meta: PagedAttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = self.rope(positions, q, k)
        write_kv(k, v, cache["k"], cache["v"], meta.slot_mapping)
        out = paged_attention(q, cache["k"], cache["v"], meta, self.scale, k_new=k, v_new=v)
        return self.o_proj(out.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, arch: ModelArchConfig):
        super().__init__()
        self.intermediate = arch.intermediate_size
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, rope: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, rope)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(self, x, positions, cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArchConfig, max_positions: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.arch = arch
        self.dtype, self.device = dtype, device
        self.rope = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta,
                                    arch.rope_scaling, dtype, device)
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, self.rope) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = (None if arch.tie_word_embeddings else
                        nn.Linear(arch.hidden_size, arch.vocab_size, bias=False))
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                caches: list[dict[str, torch.Tensor]], meta: PagedAttentionMetadata
                ) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, hidden)."""
        x = self.embed_tokens(input_ids)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, positions, cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, hidden) -> (S, vocab) fp32 logits."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Take Hugging Face-named tensors; fuse q/k/v and gate/up as they go in. The module
        may have been built on the meta device: every parameter is replaced."""
        dtype, device = self.dtype, self.device
        params = dict(self.named_parameters())
        seen = set()

        def put(name: str, tensor: torch.Tensor) -> None:
            p = params[name]
            if p.shape != tensor.shape:
                raise ModelLoadError(f"weight {name}: shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(p.shape)}")
            owner, _, attr = name.rpartition(".")
            value = tensor.to(dtype=dtype, device=device).contiguous()
            setattr(self.get_submodule(owner), attr, nn.Parameter(value, requires_grad=False))
            seen.add(name)

        def get(name: str) -> torch.Tensor:
            if name not in weights:
                raise ModelLoadError(f"weight {name} is missing from the checkpoint")
            return weights[name]

        put("embed_tokens.weight", get("model.embed_tokens.weight"))
        put("norm.weight", get("model.norm.weight"))
        if self.lm_head is not None:
            put("lm_head.weight", get("lm_head.weight"))
        for i in range(self.arch.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            attn = src + "self_attn."
            put(dst + "self_attn.qkv_proj.weight", torch.cat(
                [get(attn + f"{p}_proj.weight") for p in "qkv"]))
            if self.arch.attention_bias:
                put(dst + "self_attn.qkv_proj.bias", torch.cat(
                    [get(attn + f"{p}_proj.bias") for p in "qkv"]))
            put(dst + "self_attn.o_proj.weight", get(attn + "o_proj.weight"))
            put(dst + "mlp.gate_up_proj.weight", torch.cat(
                [get(src + "mlp.gate_proj.weight"), get(src + "mlp.up_proj.weight")]))
            put(dst + "mlp.down_proj.weight", get(src + "mlp.down_proj.weight"))
            put(dst + "input_layernorm.weight", get(src + "input_layernorm.weight"))
            put(dst + "post_attention_layernorm.weight",
                get(src + "post_attention_layernorm.weight"))
        missing = set(params) - seen
        assert not missing, f"parameters left unloaded: {sorted(missing)[:4]}"
