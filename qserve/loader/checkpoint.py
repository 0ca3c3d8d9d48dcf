"""A qserve checkpoint: a Hugging Face-style directory whose linears are stored packed.

    config.json              the model's config + "quantization_config" (below)
    model.safetensors        dense tensors under HF names (`<name>.weight`); each quantized
                             linear as `<name>.qweight`, `<name>.scales` [, `<name>.offsets`]
                             (QuantizedTensor.tensors(): int4z's `offsets` are its uint8 zero
                             points)
    tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json
                             (a model with a tool-use template keeps both templates in
                             tokenizer_config.json's named list instead of the .jinja file)

    "quantization_config": {
      "quant_method": "qserve", "format_version": 1,
      "recipe": {...},                  the recipe it was made with (recipe.py)
      "kv_dtype": "fp16",               the KV cache dtype it suggests
      "layers": {"model.layers.0.self_attn.q_proj": {"format": "int4", "bits": 4,
                 "group_size": 64, "symmetric": false}, ...}
                                        every packed linear; the rest are dense. A GGUF's
                                        blocks kept as stored (gguf-native) are {"format":
                                        "q4_k"} with `<name>.qweight` its rows of bytes
    }

The loader checks every tensor's presence, shape and dtype against this before using any.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from qserve.config import KV_DTYPES, ModelArchConfig, is_count
from qserve.errors import ModelLoadError
from qserve.formats import QuantizedTensor, ggml
from qserve.models.registry import hf_architecture

QUANT_METHOD, FORMAT_VERSION = "qserve", 1
WEIGHTS_FILE = "model.safetensors"


GROUPED_BITS = {"int4": 4, "int4z": 4, "int8": 8}  # formats with bits / group_size / symmetric


def quantization_config(path: Path, check: bool = True) -> dict | None:
    """The directory's quantization_config if it is a qserve checkpoint, else None; `check`
    refuses one whose values no qserve wrote (ModelLoadError naming config.json)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None  # hf_loader reports an unreadable config.json
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if not (isinstance(q, dict) and q.get("quant_method") == QUANT_METHOD):
        return None
    problem = _config_problem(q) if check else None
    if problem:
        raise ModelLoadError(f"{path / 'config.json'}: quantization_config {problem}")
    return q


def _config_problem(q: dict) -> str | None:
    """What in a qserve quantization_config no qserve writes, or None."""
    version, kv, recipe, layers = (q.get(k) for k in ("format_version", "kv_dtype", "recipe",
                                                       "layers"))
    if not is_count(version) or version != FORMAT_VERSION:
        return f"format_version is {version!r}; this qserve reads {FORMAT_VERSION}"
    if kv is not None and kv not in KV_DTYPES:
        return f"kv_dtype is {kv!r}; it must be one of {', '.join(KV_DTYPES)}"
    if recipe is not None and not isinstance(recipe, dict):
        return f"recipe is {type(recipe).__name__}, not an object"
    if not isinstance(layers, dict):
        return "has no 'layers' mapping"
    for name, layer in layers.items():
        problem = _layer_problem(layer)
        if problem:
            return f"layer {name}: {problem} (in {str(layer)[:80]})"
    return None


