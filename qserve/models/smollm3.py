"""SmolLM3: the Llama layout with no rope at all in some layers (`no_rope_layers`, by default
every fourth, as llama.cpp always takes it), which attend by content alone. Its CPU decode
steps run through the Llama family's fused C kernel, told per layer whether to rotate."""
from __future__ import annotations

from qserve.models.llama import LlamaForCausalLM
from qserve.models.rope import NoRope

NO_ROPE_INTERVAL = 4  # transformers' default no_rope_layer_interval; llama.cpp's fixed step


class SmolLM3ForCausalLM(LlamaForCausalLM):
    architectures = ("SmolLM3ForCausalLM",)
    model_types = ("smollm3",)
    gguf_architectures = ("smollm3",)
    gguf_model_types = {}
    gguf_permuted_qk = ("smollm3",)  # converted as llama: q/k rows interleaved
    hf_defaults = {"rope_theta": 2e6, "tie_word_embeddings": True}

    @classmethod
    def hf_config(cls, cfg):
        layers = cfg["num_hidden_layers"]
        flags = cfg.get("no_rope_layers")  # 1: the layer rotates
        if flags is None:
            interval = cfg.get("no_rope_layer_interval") or NO_ROPE_INTERVAL
            flags = [int((i + 1) % interval != 0) for i in range(layers)]
        return super().hf_config(cfg) | {"nope_layers": [i for i, f in enumerate(flags)
                                                         if not f]}

    @classmethod
    def gguf_config(cls, arch, key, tensor):
        layers = arch["num_layers"]
        return super().gguf_config(arch, key, tensor) | {
            "nope_layers": [i for i in range(layers) if (i + 1) % NO_ROPE_INTERVAL == 0]}

    def layer_rope(self, i: int):
        return NoRope() if i in (self.arch.nope_layers or ()) else super().layer_rope(i)
