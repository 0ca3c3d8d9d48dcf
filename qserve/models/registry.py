"""Which model family runs an architecture: one line per family.

    config.json model_type / architectures, GGUF general.architecture  ->  the family's class

A new family is one file under qserve/models/ (see base.py for what it declares) and its line
in FAMILIES. What a family's checkpoint holds is read off the model built on the meta device.
"""
from __future__ import annotations

import torch

from qserve.config import ModelArchConfig
from qserve.errors import ConfigError
from qserve.models.base import CausalLM
from qserve.models.gemma2 import Gemma2ForCausalLM
from qserve.models.gemma3 import Gemma3ForCausalLM
from qserve.models.gpt_oss import GptOssForCausalLM
from qserve.models.granite import GraniteForCausalLM
from qserve.models.llama import LlamaForCausalLM
from qserve.models.mixtral import MixtralForCausalLM
from qserve.models.phi3 import Phi3ForCausalLM
from qserve.models.qwen3 import Qwen3ForCausalLM
from qserve.models.qwen3_moe import Qwen3MoeForCausalLM
from qserve.models.smollm3 import SmolLM3ForCausalLM

FAMILIES: tuple[type[CausalLM], ...] = (
    LlamaForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM,
    MixtralForCausalLM, Qwen3MoeForCausalLM, SmolLM3ForCausalLM, GraniteForCausalLM,
    GptOssForCausalLM)


def supported() -> list[str]:
    """Every model_type qserve runs."""
    return [t for f in FAMILIES for t in f.model_types]


def model_class(model_type: str) -> type[CausalLM]:
    """The family of a Hugging Face model_type (ModelArchConfig.architecture)."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise ConfigError(f"model_type {model_type!r} is not supported; qserve runs "
                      f"{', '.join(supported())}")


def hf_architecture(model_type: str) -> str:
    """The config.json "architectures" entry of a model_type."""
    family = model_class(model_type)
    names = family.architectures
    return names[family.model_types.index(model_type)] if len(names) > 1 else names[0]


def gguf_architecture(model_type: str) -> str:
    """The GGUF general.architecture llama.cpp's converter writes a model_type as: its own
    name where its family lists it, else the family's first (Mistral, Mixtral: llama)."""
    names = model_class(model_type).gguf_architectures
    return model_type if model_type in names else names[0]


def gguf_family(name: str, experts: int = 0) -> tuple[type[CausalLM], str]:
    """A GGUF general.architecture and its `{name}.expert_count` (0: none) -> (family, the
    model_type it stands for). A name two families share (llama: Llama and Mixtral) goes to
    the one that is, or is not, a mixture of experts."""
    claims = sorted((f for f in FAMILIES if name in f.gguf_architectures),
                    key=lambda f: f.moe != (experts > 0))  # the matching kind first
    if claims:
        family = claims[0]
        return family, family.gguf_model_types.get(
            name, name if name in family.model_types else family.model_types[0])
    names = dict.fromkeys(n for f in FAMILIES for n in f.gguf_architectures)
    raise ConfigError(f"architecture {name!r} is not supported; qserve reads "
                      f"{', '.join(names)} GGUFs (Mistral files say llama)")


def meta_model(arch: ModelArchConfig) -> CausalLM:
    """The model of `arch` with every tensor on the meta device: shapes, no memory."""
    meta = torch.device("meta")
    with meta:
        return model_class(arch.architecture)(arch, 1, torch.float32, meta)


def checkpoint_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape of every tensor the model needs."""
    return meta_model(arch).checkpoint_shapes()


def fused_groups(arch: ModelArchConfig) -> list[tuple[str, ...]]:
    """Checkpoint linears (HF names, no ".weight") that run as one matrix."""
    return meta_model(arch).fused_groups()


def num_params(arch: ModelArchConfig) -> int:
    return sum(p.numel() for p in meta_model(arch).parameters())