def _layer_problem(layer) -> str | None:
    """What is wrong with one `layers` entry, or None (format_version 1 entries may name bits
    only; GGML block formats need nothing but the format)."""
    if not isinstance(layer, dict):
        return "is not an object"
    fmt, bits, group, sym = (layer.get(k) for k in ("format", "bits", "group_size", "symmetric"))
    if fmt is not None and fmt not in (*GROUPED_BITS, *ggml.IN_PLACE):
        return (f"format {fmt!r} is not one a checkpoint holds "
                f"({', '.join((*GROUPED_BITS, *ggml.IN_PLACE))})")
    if fmt in ggml.IN_PLACE:
        return None
    if not is_count(bits) or bits not in ((GROUPED_BITS[fmt],) if fmt else (4, 8)):
        return f"bits {bits!r} do not fit format {fmt or 'int4 / int8'}"
    if group is not None and not (is_count(group) and group % (8 // bits) == 0):
        return f"group_size {group!r} is not a positive {'even ' * (bits == 4)}integer or null"
    if type(sym) is not bool:
        return f"symmetric {sym!r} is not true or false"
    if (fmt == "int4z" and sym) or (bits == 8 and not sym):
        return f"symmetric {sym} does not fit {fmt or 'int8'}"
    return None


def _rope_scaling(arch: ModelArchConfig) -> dict | None:
    """config.json's rope_scaling: the arch's, with Ministral 3's attention temperature among
    its parameters where transformers keeps it."""
    if arch.attn_temperature_beta is None:
        return arch.rope_scaling
    return dict(arch.rope_scaling or {"rope_type": "default"}) | {
        "llama_4_scaling_beta": arch.attn_temperature_beta,
        "original_max_position_embeddings": arch.attn_temperature_length}


def hf_config(arch: ModelArchConfig) -> dict:
    """config.json fields that hf_loader.read_config reads back into the same arch."""
    cfg = {
        "model_type": arch.architecture, "architectures": [hf_architecture(arch.architecture)],
        "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size, "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads, "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim, "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta, "rope_scaling": _rope_scaling(arch),
        "max_position_embeddings": arch.max_position_embeddings,
        # a backbone without its output layer stays one (read back: untied, no lm_head)
        "tie_word_embeddings": arch.tie_word_embeddings and arch.generates,
        "attention_bias": arch.attention_bias,
        "bos_token_id": arch.bos_token_id, "eos_token_id": list(arch.eos_token_ids),
        "torch_dtype": "float16", "hidden_act": arch.hidden_act,
        "partial_rotary_factor": arch.partial_rotary_factor,
        # written even when None: a family's default (Gemma 2 caps at 50 / 30) must not apply
        "query_pre_attn_scalar": arch.query_pre_attn_scalar,
        "attn_logit_softcapping": arch.attn_logit_softcapping,
        "final_logit_softcapping": arch.final_logit_softcapping,
    }
    if arch.sliding_window is not None:
        cfg |= {"sliding_window": arch.sliding_window, "use_sliding_window": True,
                "layer_types": arch.layer_types or ["sliding_attention"] * arch.num_layers}
    else:
        cfg |= {"sliding_window": None, "use_sliding_window": False}
    if arch.rope_local_theta is not None:
        cfg["rope_local_base_freq"] = arch.rope_local_theta
    if arch.nope_layers is not None:  # SmolLM3's key: 1 where a layer rotates
        cfg["no_rope_layers"] = [int(i not in arch.nope_layers) for i in range(arch.num_layers)]
    for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):  # Granite's
        if getattr(arch, name) != 1.0:
            cfg[name] = getattr(arch, name)
    if arch.swiglu_limit is not None:  # gpt-oss's clamped SwiGLU
        cfg |= {"swiglu_limit": arch.swiglu_limit, "swiglu_alpha": arch.swiglu_alpha}
    if arch.num_experts:  # the keys every MoE family's hf_config reads
        cfg |= {"num_local_experts": arch.num_experts,
                "num_experts_per_tok": arch.num_experts_per_tok,
                "moe_intermediate_size": arch.moe_intermediate_size,
                "norm_topk_prob": arch.norm_topk_prob}
    return cfg


def packed_specs(shape: tuple[int, int], layer: dict) -> dict[str, tuple[tuple, torch.dtype]]:
    """Suffix -> (shape, dtype) of a packed linear of HF shape (out, in). GGML blocks (a
    gguf-native checkpoint's q4_k, ...) are rows of bytes holding their own scales."""
    out, n_in = shape
    if layer.get("format") in ggml.IN_PLACE:
        t = ggml.TYPES[layer["format"]]
        if n_in % t.block:
            raise ValueError(f"{n_in} inputs are not whole {layer['format']} blocks")
        return {"qweight": ((out, n_in // t.block * t.block_bytes), torch.uint8)}
    gs = layer["group_size"] or n_in
    G = math.ceil(n_in / gs)
    specs = {"qweight": ((out, G * gs // 2), torch.uint8) if layer["bits"] == 4
             else ((out, G * gs), torch.int8),
             "scales": ((out, G), torch.float16)}
    if not layer["symmetric"]:  # int4z: zero points
        zeros = layer_format(layer) == "int4z"
        specs["offsets"] = ((out, G), torch.uint8 if zeros else torch.float16)
    return specs


def save_checkpoint(out: Path, arch: ModelArchConfig, tokenizer, tensors: dict[str, torch.Tensor],
                    quant: dict) -> None:
    """Write a checkpoint into the (new, empty) directory `out`."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(arch) | {"quantization_config": {
        "quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION} | quant}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in flatten(tensors).items()},
              str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / "tokenizer.json").write_text(tokenizer.backend.to_str())
    tok_cfg = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
    named = {"default": tokenizer.chat_template, "tool_use": tokenizer.tool_use_template}
    if tokenizer.tool_use_template:  # named templates: transformers' and gguf's list form
        tok_cfg["chat_template"] = [{"name": k, "template": v} for k, v in named.items() if v]
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tokenizer.bos_token_id,
         "eos_token_id": sorted(tokenizer.eos_token_ids)}, indent=2) + "\n")
    if tokenizer.chat_template and not tokenizer.tool_use_template:
        (out / "chat_template.jinja").write_text(tokenizer.chat_template)


def flatten(weights: dict[str, torch.Tensor | QuantizedTensor]) -> dict[str, torch.Tensor]:
    """HF-named weights -> the tensors a checkpoint stores: each QuantizedTensor `<name>.weight`
    as `<name>.qweight`, `.scales` [, `.offsets`]."""
    out = {}
    for name, w in weights.items():
        if isinstance(w, QuantizedTensor):
            base = name.removesuffix("weight")
            out |= {base + suffix: t for suffix, t in w.tensors().items()}
        else:
            out[name] = w
    return out


def layer_format(layer: dict) -> str:
    """The weight format of a `layers` entry (format_version 1 entries name bits only)."""
    return layer.get("format") or {4: "int4", 8: "int8"}[layer["bits"]]


def read_checkpoint(path: Path, arch: ModelArchConfig, quant: dict
                    ) -> dict[str, torch.Tensor | QuantizedTensor]:
    """The checkpoint's weights, each checked for presence, shape and dtype (ModelLoadError):
    dense tensors, and each packed linear as a QuantizedTensor under `<name>.weight`."""
    from safetensors import safe_open

    from qserve.loader.hf_loader import expected_shapes

    layers = quant["layers"]  # checked by quantization_config
    expected: dict[str, tuple[tuple, torch.dtype | None]] = {}
    for name, shape in expected_shapes(arch).items():
        layer = layers.get(name.removesuffix(".weight"))
        if layer is None:
            expected[name] = (shape, None)  # dense: any float dtype
            continue
        try:  # (the entry is checked; its shape may still not fit, e.g. a norm's)
            specs = packed_specs(shape, layer)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            raise ModelLoadError(f"{path}/config.json: layer {name} has a bad quantization "
                                 f"entry {layer!r}") from None
        for suffix, spec in specs.items():
            expected[name.removesuffix("weight") + suffix] = spec
    file = path / WEIGHTS_FILE
    weights = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            present = set(f.keys())
            unexpected = sorted(present - expected.keys())
            if unexpected:  # e.g. offsets a layer marked symmetric would silently drop
                raise ModelLoadError(f"{file}: tensor {unexpected[0]} is not one the config's "
                                     f"model and quantization layers describe"
                                     f"{f' (nor {len(unexpected) - 1} more)' * (len(unexpected) > 1)}")
            for name, (shape, dtype) in expected.items():
                if name not in present:
                    raise ModelLoadError(f"{file}: missing tensor {name}")
                t = f.get_tensor(name)
                if tuple(t.shape) != shape:
                    raise ModelLoadError(f"{file}: tensor {name} has shape {tuple(t.shape)}, "
                                         f"expected {shape}")
                if (t.dtype != dtype) if dtype is not None else not t.is_floating_point():
                    raise ModelLoadError(f"{file}: tensor {name} has dtype {t.dtype}, expected "
                                         f"{dtype or 'a float dtype'}")
                weights[name] = t
    except ModelLoadError:
        raise
    except Exception as e:  # safetensors raises its own SafetensorError, not an OSError
        raise ModelLoadError(f"{file}: not a readable safetensors file "
                             f"({type(e).__name__}: {e})".splitlines()[0]) from None
    shapes = expected_shapes(arch)
    for name, layer in layers.items():
        if name + ".weight" not in shapes:
            continue
        qt = QuantizedTensor(layer_format(layer), weights.pop(name + ".qweight"),
                             weights.pop(name + ".scales", None),
                             weights.pop(name + ".offsets", None), shapes[name + ".weight"][1])
        problem = qt.validate()
        if problem:
            raise ModelLoadError(f"{file}: {name}: {problem}")
        weights[name + ".weight"] = qt
    return weights
