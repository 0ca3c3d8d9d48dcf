"""The Llama family: Llama 2/3.x (llama3 rope scaling), Mistral (sliding window), Qwen2/2.5
(q/k/v biases), SmolLM2. The layers are base.py's; this family alone runs its CPU decode steps
through the fused C kernel (kernels/cpu_ops.py CpuDecoder), which implements exactly them."""
from __future__ import annotations

import torch

from qserve.kernels.cpu_ops import CpuDecoder
from qserve.kernels.paged_attention import PagedAttentionMetadata
from qserve.models.base import CausalLM, DecoderLayer, LayerHooks  # noqa: F401  (re-exported)


class LlamaForCausalLM(CausalLM):
    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
    model_types = ("llama", "mistral", "qwen2")
    gguf_architectures = ("llama", "qwen2")  # llama.cpp converts Mistral as llama
    gguf_permuted_qk = ("llama", "mistral")  # Qwen2 keeps HF's rotate-half order

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

    def fused_decode(self, x: torch.Tensor, positions: torch.Tensor,
                     caches: list[dict[str, torch.Tensor]], meta: PagedAttentionMetadata
                     ) -> torch.Tensor | None:
        if (self.device.type != "cpu" or self.arch.layer_types is not None
                or self.layers[0].self_attn.o_proj.bias is not None):
            return None  # the kernel applies one window to every layer, and no o_proj bias
        fused = self._cpu_decoder(caches)
        return None if fused is None else fused(x, positions, meta)

    def _cpu_decoder(self, caches: list[dict[str, torch.Tensor]]) -> CpuDecoder | None:
        """The fused C decode step for these caches, built on first use (None: not available,
        and the layers run one by one)."""
        if self._fused is None or self._fused[0] is not caches:
            self._fused = (caches, CpuDecoder.build(self, caches))
        return self._fused[1]
