"""Gemma 3 (text): Gemma 2's layers with (1 + w) RMSNorms over each head of q and k, five
sliding layers to one global by default, the sliding layers' rope on a base of their own
(rope_local_base_freq, unscaled; the global layers' may be linearly scaled), and no soft-capping
unless the config asks for it.

The multimodal Gemma3ForConditionalGeneration (4B, 12B, 27B) runs as this language model
alone: hf_loader reads its text_config and the tensors under its language-model prefix. Its
text_config lists only what differs from transformers' Gemma3TextConfig, so every default of
that class is here."""
from __future__ import annotations

from qserve.models.gemma2 import Gemma2ForCausalLM, GemmaRMSNorm


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    architectures = ("Gemma3ForCausalLM",)
    model_types = ("gemma3_text",)
    gguf_architectures = ("gemma3",)
    hf_defaults = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                   "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                   "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "bos_token_id": 2,
                   "eos_token_id": 1, "hidden_activation": "gelu_pytorch_tanh", "head_dim": 256,
                   "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1e6,
                   "rope_local_base_freq": 10000.0, "tie_word_embeddings": True}
    sliding_window_pattern = 6
    qk_norm = GemmaRMSNorm
    gguf_27b_layers = 62

    @classmethod
    def gguf_config(cls, arch, key, tensor):
        return super().gguf_config(arch, key, tensor) | {
            "rope_local_theta": key("rope.freq_base_swa", 10000.0)}
