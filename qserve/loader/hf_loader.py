"""Hugging Face model directory -> ModelArchConfig, weights and Tokenizer.

    config.json                         architecture (model_type llama / mistral / qwen2)
    model.safetensors                   weights, or shards listed in model.safetensors.index.json
    tokenizer.json | tokenizer.model    vocabulary (tokenizers / sentencepiece)
    tokenizer_config.json               bos/eos, add_bos_token, chat_template (optional)
    chat_template.jinja                 the chat template, as transformers >= 4.50 saves it (optional)
    generation_config.json              extra eos ids (optional)

The weight names and shapes here are the layout every loader produces (`expected_shapes`).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken

from qserve.config import ModelArchConfig
from qserve.errors import ConfigError, ModelLoadError
from qserve.loader.weights import LazyWeights
from qserve.loader.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, Tokenizer, sentencepiece_bpe

HF_MODEL_TYPES = ("llama", "mistral", "qwen2")


def expected_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face Llama weight names -> shapes, (out_features, in_features) for linears."""
    h, i, v = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for layer in range(arch.num_layers):
        p = f"model.layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
        if arch.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
    return shapes


def check_shapes(shapes: dict[str, tuple[int, ...]], arch: ModelArchConfig, source: Path) -> None:
    """Raise unless `shapes` names exactly the expected tensors with the expected shapes."""
    expected = expected_shapes(arch)
    for name, shape in expected.items():
        if name not in shapes:
            raise ModelLoadError(f"{source}: missing tensor {name}")
        if tuple(shapes[name]) != shape:
            raise ModelLoadError(f"{source}: tensor {name} has shape {tuple(shapes[name])}, "
                                 f"expected {shape} from the model's config")
    assert shapes.keys() == expected.keys(), sorted(shapes.keys() ^ expected.keys())


def _read_json(path: Path, required: bool = True) -> dict:
    if not path.exists():
        if required:
            raise ModelLoadError(f"{path.parent}: no {path.name}; a Hugging Face model directory "
                                 f"needs config.json, *.safetensors and tokenizer files")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ModelLoadError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: must hold a JSON object, not a {type(data).__name__}")
    return data


