"""gpt-oss (OpenAI's gpt-oss-20b, gpt-oss-120b): a mixture of experts in every layer, with
attention that has biases, a learned sink per head and a 128-position sliding window on every
other layer, and YaRN rope.

    attention   q/k/v/o with biases; scores softmaxed together with the head's sink logit
                (a term with a zero value: kernels/paged_attention.py); even layers slide
    router      logits = x W^T + b; the top k softmaxed (= softmax, top k, renormalized)
    expert      gate, up = x G^T + g, x U^T + u;  gate <= limit, -limit <= up <= limit
                y = ((up + 1) * gate * sigmoid(alpha * gate)) D^T + d

transformers saves each layer's experts stacked: mlp.experts.gate_up_proj (E, hidden, 2 I),
its gate and up columns interleaved (gate 0, up 0, gate 1, ...), and down_proj (E, I,
hidden), each transposed from a linear's (out, in), with biases gate_up_proj_bias (E, 2 I)
and down_proj_bias (E, hidden). OpenAI's release stores the two matrices as MXFP4 instead
(quantization_config quant_method "mxfp4"): `_blocks` (E, out, in / 32, 16) bytes of 4-bit
codes, two a byte, low nibble first, and `_scales` (E, out, in / 32) E8M0 exponents, already
in a linear's (out, in) order. `stored_tensors` reads each expert's matrices out of them
(layers/moe.py runs experts as modules of their own).

llama.cpp's "gpt-oss" GGUF stacks the experts as Mixtral's are (ffn_{gate,up,down}_exps, the
gate and up split apart, their biases ffn_*_exps.bias (E, out)), names the router
ffn_gate_inp, the sinks attn_sinks and the MLP's norm post_attention_norm; it fixes alpha and
the limit (1.702, 7.0) in code rather than in metadata.
"""
from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn

from qserve.config import ModelArchConfig
from qserve.formats import ggml
from qserve.layers.moe import SparseMoE
from qserve.models.base import GGUF_NAMES, CausalLM, DecoderLayer, PackedLinear
from qserve.models.mixtral import moe_fields

# gpt-oss's activation constants (transformers' GptOssConfig defaults, llama.cpp's fixed ones)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


