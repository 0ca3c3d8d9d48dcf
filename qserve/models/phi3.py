"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama layout, stored fused (qkv_proj and gate_up_proj
are single checkpoint tensors, rows q|k|v and gate|up), with longrope ("su") rope scaling
(models/rope.py) and, in Phi-4-mini, rope on part of each head (partial_rotary_factor).
The sliding window, where the config sets one, applies to every layer, as in transformers
(llama.cpp ignores Phi-3's window)."""
from __future__ import annotations

from qserve.models.base import CausalLM


class Phi3ForCausalLM(CausalLM):
    architectures = ("Phi3ForCausalLM",)
    model_types = ("phi3",)
    gguf_architectures = ("phi3",)
    packed_modules_mapping = {}  # the checkpoint stores the fused matrices themselves
