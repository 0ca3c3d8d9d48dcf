"""Recipes: a weight scheme and a default KV dtype, named in `recipes/<name>.yaml`.

    name: w4g64                    # defaults to the file's stem
    description: int4, groups of 64, scale + offset per group
    kv_dtype: fp16                 # the KV cache dtype the checkpoint suggests
    weights:
      method: rtn                  # rtn | awq (activation-aware scales, then rtn) | gguf
      bits: 4                      # 4 | 8
      group_size: 64               # 32 | 64 | 128 | null (8-bit only: one per output channel)
      symmetric: false
      group_fallback: pad          # a group size that does not divide in_features:
                                   #   pad (the last group) | divisor (largest that divides) | error
      keep: [lm_head]              # linears kept dense, fnmatch patterns over HF names without
                                   #   ".weight"; {first} / {last} are the first / last layer index
      dense_dtype: fp16            # 2-D tensors left dense (embedding, kept linears):
                                   #   fp16 | bf16 | fp32 | source (as loaded)
      embedding: dense             # dense | quantize (the token embedding, in the same scheme;
                                   #   tied to the output, that quantizes the lm_head too)

`method: gguf` imports the blocks of a GGUF source losslessly (Q4_0, Q4_1, Q8_0) and takes no
bits / group keys; tensors of other GGUF types are kept dense.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from qserve.errors import ConfigError
from qserve.quant.schemes import BITS, GROUP_SIZES, WeightScheme

RECIPE_DIR = Path(__file__).resolve().parent.parent.parent / "recipes"
METHODS = ("rtn", "awq", "gguf")
FALLBACKS = ("pad", "divisor", "error")
DENSE_DTYPES = ("fp16", "bf16", "fp32", "source")
_TOP_KEYS = ("name", "description", "kv_dtype", "weights")
_WEIGHT_KEYS = ("method", "bits", "group_size", "symmetric", "group_fallback", "keep",
                "dense_dtype", "embedding")


@dataclass
class Recipe:
    name: str
    description: str = ""
    kv_dtype: str = "auto"
    method: str = "rtn"
    bits: int = 4
    group_size: int | None = 64
    symmetric: bool = False
    group_fallback: str = "pad"
    keep: list[str] = field(default_factory=lambda: ["lm_head"])
    dense_dtype: str = "fp16"
    embedding: str = "dense"

    @property
    def scheme(self) -> WeightScheme:
        assert self.method != "gguf"
        return WeightScheme(self.bits, self.group_size, self.symmetric)

    def kept(self, layer: str, num_layers: int) -> bool:
        """Whether HF linear `layer` (no ".weight") stays dense."""
        return any(fnmatch.fnmatchcase(layer, p.format(first=0, last=num_layers - 1))
                   for p in self.keep)

    def to_dict(self) -> dict:
        weights = {"method": self.method, "keep": list(self.keep), "dense_dtype": self.dense_dtype,
                   "embedding": self.embedding}
        if self.method != "gguf":
            weights |= {"bits": self.bits, "group_size": self.group_size,
                        "symmetric": self.symmetric, "group_fallback": self.group_fallback}
        return {"name": self.name, "description": self.description, "kv_dtype": self.kv_dtype,
                "weights": weights}


def available() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def load_recipe(spec: str | Path) -> Recipe:
    """A recipe by name (recipes/<name>.yaml) or by path to a YAML file. Raises ConfigError
    naming the bad key or value."""
    path = Path(spec)
    if not (path.suffix in (".yaml", ".yml") or path.exists()):
        path = RECIPE_DIR / f"{spec}.yaml"
        if not path.exists():
            raise ConfigError(f"unknown recipe {str(spec)!r}; choose one of "
                              f"{', '.join(available())}, or pass a .yaml path")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"recipe {str(path)!r} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"recipe {str(path)!r} is not UTF-8 text") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe {str(path)!r} is not valid YAML "
                          f"({str(e).splitlines()[0]})") from None
    return parse_recipe(data, default_name=path.stem, where=str(path))


def parse_recipe(data, default_name: str = "custom", where: str = "recipe") -> Recipe:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a recipe is a YAML mapping with keys {', '.join(_TOP_KEYS)}")
    _check_keys(data, _TOP_KEYS, where)
    weights = data.get("weights")
    if not isinstance(weights, dict):
        raise ConfigError(f"{where}: key 'weights' must be a mapping with keys "
                          f"{', '.join(_WEIGHT_KEYS)}")
    _check_keys(weights, _WEIGHT_KEYS, where, "weights.")
    r = Recipe(name=str(data.get("name", default_name)), description=str(data.get("description", "")))
    r.kv_dtype = _choice(data, "kv_dtype", _kv_dtypes(), "auto", where)
    r.method = _choice(weights, "method", METHODS, "rtn", where, "weights.")
    r.dense_dtype = _choice(weights, "dense_dtype", DENSE_DTYPES,
                            "source" if r.method == "gguf" else "fp16", where, "weights.")
    r.embedding = _choice(weights, "embedding", ("dense", "quantize"), "dense", where, "weights.")
    keep = weights.get("keep", ["lm_head"])
    if not (isinstance(keep, list) and all(isinstance(k, str) for k in keep)):
        raise ConfigError(f"{where}: key 'weights.keep' must be a list of name patterns, "
                          f"e.g. [lm_head, 'model.layers.{{last}}.*']")
    for pattern in keep:
        try:
            pattern.format(first=0, last=0)
        except (KeyError, IndexError, ValueError, AttributeError):
            raise ConfigError(f"{where}: key 'weights.keep' has the pattern {pattern!r}; the "
                              f"only placeholders are {{first}} and {{last}} (write a literal "
                              f"brace as {{{{ or }}}})") from None
    r.keep = keep
    if r.method == "gguf":
        extra = [k for k in ("bits", "group_size", "symmetric", "group_fallback") if k in weights]
        if extra:
            raise ConfigError(f"{where}: key 'weights.{extra[0]}' does not apply to method gguf, "
                              f"which keeps the GGUF's own blocks")
        return r
    r.bits = _choice(weights, "bits", BITS, 4, where, "weights.")
    r.symmetric = _choice(weights, "symmetric", (True, False), r.bits == 8, where, "weights.")
    r.group_fallback = _choice(weights, "group_fallback", FALLBACKS, "pad", where, "weights.")
    sizes = GROUP_SIZES + ((None,) if r.bits == 8 else ())
    r.group_size = _choice(weights, "group_size", sizes, 64 if r.bits == 4 else None, where,
                           "weights.")
    if r.bits == 8 and not r.symmetric:
        raise ConfigError(f"{where}: key 'weights.symmetric' must be true for bits 8 "
                          f"(int8 weights are symmetric)")
    return r


def _kv_dtypes() -> tuple:
    from qserve.config import KV_DTYPES

    return KV_DTYPES


def _check_keys(d: dict, allowed: tuple, where: str, prefix: str = "") -> None:
    for key in d:
        if key not in allowed:
            raise ConfigError(f"{where}: unknown key '{prefix}{key}'; allowed: "
                              f"{', '.join(prefix + k for k in allowed)}")


def _choice(d: dict, key: str, allowed: tuple, default, where: str, prefix: str = ""):
    value = d.get(key, default)
    # yaml reads `true` as a bool and `4` as an int; 1 == True, so compare types too
    if not any(value == a and type(value) is type(a) for a in allowed):
        shown = ", ".join("null" if a is None else str(a).lower() if isinstance(a, bool)
                          else str(a) for a in allowed)
        raise ConfigError(f"{where}: key '{prefix}{key}' is {value!r}; allowed: {shown}")
    return value
