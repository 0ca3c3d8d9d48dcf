"""Models in, tensors out: resolve a model spec, then read its config, weights and tokenizer.

    spec (alias | .gguf file | HF directory | ORG/NAME) --registry--> local path
        .gguf -> gguf_loader      directory -> hf_loader
        qserve checkpoint (a directory whose config.json says quant_method "qserve")
              -> hf_loader for config and tokenizer, checkpoint.py for packed weights
    -> LoadedModel(arch, weights under Hugging Face Llama names, tokenizer)

Weights are read lazily, tensor by tensor (loader/weights.py), and by default keep the file's
own precision: a GGUF's quantized tensors stay quantized (qserve/formats), fp16/bf16 stay so.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from qserve.config import ModelArchConfig
from qserve.errors import ModelLoadError
from qserve.formats import QuantizedTensor
from qserve.loader import gguf_loader, hf_loader
from qserve.loader.registry import DEFAULT_MODEL, model_home, pull, resolve_model
from qserve.loader.tokenizer import Tokenizer

__all__ = ["LoadedModel", "Tokenizer", "load_model", "load_arch", "load_tokenizer", "resolve_model",
           "pull", "model_home", "DEFAULT_MODEL"]


@dataclass
class LoadedModel:
    """A model ready for the runner.

    weights: Hugging Face Llama names -> dense tensors or QuantizedTensors, linears
    (out_features, in_features), read when looked up (a LazyWeights for GGUF and HF sources).
    With native weights a GGUF's quantized linears and embedding are QuantizedTensors in their
    own format (qserve/formats), F16/BF16 tensors as stored, the rest fp32; with
    native=False every GGUF tensor is dequantized to fp32. Safetensors keep their stored dtype.
    A qserve checkpoint's packed linears are QuantizedTensors described by `quant`.
    lm_head.weight is present only when not tied to model.embed_tokens.weight.
    arch.eos_token_ids includes every id in tokenizer.eos_token_ids.
    """

    arch: ModelArchConfig
    weights: Mapping[str, torch.Tensor | QuantizedTensor]
    tokenizer: Tokenizer
    path: Path
    source_format: str  # "gguf" | "hf" | "qserve"
    quant: dict | None = None  # a qserve checkpoint's quantization_config
    # the pooling an embedding model declares (qserve.pooling_params; None: none declared)
    pooling: str | None = None


def _locate(spec: str | Path | None) -> tuple[Path, str]:
    path = resolve_model(None if spec is None else str(spec))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path}: no config.json; qserve reads a .gguf file or a Hugging Face "
                                 f"model directory (config.json + *.safetensors + tokenizer)")
        from qserve.loader.checkpoint import quantization_config

        return path, "qserve" if quantization_config(path) is not None else "hf"
    return path, "gguf"  # GGUFFile rejects anything without the GGUF magic


def load_model(spec: str | Path | None = None, native: bool = True) -> LoadedModel:
    """Load config, weights and tokenizer. spec: alias (None: the default model), a .gguf file,
    a Hugging Face model directory, or a Hugging Face repo id ORG/NAME. native=False
    dequantizes a GGUF's quantized tensors to fp32 (as they are read)."""
    path, fmt = _locate(spec)
    quant = None
    if fmt == "gguf":
        gguf = gguf_loader.GGUFFile(path)
        arch = gguf_loader.read_arch(gguf)
        weights = gguf_loader.read_weights(gguf, arch, native)
        tokenizer = gguf_loader.read_tokenizer(gguf)
        pooling = gguf_loader.read_pooling(gguf)
        for key in gguf_loader.VOCABULARY_ARRAYS:  # in the tokenizer now
            gguf.metadata.pop(key, None)
    else:
        arch = hf_loader.read_config(path)
        tokenizer = hf_loader.read_tokenizer(path)
        pooling = hf_loader.read_pooling(path)
        if fmt == "qserve":
            from qserve.loader.checkpoint import quantization_config, read_checkpoint

            quant = quantization_config(path)
            weights = read_checkpoint(path, arch, quant)
        else:
            weights = hf_loader.read_weights(path, arch)
    arch.eos_token_ids = sorted(set(arch.eos_token_ids) | tokenizer.eos_token_ids)
    return LoadedModel(arch, weights, tokenizer, path, fmt, quant, pooling)


def load_arch(spec: str | Path | None = None) -> ModelArchConfig:
    """The model's config only: no tensor data is read."""
    path, fmt = _locate(spec)
    if fmt == "gguf":
        return gguf_loader.read_arch(gguf_loader.GGUFFile(path))
    return hf_loader.read_config(path)


def load_tokenizer(spec: str | Path | None = None) -> Tokenizer:
    path, fmt = _locate(spec)
    if fmt == "gguf":
        return gguf_loader.read_tokenizer(gguf_loader.GGUFFile(path))
    return hf_loader.read_tokenizer(path)
