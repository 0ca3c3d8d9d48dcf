"""The Llama family: Llama 2/3.x (llama3 rope scaling), Mistral (sliding window), Qwen2/2.5
(q/k/v biases), SmolLM2, Ministral 3 (YaRN, and Llama 4's attention temperature: queries scaled
by 1 + beta log(1 + floor(p / original context)) from the original context on). The layers are
base.py's; this family alone runs its CPU decode steps through the fused C kernel
(kernels/cpu_ops.py CpuDecoder), which implements exactly them."""
from __future__ import annotations

import torch

from qserve.formats import QuantizedTensor
from qserve.kernels.cpu_ops import CpuDecoder
from qserve.kernels.paged_attention import PagedAttentionMetadata
from qserve.layers.quant_linear import QuantEmbedding, QuantLinear
from qserve.models.base import (CausalLM, DecoderLayer, LayerHooks,  # noqa: F401  (re-exported)
                                 RMSNorm)


class LlamaForCausalLM(CausalLM):
    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                     "Ministral3ForCausalLM")
    model_types = ("llama", "mistral", "qwen2", "ministral3")
    # llama.cpp converts Mistral as llama, and Mistral Small 3.x's and Ministral 3's language
    # models as mistral3
    gguf_architectures = ("llama", "qwen2", "qwen2vl", "mistral3")
    gguf_model_types = {"qwen2vl": "qwen2",  # Qwen2-VL's and Qwen2.5-VL's language model
                        "mistral3": "mistral"}
    gguf_permuted_qk = ("llama", "mistral", "ministral3")  # Qwen2 keeps HF's rotate-half order

    @classmethod
    def hf_config(cls, cfg):
        # Ministral 3: Llama 4's attention temperature, named with the rope's parameters
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        beta = rope.get("llama_4_scaling_beta") if isinstance(rope, dict) else None
        if beta is None:
            return {}
        return {"attn_temperature_beta": beta,
                "attn_temperature_length": rope.get("original_max_position_embeddings")}

    @classmethod
    def gguf_config(cls, arch, key, tensor):
        # llama.cpp's mistral3: the temperature's length is YaRN's original context
        beta = key("attention.temperature_scale", 0.0)
        if not beta:
            return {}
        scaling = arch["rope_scaling"] or {}
        return {"attn_temperature_beta": beta,
                "attn_temperature_length": scaling.get("original_max_position_embeddings")}

    @classmethod
    def fill_hf_config(cls, cfg: dict) -> dict:
        cfg = super().fill_hf_config(cfg)
        # Qwen2's q/k/v always carry a bias; its config.json has no key for it
        return cfg | {"attention_bias": True} if cfg.get("model_type") == "qwen2" else cfg

    def __init__(self, arch, max_positions, dtype, device):
        super().__init__(arch, max_positions, dtype, device)
        self._fused: tuple[list, CpuDecoder | None] | None = None  # (caches, their decoder)

    def decoder_layer(self, arch, i):
        # attention_bias puts a bias on o_proj too, except in Qwen2 (q/k/v only)
        return DecoderLayer(arch, self.layer_rope(i), i,
                            o_bias=arch.attention_bias and arch.architecture != "qwen2")

    def fused_decode(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     caches: list[dict[str, torch.Tensor]], meta: PagedAttentionMetadata
                     ) -> torch.Tensor | None:
        if (self.device.type != "cpu" or self.arch.layer_types is not None
                or self.layers[0].self_attn.o_proj.bias is not None):
            return None  # the kernel applies one window to every layer, and no o_proj bias
        length = self.arch.attn_temperature_length
        if self.arch.attn_temperature_beta is not None and meta.max_seq_len > length:
            return None  # nor scales queries (by 1 until a position reaches `length`)
        fused = self._cpu_decoder(caches)
        if fused is None:
            return None
        x = fused.embed(input_ids)  # the table's rows (Granite's embed scales them)
        if x is not None and self.arch.embedding_multiplier != 1.0:
            x *= self.arch.embedding_multiplier
        out = (fused(self.embed(input_ids), positions, meta) if x is None
               else fused(x, positions, meta, owned=True))
        return out if fused.norm_final is not None else self.norm(out)

    def _cpu_decoder(self, caches: list[dict[str, torch.Tensor]]) -> CpuDecoder | None:
        """The fused C decode step for these caches, built on first use (None: not available,
        and the layers run one by one). It applies the final norm too where that is a plain
        RMSNorm with the layers' eps: a torch op after the step's weights have streamed
        through the caches took ~0.08 ms, five times as long as it takes alone."""
        if self._fused is None or self._fused[0] is not caches:
            norm = self.norm
            plain = type(norm) is RMSNorm and norm.eps == self.arch.rms_norm_eps
            table = (self.embed_tokens.table if isinstance(self.embed_tokens, QuantEmbedding)
                     and self.embed_tokens.dtype == torch.float32 else None)
            self._fused = (caches, CpuDecoder.build(self, caches,
                                                    norm.weight.data if plain else None,
                                                    self._output_matrix(), table))
        return self._fused[1]

    def _output_matrix(self) -> QuantizedTensor | None:
        """The packed output matrix compute_logits multiplies by (an unbiased one-segment
        lm_head, or the tied embedding's table), or None."""
        if self.arch.final_logit_softcapping is not None:
            return None
        if isinstance(self.lm_head, QuantLinear):
            segments = self.lm_head.segments
            return segments[0] if len(segments) == 1 and self.lm_head.bias is None else None
        if self.lm_head is None and isinstance(self.embed_tokens, QuantEmbedding):
            return self.embed_tokens.table
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        fused = None if self._fused is None else self._fused[1]
        logits = None if fused is None else fused.logits(hidden)
        return super().compute_logits(hidden) if logits is None else logits