class ClampedSwiGLUExpert(nn.Module):
    """One expert: gate/up and down projections with biases and the clamped SwiGLU between
    (module docstring)."""

    def __init__(self, arch: ModelArchConfig):
        super().__init__()
        self.intermediate = arch.moe_intermediate_size
        self.gate_up_proj = PackedLinear(arch.hidden_size, [self.intermediate] * 2, bias=True)
        self.down_proj = nn.Linear(self.intermediate, arch.hidden_size, bias=True)
        self.alpha, self.limit = arch.swiglu_alpha, arch.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, hidden) -> (n, hidden)."""
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


# A layer's stacked expert tensors as transformers saves them (module docstring)
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)"
                      r"(_bias|_blocks|_scales)?$")
Take = Callable[..., object]  # safetensors slices -> the tensor (or QuantizedTensor) they hold


class GptOssForCausalLM(CausalLM):
    architectures = ("GptOssForCausalLM",)
    model_types = ("gpt_oss",)
    gguf_architectures = ("gpt-oss",)
    moe = True
    sliding_window_pattern = 2  # even layers slide, odd ones attend globally
    gguf_names = GGUF_NAMES | {
        "post_attention_layernorm": "post_attention_norm", "self_attn.sinks": "attn_sinks.weight",
        "mlp.router": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps",
        "mlp.experts.up_proj": "ffn_up_exps", "mlp.experts.down_proj": "ffn_down_exps"}
    # transformers' GptOssConfig defaults (OpenAI's config.json leaves out swiglu_alpha)
    hf_defaults = {"swiglu_alpha": SWIGLU_ALPHA, "swiglu_limit": SWIGLU_LIMIT,
                   "attention_bias": True, "sliding_window": 128}
    stored_quant_methods = ("mxfp4",)

    @classmethod
    def hf_config(cls, cfg: dict) -> dict:
        # every expert is intermediate_size wide; the top k's weights always sum to 1
        return moe_fields(cfg | {"norm_topk_prob": True}, "intermediate_size") | {
            "attention_sinks": True, "swiglu_alpha": cfg["swiglu_alpha"],
            "swiglu_limit": cfg["swiglu_limit"]}

    @classmethod
    def gguf_config(cls, arch, key, tensor):
        fields = {"num_experts": key("expert_count"),
                  "num_experts_per_tok": key("expert_used_count"),
                  "moe_intermediate_size": key("expert_feed_forward_length"),
                  "attention_sinks": True, "swiglu_alpha": SWIGLU_ALPHA,
                  "swiglu_limit": SWIGLU_LIMIT}
        if (arch["rope_scaling"] or {}).get("rope_type") == "yarn":
            # gpt-oss's YaRN ramp runs between the exact correction dims (transformers'
            # truncate=False, OpenAI's reference); the GGUF cannot say so, and llama.cpp
            # rounds them outwards for every model (ggml_rope_yarn_corr_dims)
            fields["rope_scaling"] = arch["rope_scaling"] | {"truncate": False}
        return fields

    def decoder_layer(self, arch, i):
        router = nn.Linear(arch.hidden_size, arch.num_experts, bias=True)
        mlp = SparseMoE(router, [ClampedSwiGLUExpert(arch) for _ in range(arch.num_experts)],
                        arch.num_experts_per_tok, norm_topk_prob=True)
        return DecoderLayer(arch, self.layer_rope(i), i, o_bias=True, mlp=mlp)

    @staticmethod
    def hf_name(name: str) -> str:
        """mlp.gate (SparseMoE's router) -> mlp.router."""
        return re.sub(r"\.mlp\.gate(?=\.|$)", ".mlp.router", CausalLM.hf_name(name))

    @classmethod
    def stored_tensors(cls, name, shape, shapes):
        """A layer's stacked experts (module docstring) -> each expert's tensors under the
        names the model reads (mlp.experts.{e}.gate_proj.weight, ...)."""
        m = _STACKED.match(name)
        if m is None:
            return None
        prefix, which, kind = m[1], m[2], m[3] or ""
        if kind == "_scales":
            return []  # read with their blocks
        E, reads, fmt = shape[0], (name,), None
        if kind == "_blocks":  # MXFP4 (E, out, in / 32, 16), in a linear's order already
            reads, fmt = (name, f"{prefix}.{which}_scales"), "mxfp4"
            out, in_features = shape[1], shape[2] * 32
        elif kind == "":  # (E, in, out): transposed
            out, in_features = shape[2], shape[1]
        if which == "down_proj":
            if kind == "_bias":  # (E, hidden)
                return [(f"{prefix}.{e}.down_proj.bias", shape[1:], _row(e), reads, fmt)
                        for e in range(E)]
            take = _mxfp4 if fmt else _transposed
            return [(f"{prefix}.{e}.down_proj.weight", (out, in_features), take(e), reads, fmt)
                    for e in range(E)]
        parts = []  # gate_up_proj: gate and up interleaved along out
        for e in range(E):
            for half, part in ((0, "gate_proj"), (1, "up_proj")):
                if kind == "_bias":  # (E, 2 I)
                    parts.append((f"{prefix}.{e}.{part}.bias", (shape[1] // 2,),
                                  _row(e, half), reads, fmt))
                else:
                    take = _mxfp4 if fmt else _transposed
                    parts.append((f"{prefix}.{e}.{part}.weight", (out // 2, in_features),
                                  take(e, half), reads, fmt))
        return parts


def _row(e: int, half: int | None = None) -> Take:
    """Expert e's row of a stacked bias; `half` 0 / 1: its even / odd entries."""
    def take(stored) -> torch.Tensor:
        row = stored[e]
        return row if half is None else row[half::2].contiguous()
    return take


def _mxfp4(e: int, half: int | None = None) -> Take:
    """Expert e's MXFP4 matrix from its stacked blocks and scales (OCP layout) -> a
    QuantizedTensor of GGML's MXFP4 rows (formats/ggml.py mxfp4_from_ocp: lossless); `half`
    0 / 1: its even / odd rows (gate / up)."""
    def take(blocks, scales):
        b, s = blocks[e], scales[e]  # (out, in / 32, 16), (out, in / 32)
        if half is not None:
            b, s = b[half::2], s[half::2]
        return ggml.mxfp4_from_ocp(b, s)
    return take


def _transposed(e: int, half: int | None = None) -> Take:
    """Expert e's (in, out) matrix of a stacked tensor, as a linear's (out, in); `half` 0 / 1:
    its even / odd columns (gate / up)."""
    def take(stored) -> torch.Tensor:
        m = stored[e]
        if half is not None:
            m = m[:, half::2]
        return m.t().contiguous()
    return take