def _as_list(value) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def read_config(path: Path) -> ModelArchConfig:
    """ModelArchConfig from config.json (+ generation_config.json's eos ids)."""
    cfg_path = path / "config.json"
    cfg = _read_json(cfg_path)
    model_type = cfg.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ModelLoadError(f"{cfg_path}: model_type {model_type!r} is not supported; qserve runs "
                             f"{', '.join(HF_MODEL_TYPES)}")

    def key(name, default=None):
        if cfg.get(name, default) is None:
            raise ModelLoadError(f"{cfg_path}: missing {name}")
        return cfg.get(name, default)

    def count(name, default=None) -> int:
        value = key(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"{cfg_path}: {name} is {value!r}; it must be a positive "
                                 f"integer")
        return value

    def positive(name, default) -> float:
        value = key(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ModelLoadError(f"{cfg_path}: {name} is {value!r}; it must be a positive "
                                 f"number")
        return value

    # transformers >= 5 writes rope_theta and the scaling together as rope_parameters.
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(f"{cfg_path}: rope_scaling is {rope!r}; it must be an object")
    rope = dict(rope)
    theta = rope.pop("rope_theta", 10000.0)
    rope_type = rope.setdefault("rope_type", rope.pop("type", "default"))
    use_window = model_type == "mistral" or cfg.get("use_sliding_window", False)
    heads = count("num_attention_heads")
    hidden = count("hidden_size")
    if not cfg.get("head_dim") and hidden % heads:
        raise ModelLoadError(f"{cfg_path}: hidden_size {hidden} is not a multiple of "
                             f"num_attention_heads {heads}, and there is no head_dim")
    gen = _read_json(path / "generation_config.json", required=False)
    eos = _as_list(gen.get("eos_token_id")) + _as_list(cfg.get("eos_token_id"))
    try:
        return ModelArchConfig(
            architecture=model_type,
            vocab_size=count("vocab_size"),
            hidden_size=hidden,
            intermediate_size=count("intermediate_size"),
            num_layers=count("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=count("num_key_value_heads", heads),
            head_dim=count("head_dim") if cfg.get("head_dim") else hidden // heads,
            rms_norm_eps=positive("rms_norm_eps", 1e-6),
            rope_theta=positive("rope_theta", theta),
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=count("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
            sliding_window=cfg.get("sliding_window") if use_window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=list(dict.fromkeys(eos)))
    except ConfigError as e:
        raise ModelLoadError(f"{cfg_path}: {e}") from None


def read_weights(path: Path, arch: ModelArchConfig) -> LazyWeights:
    """The expected tensors, as stored (fp32/fp16/bf16), from one or several safetensors files:
    a lazy mapping that reads each tensor when it is looked up (the headers are checked now)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(_read_json(index).get("weight_map", {}).values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ModelLoadError(f"{path}: no model.safetensors or model.safetensors.index.json")
    wanted, shapes, where = expected_shapes(arch), {}, {}
    for name in files:
        file = path / name
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key in wanted:  # tied checkpoints may still carry lm_head.weight
                        shapes[key], where[key] = tuple(f.get_slice(key).get_shape()), file
        except FileNotFoundError:
            raise ModelLoadError(f"{file}: listed in {index.name} but missing") from None
        except Exception as e:  # safetensors raises its own SafetensorError, not an OSError
            raise ModelLoadError(f"{file}: not a readable safetensors file "
                                 f"({type(e).__name__}: {e})".splitlines()[0]) from None
    check_shapes(shapes, arch, path)

    def read(key: str) -> torch.Tensor:
        try:
            with safe_open(str(where[key]), framework="pt") as f:
                return f.get_tensor(key)
        except Exception as e:
            raise ModelLoadError(f"{where[key]}: tensor {key} cannot be read "
                                 f"({type(e).__name__}: {e})".splitlines()[0]) from None

    return LazyWeights(shapes, read)


def read_tokenizer(path: Path) -> Tokenizer:
    """Tokenizer from tokenizer.json (or a sentencepiece tokenizer.model) + tokenizer_config.json."""
    from tokenizers import Tokenizer as Backend

    tok_cfg = _read_json(path / "tokenizer_config.json", required=False)
    if (path / "tokenizer.json").exists():
        try:
            backend = Backend.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise ModelLoadError(f"{path / 'tokenizer.json'}: not a readable tokenizer ({e})") from None
    elif (path / "tokenizer.model").exists():
        backend = _sentencepiece_backend(path / "tokenizer.model", tok_cfg)
    else:
        raise ModelLoadError(f"{path}: no tokenizer.json or tokenizer.model")
    cfg = _read_json(path / "config.json", required=False)
    gen = _read_json(path / "generation_config.json", required=False)

    def token_id(name: str) -> int | None:
        token = tok_cfg.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        found = backend.token_to_id(token) if token else None
        fallback = _as_list(cfg.get(f"{name}_id"))  # config.json's bos_token_id / eos_token_id
        return found if found is not None else (fallback[0] if fallback else None)

    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = {t["name"]: t["template"] for t in template}.get("default")
    if (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    return Tokenizer(backend, bos_token_id=token_id("bos_token"), eos_token_id=token_id("eos_token"),
                     extra_eos_ids=_as_list(gen.get("eos_token_id")),
                     add_bos=tok_cfg.get("add_bos_token"), add_eos=tok_cfg.get("add_eos_token"),
                     chat_template=template)


def _sentencepiece_backend(model_file: Path, tok_cfg: dict):
    """A sentencepiece BPE model rebuilt as a `tokenizers` backend, so one code path encodes."""
    import sentencepiece

    try:
        sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    except (OSError, RuntimeError) as e:
        raise ModelLoadError(f"{model_file}: not a readable sentencepiece model ({e})") from None
    n = sp.get_piece_size()
    tokens = [sp.id_to_piece(i) for i in range(n)]
    types = [CONTROL if sp.is_control(i) else UNKNOWN if sp.is_unknown(i) else BYTE if sp.is_byte(i)
             else UNUSED if sp.is_unused(i) else NORMAL for i in range(n)]
    add_prefix = sp.encode("a", out_type=str)[0].startswith("▁")
    backend = sentencepiece_bpe(tokens, [sp.get_score(i) for i in range(n)], types, add_prefix)
    for entry in tok_cfg.get("added_tokens_decoder", {}).values():  # e.g. chat markers
        added = AddedToken(entry["content"], special=entry.get("special", False), normalized=False)
        (backend.add_special_tokens if added.special else backend.add_tokens)([added])
    return backend
