"""Hugging Face model directory -> ModelArchConfig, weights and Tokenizer.

    config.json                         architecture (model_type: models/registry.py); a
                                        vision-language checkpoint's language model alone
                                        (VISION_LANGUAGE: text_config, the tensors' prefix)
    model.safetensors                   weights, or shards listed in model.safetensors.index.json
    tokenizer.json | tokenizer.model    vocabulary (tokenizers / sentencepiece)
    tokenizer_config.json               bos/eos, add_bos_token, chat_template (optional)
    chat_template.jinja                 the chat template, as transformers >= 4.50 saves it (optional)
    chat_template.json                  a processor's chat template (optional, read last)
    additional_chat_templates/*.jinja   named templates, e.g. tool_use (optional)
    generation_config.json              extra eos ids (optional)

The weight names and shapes here are the layout every loader produces (`expected_shapes`).
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from tokenizers import AddedToken

from qserve.config import ModelArchConfig, is_count, is_positive
from qserve.errors import ConfigError, ModelLoadError
from qserve.loader.weights import LazyWeights, Stored, read_safetensor
from qserve.loader.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, Tokenizer, sentencepiece_bpe
from qserve.models import registry


def expected_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face weight names -> shapes, (out_features, in_features) for linears: what the
    architecture's model (models/registry.py) needs, read off it built on the meta device."""
    return registry.checkpoint_shapes(arch)


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


def _token_ids(value, where: str) -> list[int]:
    """A config's token id or list of ids (eos_token_id may be either) as a list; `where`
    (file: key) names a value that is neither."""
    ids = [] if value is None else [value] if isinstance(value, int) else value
    if (isinstance(value, bool) or not isinstance(ids, list)
            or any(isinstance(i, bool) or not isinstance(i, int) for i in ids)):
        raise ModelLoadError(f"{where} is {value!r}; it must be a token id or a list of them")
    return ids


# Vision-language checkpoints whose language model qserve runs alone, text in and text out
# (their vision tower and projector are not read): model_type -> the model_type of its
# language model where its config does not name one (transformers' default for the wrapper;
# Qwen2.5-VL's hub config is flat, its text fields beside vision_config)
VISION_LANGUAGE = {"gemma3": "gemma3_text", "mistral3": "mistral", "llava": "llama",
                   "qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}
# Language models whose layers are a family's own: Qwen's multimodal rope (M-RoPE) rotates
# sections of each head by a token's time, height and width positions, which for text are
# all its position, so on text alone it is the family's plain rope
_TEXT_MODEL_TYPES = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2",
                     "qwen3_vl_text": "qwen3"}
# Where such a checkpoint keeps the language model's tensors: the hub's files (transformers
# < 4.52, and >= 5 when it saves) put them under language_model.{model,lm_head}, 4.52-4.57
# saved model.language_model.* beside a top-level lm_head; Qwen2-VL's and Qwen2.5-VL's are
# a text model's own names beside visual.*
_LANGUAGE_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                      ("model.language_model.", "model."))
_VISION_PREFIXES = tuple(p + part for p in ("", "model.")
                         for part in ("vision_tower.", "multi_modal_projector.", "visual."))


def language_config(cfg: dict, cfg_path: Path) -> dict:
    """config.json's language model: the config itself, or a vision-language checkpoint's
    text_config (or its own text fields, where it is flat), with the outer config's bos/eos
    ids where text_config has none, tied embeddings where either level says so (read_config
    asks the weights first), and a multimodal rope as the plain one it is on text."""
    wrapper = cfg.get("model_type")
    if wrapper not in VISION_LANGUAGE:
        return cfg
    text = cfg.get("text_config", {k: v for k, v in cfg.items() if k != "vision_config"})
    if not isinstance(text, dict):
        raise ModelLoadError(f"{cfg_path}: text_config is {str(text)[:60]!r}; a {wrapper} "
                             f"config's language model must be an object")
    outer = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg.get(k) is not None}
    text = outer | text
    model_type = text.get("model_type")
    text["model_type"] = (VISION_LANGUAGE[wrapper] if model_type in (None, wrapper)
                          else _TEXT_MODEL_TYPES.get(model_type, model_type))
    if cfg.get("tie_word_embeddings") is True:
        text["tie_word_embeddings"] = True
    for key in ("rope_scaling", "rope_parameters"):
        rope = text.get(key)
        if isinstance(rope, dict) and "mrope_section" in rope:
            rope = {k: v for k, v in rope.items() if not k.startswith("mrope")}
            kind = rope.pop("type", None) or rope.get("rope_type", "default")
            text[key] = rope | {"rope_type": "default" if kind == "mrope" else kind}
    return text


