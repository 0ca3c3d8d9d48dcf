"""Gemma 3 (text): Gemma 2's layers with (1 + w) RMSNorms over each head of q and k, five
sliding layers to one global by default, the sliding layers' rope on a base of their own
(rope_local_base_freq, unscaled; the global layers' may be linearly scaled), and no soft-capping
unless the config asks for it.

The multimodal Gemma3ForConditionalGeneration stores its text weights under another prefix
and is not read here."""
from __future__ import annotations

from qserve.models.gemma2 import Gemma2ForCausalLM, GemmaRMSNorm


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    architectures = ("Gemma3ForCausalLM",)
    model_types = ("gemma3_text",)
    gguf_architectures = ("gemma3",)
    hf_defaults = {"hidden_activation": "gelu_pytorch_tanh", "head_dim": 256,
                   "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1e6,
                   "rope_local_base_freq": 10000.0, "tie_word_embeddings": True}
    sliding_window_pattern = 6
    qk_norm = GemmaRMSNorm
    gguf_27b_layers = 62

    @classmethod
    def gguf_config(cls, arch, key, tensor):
        return super().gguf_config(arch, key, tensor) | {
            "rope_local_theta": key("rope.freq_base_swa", 10000.0)}
