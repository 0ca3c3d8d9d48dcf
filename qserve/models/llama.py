"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Tokens arrive packed flat (T tokens from any number of sequences, no padding). Q/K/V and
gate/up projections are fused into one matmul each. The norm and rope arithmetic follows
Hugging Face's order of operations, so fp32 outputs match it to rounding.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from qserve.config import ModelArchConfig
from qserve.errors import ModelLoadError
from qserve.formats import QuantizedTensor
from qserve.formats.qtensor import cat_quantized
from qserve.kernels.cpu_ops import CpuDecoder
from qserve.kernels.dispatch import attention, output_logits
from qserve.kernels.paged_attention import PagedAttentionMetadata
from qserve.layers.quant_linear import QuantEmbedding, QuantLinear
from qserve.models.rope import RotaryEmbedding


class LayerHooks(Protocol):
    """What a step that moves KV blocks hands the model (engine/layerwise.py StepLayers): each
    layer's cache and metadata, and a call once the layer is done."""

    def before(self, i: int) -> tuple[dict[str, torch.Tensor], PagedAttentionMetadata]: ...

    def after(self, i: int) -> None: ...


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
        out = attention(q, k, v, cache, meta, self.scale)
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
        self._fused: tuple[list, CpuDecoder | None] | None = None  # (caches, their decoder)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                caches: list[dict[str, torch.Tensor]], meta: PagedAttentionMetadata,
                layers: LayerHooks | None = None) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, hidden).

        `layers`, when the step moves KV blocks or stages layer-wise prefills
        (engine/layerwise.py), gives each layer its cache and metadata and waits for its copies.
        """
        x = self.embed_tokens(input_ids)
        if layers is None and meta.decode_only and self.device.type == "cpu":
            fused = self._cpu_decoder(caches)
            if fused is not None:
                return self.norm(fused(x, positions, meta))
        for i, layer in enumerate(self.layers):
            cache, m = (caches[i], meta) if layers is None else layers.before(i)
            x = layer(x, positions, cache, m)
            if layers is not None:
                layers.after(i)
        return self.norm(x)

    def _cpu_decoder(self, caches: list[dict[str, torch.Tensor]]) -> CpuDecoder | None:
        """The fused C decode step for these caches, built on first use (None: not available,
        and the layers run one by one)."""
        if self._fused is None or self._fused[0] is not caches:
            self._fused = (caches, CpuDecoder.build(self, caches))
        return self._fused[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, hidden) -> (S, vocab) fp32 logits."""
        if isinstance(self.lm_head, QuantLinear):
            return self.lm_head(hidden).float()
        if self.lm_head is None and isinstance(self.embed_tokens, QuantEmbedding):
            return self.embed_tokens.logits(hidden)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return output_logits(hidden, weight)

    def load_weights(self, weights: dict[str, torch.Tensor | QuantizedTensor]) -> None:
        """Take Hugging Face-named weights; fuse q/k/v and gate/up as they go in. The module
        may have been built on the meta device: every parameter is replaced.

        A weight is a dense tensor or a QuantizedTensor (any format of qserve.formats: a qserve
        checkpoint's int4/int8, a GGUF's blocks, fp16 kept as stored). A linear with any packed
        part becomes a QuantLinear whose parts keep their own formats, as row segments (parts
        of one format are stacked, which is exact); so does an fp16/bf16 one in an fp32 model,
        which would otherwise double its memory. Dense parts otherwise take the model's dtype."""
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

        def get(name: str) -> torch.Tensor | QuantizedTensor:
            if name not in weights:
                raise ModelLoadError(f"weight {name} is missing from the checkpoint")
            return weights[name]

        def kept_packed(w: torch.Tensor | QuantizedTensor) -> QuantizedTensor | None:
            """w as a packed part, or None when it becomes a dense parameter."""
            if isinstance(w, QuantizedTensor):
                return w
            if dtype == torch.float32 and w.dtype in _STORED_FORMATS:
                return QuantizedTensor(_STORED_FORMATS[w.dtype], w, None, None, w.shape[1])
            return None

        def linear(dst: str, srcs: list[str], bias: bool = False) -> None:
            """Load nn.Linear `dst` from the HF linears `srcs` (stacked along out)."""
            module = self.get_submodule(dst)
            parts = [get(s + ".weight") for s in srcs]
            b = torch.cat([get(s + ".bias") for s in srcs]) if bias else None
            packed = [kept_packed(w) for w in parts]
            if all(p is None for p in packed):
                put(dst + ".weight", parts[0] if len(parts) == 1 else torch.cat(parts))
                if bias:
                    put(dst + ".bias", b)
                return
            segments = []
            for w, p in zip(parts, packed):
                if p is None:  # a dense part beside packed ones: a dense segment
                    p = QuantizedTensor("f32", w.float().contiguous(), None, None, w.shape[1])
                problem = p.validate() if p.in_features == module.in_features else (
                    f"{p.in_features} inputs, expected {module.in_features}")
                if problem:
                    raise ModelLoadError(f"weight {dst} ({p.format}): {problem}")
                segments.append(p)
            segments = _stack_alike(segments)
            out = sum(seg.shape[0] for seg in segments)
            if out != module.out_features:
                raise ModelLoadError(f"weight {dst}: {out} output rows, expected "
                                     f"{module.out_features}")
            b = None if b is None else b.float()
            owner, _, attr = dst.rpartition(".")
            setattr(self.get_submodule(owner), attr, QuantLinear(segments, b).to(device))
            seen.update({dst + ".weight", dst + ".bias"})

        embed = get("model.embed_tokens.weight")
        packed = kept_packed(embed)
        if packed is None:
            put("embed_tokens.weight", embed)
        else:
            if packed.shape != (self.arch.vocab_size, self.arch.hidden_size) or packed.validate():
                raise ModelLoadError(f"weight model.embed_tokens ({packed.format}): "
                                     f"{packed.validate() or f'shape {packed.shape}'}")
            self.embed_tokens = QuantEmbedding(packed, dtype).to(device)
            seen.add("embed_tokens.weight")
        put("norm.weight", get("model.norm.weight"))
        if self.lm_head is not None:
            linear("lm_head", ["lm_head"])
        for i in range(self.arch.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            attn = src + "self_attn."
            linear(dst + "self_attn.qkv_proj", [attn + f"{p}_proj" for p in "qkv"],
                   bias=self.arch.attention_bias)
            linear(dst + "self_attn.o_proj", [attn + "o_proj"])
            linear(dst + "mlp.gate_up_proj", [src + "mlp.gate_proj", src + "mlp.up_proj"])
            linear(dst + "mlp.down_proj", [src + "mlp.down_proj"])
            put(dst + "input_layernorm.weight", get(src + "input_layernorm.weight"))
            put(dst + "post_attention_layernorm.weight",
                get(src + "post_attention_layernorm.weight"))
        missing = set(params) - seen
        assert not missing, f"parameters left unloaded: {sorted(missing)[:4]}"


# A dense fp16/bf16 weight in an fp32 model stays at its stored precision, as this format.
_STORED_FORMATS = {torch.float16: "f16", torch.bfloat16: "bf16"}


def _stack_alike(segments: list[QuantizedTensor]) -> list[QuantizedTensor]:
    """Merge neighbouring segments that can be stacked into one (same format, group size and
    symmetry): fewer, larger matmuls."""
    out = [segments[0]]
    for seg in segments[1:]:
        try:
            out[-1] = cat_quantized([out[-1], seg])
        except ValueError:
            out.append(seg)
    return out