def vision_language(path: Path) -> str | None:
    """The model_type of the VISION_LANGUAGE checkpoint at `path`, else None."""
    model_type = _read_json(path / "config.json", required=False).get("model_type")
    return model_type if model_type in VISION_LANGUAGE else None


# A backbone saved alone (transformers' Qwen3Model, not Qwen3ForCausalLM: how
# sentence-transformers saves Qwen3-Embedding and gte-Qwen2) names its tensors without the
# "model." prefix
_BACKBONE = ("embed_tokens.", "layers.", "norm.")


def language_names(path: Path) -> Callable[[str], str | None]:
    """A stored tensor name -> the name the language model reads it as (None: not one of its
    tensors, e.g. a vision tower's): the name itself, "model." + a backbone's own names, and
    for a VISION_LANGUAGE checkpoint the language model's under its prefix."""
    if vision_language(path) is None:
        return lambda name: "model." + name if name.startswith(_BACKBONE) else name

    def rename(name: str) -> str | None:
        if name.startswith(_VISION_PREFIXES):
            return None
        for stored, own in _LANGUAGE_PREFIXES:
            if name.startswith(stored):
                return own + name[len(stored):]
        return name  # model.*, lm_head.*, as a text model's
    return rename


def read_config(path: Path) -> ModelArchConfig:
    """ModelArchConfig from config.json (+ generation_config.json's eos ids), read as the
    model_type's family (models/registry.py) fills in its defaults."""
    cfg_path = path / "config.json"
    outer = _read_json(cfg_path)
    wrapped = outer.get("model_type") in VISION_LANGUAGE
    cfg = language_config(outer, cfg_path)
    try:
        family = registry.model_class(cfg.get("model_type"))
    except ConfigError as e:
        also = ("" if wrapped else f", and the language model of {', '.join(VISION_LANGUAGE)} "
                                   f"checkpoints")
        raise ModelLoadError(f"{cfg_path}: {e}{also}") from None
    cfg = family.fill_hf_config(cfg)

    def key(name, default=None):
        if cfg.get(name, default) is None:
            raise ModelLoadError(f"{cfg_path}: missing {name}")
        return cfg.get(name, default)

    def count(name, default=None) -> int:
        value = key(name, default)
        if not is_count(value):
            raise ModelLoadError(f"{cfg_path}: {name} is {value!r}; it must be a positive "
                                 f"integer")
        return value

    def positive(name, default, value=None) -> float:
        value = key(name, default) if value is None else value
        if not is_positive(value):
            raise ModelLoadError(f"{cfg_path}: {name} is {value!r}; it must be a positive "
                                 f"number")
        return value

    def flag(name) -> bool:  # absent or null: false
        value = cfg.get(name)
        if value is not None and not isinstance(value, bool):
            raise ModelLoadError(f"{cfg_path}: {name} is {value!r}; it must be true or false")
        return bool(value)

    def optional(name):  # None (or absent) stays None
        return None if cfg.get(name) is None else positive(name, None)

    # transformers >= 5 writes rope_theta and the scaling together as rope_parameters, one
    # per layer type where they differ (Gemma 3: {"full_attention": ..., "sliding_attention"})
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(f"{cfg_path}: rope_scaling is {rope!r}; it must be an object")
    local_theta = cfg.get("rope_local_base_freq")
    if "full_attention" in rope or "sliding_attention" in rope:
        local = rope.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"{cfg_path}: sliding layers' rope {local!r} is not supported "
                                 f"(only the global layers' may be scaled)")
        local_theta = local.get("rope_theta", local_theta)
        rope = rope.get("full_attention") or {}
    rope = dict(rope)
    theta = rope.pop("rope_theta", None)
    partial = rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    rope_type = rope.setdefault("rope_type", rope.pop("type", "default"))
    max_positions = count("max_position_embeddings", 4096)
    if rope_type in ("longrope", "su"):  # Phi-3: factors over the original context
        rope["rope_type"] = "longrope"
        original = count("original_max_position_embeddings",
                         rope.get("original_max_position_embeddings"))
        rope["original_max_position_embeddings"] = original
        if rope.get("factor") is None:
            rope["factor"] = max_positions / original
    if rope_type == "yarn" and rope.get("factor") is None:  # DeepSeek: the context's stretch
        rope["factor"] = max_positions / count("original_max_position_embeddings",
                                               rope.get("original_max_position_embeddings"))
    heads = count("num_attention_heads")
    hidden = count("hidden_size")
    layers = count("num_hidden_layers")
    # what the weights hold, checked before anything is built per layer or expert (a corrupt
    # 10**12 would be built name by name)
    in_files, experts_in_files, head_in_files = _checkpoint_counts(path)
    if in_files is not None and layers != in_files:
        raise ModelLoadError(f"{cfg_path}: num_hidden_layers is {layers}, but the checkpoint "
                             f"has tensors for {in_files} layers")
    if not cfg.get("head_dim") and hidden % heads:
        raise ModelLoadError(f"{cfg_path}: hidden_size {hidden} is not a multiple of "
                             f"num_attention_heads {heads}, and there is no head_dim")
    window, layer_types = _windows(cfg, family, layers, cfg_path)
    tied, generates = flag("tie_word_embeddings"), True
    if wrapped and head_in_files is not None:
        # whether a wrapper's output is tied has been said at either level, with defaults
        # that differ between wrappers and transformers' versions; its weights say it plainly
        tied = not head_in_files
    elif not tied and head_in_files is False:  # a backbone without its output layer
        tied, generates = True, False
    gen = _read_json(path / "generation_config.json", required=False)
    eos = (_token_ids(gen.get("eos_token_id"), f"{path / 'generation_config.json'}: eos_token_id")
           + _token_ids(cfg.get("eos_token_id"), f"{cfg_path}: eos_token_id"))
    bos = _token_ids(cfg.get("bos_token_id"), f"{cfg_path}: bos_token_id")
    try:
        arch = ModelArchConfig(
            architecture=cfg["model_type"],
            vocab_size=count("vocab_size"),
            hidden_size=hidden,
            intermediate_size=count("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=count("num_key_value_heads", heads),
            head_dim=count("head_dim") if cfg.get("head_dim") else hidden // heads,
            rms_norm_eps=positive("rms_norm_eps", 1e-6),
            rope_theta=positive("rope_theta", None, theta or cfg.get("rope_theta", 10000.0)),
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=max_positions,
            tie_word_embeddings=tied,
            generates=generates,
            attention_bias=flag("attention_bias"),
            sliding_window=window,
            bos_token_id=bos[0] if bos else None,
            eos_token_ids=list(dict.fromkeys(eos)),
            layer_types=layer_types,
            rope_local_theta=(None if local_theta is None else
                              positive("rope_local_base_freq", None, local_theta)),
            partial_rotary_factor=positive("partial_rotary_factor", None, partial),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            query_pre_attn_scalar=optional("query_pre_attn_scalar"),
            attn_logit_softcapping=optional("attn_logit_softcapping"),
            final_logit_softcapping=optional("final_logit_softcapping"),
            **family.hf_config(cfg))  # the family's own fields (a mixture's experts)
    except ConfigError as e:
        raise ModelLoadError(f"{cfg_path}: {e}") from None
    if arch.num_experts and experts_in_files is not None and arch.num_experts != experts_in_files:
        raise ModelLoadError(f"{cfg_path}: the config has {arch.num_experts} experts a layer, "
                             f"but the checkpoint's layer 0 has {experts_in_files}")
    return arch


def _checkpoint_counts(path: Path) -> tuple[int | None, int | None, bool | None]:
    """(decoder layers, layer 0's experts, whether there is an lm_head (packed or not)) the
    directory's weights hold: 1 + the largest N of a `model.layers.N.` tensor and of a
    `model.layers.0.<...>experts.E.` one, from the safetensors headers. None where there is
    nothing to count (a config alone, a dense model) or the weights cannot be read (reading
    them says why)."""
    try:
        names = tensor_index(path)[0]
    except ModelLoadError:
        return None, None, None

    def count(pattern: str) -> int | None:
        found = {int(m[1]) for m in (re.match(pattern, n) for n in names) if m}
        return max(found) + 1 if found else None
    return (count(r"model\.layers\.(\d+)\."), count(r"model\.layers\.0\.\S*experts\.(\d+)\."),
            any(n.startswith("lm_head.") for n in names))


def _windows(cfg: dict, family, num_layers: int, cfg_path: Path
             ) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) as ModelArchConfig holds them: layer_types only where
    layers differ. transformers >= 5 lists the layers; older configs say use_sliding_window
    (Qwen2), or the family alternates them (Gemma: sliding_window_pattern)."""
    layer_types = cfg.get("layer_types")
    window = cfg.get("sliding_window")
    if layer_types is None:
        if not cfg.get("use_sliding_window", True):
            window = None
        pattern = cfg.get("sliding_window_pattern", family.sliding_window_pattern)
        if window and pattern:  # every pattern-th layer global
            layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                           for i in range(num_layers)]
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ModelLoadError(f"{cfg_path}: sliding_window is {window!r}; it must be a positive "
                             f"integer or null")
    if not isinstance(layer_types, (list, type(None))):
        raise ModelLoadError(f"{cfg_path}: layer_types is {layer_types!r}; it must be a list")
    if layer_types is not None:
        kinds = set(layer_types)
        if window is None or kinds == {"full_attention"}:
            window, layer_types = None, None
        elif kinds == {"sliding_attention"}:
            layer_types = None
    return window, layer_types


def read_weights(path: Path, arch: ModelArchConfig) -> LazyWeights:
    """The expected tensors, as stored (fp32/fp16/bf16), from one or several safetensors files:
    a lazy mapping that reads each tensor when it is looked up (the headers are checked now).
    An AWQ or GPTQ checkpoint (config.json quantization_config) is read by awq_gptq.py."""
    quant = _read_json(path / "config.json").get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method in registry.model_class(arch.architecture).stored_quant_methods:
        quant = None  # the family reads it (stored_tensors: gpt-oss's MXFP4 experts)
    if quant is not None and method not in IMPORTED_QUANT_METHODS:
        raise ModelLoadError(f"{path / 'config.json'}: quantization_config quant_method "
                             f"{method!r} is not supported; qserve reads "
                             f"{', '.join(IMPORTED_QUANT_METHODS)} checkpoints and its own")
    shapes, where = tensor_index(path)
    if quant is not None:
        from qserve.loader.awq_gptq import read_weights as read_awq_gptq

        return read_awq_gptq(path, arch, quant, where, shapes)
    wanted = expected_shapes(arch)
    shapes = {k: s for k, s in shapes.items() if k in wanted}  # tied: lm_head.weight may stay
    check_shapes(shapes, arch, path)
    return LazyWeights(shapes, lambda key: read_safetensor(where, key))


IMPORTED_QUANT_METHODS = ("awq", "gptq")  # quantization_config.quant_method read here

# sentence-transformers' Pooling module config -> the pooling it names (the first set wins)
_POOLING_MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                  ("pooling_mode_cls_token", "cls"), ("pooling_mode_max_tokens", "max"),
                  ("pooling_mode_weightedmean_tokens", "weightedmean"),
                  ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"))


def read_pooling(path: Path) -> str | None:
    """The pooling an embedding model declares for sentence-transformers (modules.json, then
    its Pooling module's config.json: Qwen3-Embedding says last token), or None where it
    declares none. A mode qserve does not pool by comes back by name (e.g. "max"). A qserve
    checkpoint keeps its source's in quantization_config["pooling"]."""
    quant = _read_json(path / "config.json", required=False).get("quantization_config")
    if isinstance(quant, dict) and isinstance(quant.get("pooling"), str):
        return quant["pooling"]
    modules = path / "modules.json"
    if not modules.is_file():
        return None
    try:
        entries = json.loads(modules.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{modules}: not readable JSON ({e})") from None
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and str(entry.get("type", "")).endswith(".Pooling"):
            cfg = _read_json(path / str(entry.get("path", "")) / "config.json")
            return next((name for key, name in _POOLING_MODES if cfg.get(key) is True), None)
    return None


def _stored_tensors(path: Path) -> Callable:
    """The family's stored_tensors (models/base.py) for the checkpoint at `path`: how a
    stored tensor holds several of the model's; a no-op where config.json names no family
    (reading the config says why)."""
    cfg_path = path / "config.json"
    try:
        family = registry.model_class(language_config(_read_json(cfg_path), cfg_path)
                                      .get("model_type"))
    except (ConfigError, ModelLoadError):
        return lambda name, shape: None
    return family.stored_tensors


def tensor_index(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[Path, str]]]:
    """(name -> shape, name -> (file, stored name, take)) of every language-model tensor in
    the directory's safetensors files (model.safetensors, or the shards
    model.safetensors.index.json lists), from the headers, under the names the model reads
    (language_names), a Stored each; where the family's stored_tensors splits a stored
    tensor up, the parts it names instead."""
    from safetensors import safe_open

    rename, split = language_names(path), _stored_tensors(path)

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(_read_json(index).get("weight_map", {}).values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ModelLoadError(f"{path}: no model.safetensors or model.safetensors.index.json")
    shapes, where, split_up = {}, {}, {}
    for name in files:
        file = path / name
        try:
            with safe_open(str(file), framework="pt") as f:
                for stored in f.keys():
                    if (key := rename(stored)) is None:
                        continue
                    shapes[key] = tuple(f.get_slice(stored).get_shape())
                    where[key] = Stored(((file, stored),))
        except FileNotFoundError:
            raise ModelLoadError(f"{file}: listed in {index.name} but missing") from None
        except Exception as e:  # safetensors raises its own SafetensorError, not an OSError
            raise ModelLoadError(f"{file}: not a readable safetensors file "
                                 f"({type(e).__name__}: {e})".splitlines()[0]) from None
    stored = dict(where)
    for key in list(shapes):  # (all headers read: a part may read tensors of other shards)
        parts = split(key, shapes[key], shapes)
        if parts is None:
            continue
        del shapes[key], where[key]
        for part, part_shape, take, reads, _ in parts:
            shapes[part] = part_shape
            split_up[part] = Stored(tuple(stored[r].sources[0] for r in reads), take)
    return shapes, where | split_up


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
        fallback = _token_ids(cfg.get(f"{name}_id"),  # config.json's bos_token_id / eos_token_id
                              f"{path / 'config.json'}: {name}_id")
        return found if found is not None else (fallback[0] if fallback else None)

    templates = _chat_templates(path, tok_cfg)
    return Tokenizer(backend, bos_token_id=token_id("bos_token"), eos_token_id=token_id("eos_token"),
                     extra_eos_ids=_token_ids(gen.get("eos_token_id"),
                                              f"{path / 'generation_config.json'}: eos_token_id"),
                     add_bos=tok_cfg.get("add_bos_token"), add_eos=tok_cfg.get("add_eos_token"),
                     chat_template=templates.get("default"),
                     tool_use_template=templates.get("tool_use"))


def _chat_templates(path: Path, tok_cfg: dict) -> dict[str, str]:
    """The chat templates by name ("default", "tool_use", ...), where transformers keeps them:
    tokenizer_config.json's chat_template (one, or a list of {"name", "template"} objects),
    chat_template.jinja (the default) and additional_chat_templates/NAME.jinja; where none
    of them holds a default, a processor's chat_template.json (vision-language checkpoints
    keep theirs there)."""
    value = tok_cfg.get("chat_template")
    entries = (value if isinstance(value, list) else [] if value is None
               else [{"name": "default", "template": value}])
    if not all(isinstance(e, dict) and isinstance(e.get("name"), str)
               and isinstance(e.get("template"), str) for e in entries):
        raise ModelLoadError(f"{path / 'tokenizer_config.json'}: chat_template must be text or "
                             f"a list of {{\"name\": ..., \"template\": ...}} objects, not "
                             f"{str(value)[:60]!r}")
    templates = {e["name"]: e["template"] for e in entries}
    extra = path / "additional_chat_templates"
    files = [(path / "chat_template.jinja", "default")]
    files += [(f, f.stem) for f in sorted(extra.glob("*.jinja"))] if extra.is_dir() else []
    for file, name in files:
        if file.is_file():
            try:
                templates[name] = file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ModelLoadError(f"{file}: not readable as UTF-8 text ({e})") from None
    processor = path / "chat_template.json"
    if "default" not in templates and processor.is_file():
        value = _read_json(processor).get("chat_template")
        if not isinstance(value, str):
            raise ModelLoadError(f"{processor}: chat_template must be text, not "
                                 f"{str(value)[:60]!r}")
        templates["default"] = value
    return templates


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
