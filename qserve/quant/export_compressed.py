"""`qserve quantize SRC -o OUT --format compressed-tensors`: a Hugging Face directory in the
compressed-tensors layout (the `compressed-tensors` package defines it; vLLM and transformers
read it), holding exactly the weights qserve runs.

compressed-tensors stores signed codes x_q and an integer zero point zp, w = (x_q - zp) * s.
Each packed linear `<name>` becomes ("pack-quantized": 32 / bits codes per int32, code i of a
word at bits [i * bits, (i + 1) * bits), stored as x_q + 2^(bits-1)):

    <name>.weight_packed      int32 (out, in * bits / 32)
    <name>.weight_scale       fp16  (out, G)        G = 1 for per-channel int8
    <name>.weight_zero_point  int32 (out / 8, G)    asymmetric only: zp packed as the codes,
                                                    but along out (packed_dim 0)
    <name>.weight_shape       int64 (2,)            [out, in]

    qserve int4 sym   w = (q - 8) * s         -> num_bits 4, x_q = q - 8, strategy group
    qserve int4z      w = (q - z) * s         -> num_bits 4, x_q = q - 8, zp = z - 8, asymmetric
    qserve int8 sym   w = q * s               -> num_bits 8, x_q = q, strategy group or channel

qserve's asymmetric int4 keeps an fp16 offset per group (the group's minimum), which an
integer zero point cannot hold without re-rounding, so asymmetric recipes are refused, as are
padded last groups, a quantized embedding, and mixed schemes. int4z (an AWQ / GPTQ import) has
the integer zero points themselves, so export() writes it exactly (`qserve quantize AWQ_DIR
--format compressed-tensors` copies an import's tensors as stored); a zero of 16 (GPTQ v1's
stored -1) has no 4-bit zp and is refused. No compressed-tensors import is needed to write;
tests read the result back with the package and transformers.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from qserve.errors import QServeError
from qserve.formats import QuantizedTensor, unpack_int4

FORMAT = "pack-quantized"
LOSSLESS_RECIPES = ("w8 (int8 per channel), int8 with group_size 32/64/128, and int4 with "
                    "symmetric: true (w4g64-sym, or w4g32 / w4g128 with symmetric: true)")
WRITTEN = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
           "generation_config.json", "chat_template.jinja"}


def check_plans(arch, plans) -> None:
    """Raise QServeError unless every planned layer maps onto compressed-tensors exactly."""
    for p in plans:
        if p.scheme is None and p.packed:
            raise QServeError(f"{p.name} is GGUF {p.format.upper()} blocks, which compressed-"
                              f"tensors cannot hold; export it from a recipe that rounds "
                              f"({LOSSLESS_RECIPES})")
        if p.scheme is None:
            continue
        why = None
        if not p.scheme.sym and p.format != "int4z":
            why = ("an fp16 offset per group, which compressed-tensors' integer zero point "
                   "cannot hold without re-rounding")
        elif p.group_size is not None and p.shape[1] % p.group_size:
            why = f"a padded last group ({p.shape[1]} inputs)"
        elif p.name == "model.embed_tokens":
            why = "a quantized embedding, which the export leaves to linears"
        if why:
            raise QServeError(f"{p.name} would be {p.describe()} with {why}; compressed-"
                              f"tensors export takes {LOSSLESS_RECIPES} (group_fallback: "
                              f"divisor where a group size does not divide the inputs)")


def check_replaceable(out: Path, src: Path) -> None:
    """Raise unless `--force` may replace `out`: a compressed-tensors directory of only the
    files this export writes, not holding the source model."""
    if src.resolve().is_relative_to(out.resolve()):
        raise QServeError(f"{out} holds the source model {src}; write the export elsewhere")
    try:
        q = json.loads((out / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        q = {}
    others = [p.name for p in out.iterdir() if p.name not in WRITTEN] if out.is_dir() else []
    if q.get("quant_method") != "compressed-tensors" or others:
        raise QServeError(f"{out} exists and is not a compressed-tensors export qserve wrote; "
                          f"--force only replaces one. Remove it yourself or choose another "
                          f"directory")


def pack_codes(x_q: torch.Tensor, bits: int) -> torch.Tensor:
    """(rows, n) signed codes -> (rows, ceil(n * bits / 32)) int32: code i of a word at bits
    [i * bits, (i + 1) * bits), stored as x_q + 2^(bits - 1), a last word zero-filled (as the
    package's pack_to_int32)."""
    per_word = 32 // bits
    u = x_q.to(torch.int64) + (1 << (bits - 1))
    u = torch.nn.functional.pad(u, (0, -u.shape[1] % per_word)).view(u.shape[0], -1, per_word)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (u << shifts).sum(-1)  # (rows, n / per_word), fields disjoint: sum == or
    return (words - ((words >= 1 << 31).long() << 32)).to(torch.int32)  # as signed int32


def module_tensors(name: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
    """One packed linear `<name>.weight` -> its compressed-tensors tensors."""
    base = name.removesuffix(".weight")
    out, n_in = qt.shape
    assert qt.padded_in == n_in and (qt.format == "int4z" or qt.offsets is None), (
        name, qt.format)
    x_q = unpack_int4(qt.qweight).to(torch.int8) - 8 if qt.bits == 4 else qt.qweight
    tensors = {f"{base}.weight_packed": pack_codes(x_q, qt.bits),
               f"{base}.weight_scale": qt.scales.contiguous(),
               f"{base}.weight_shape": torch.tensor([out, n_in], dtype=torch.int64)}
    if qt.format == "int4z":
        if int(qt.offsets.max()) > 15:
            raise QServeError(f"{base} has a zero point of {int(qt.offsets.max())} (GPTQ v1's "
                              f"stored -1), which compressed-tensors' 4-bit zero points cannot "
                              f"hold; compressed-tensors export takes zero points 0..15")
        zp = qt.offsets.to(torch.int8) - 8  # (out, G), packed along out
        tensors[f"{base}.weight_zero_point"] = pack_codes(zp.t(), 4).t().contiguous()
    return tensors


def quantization_config(plans, tensors: dict) -> dict:
    """config.json's quantization_config: a config group per scheme (the plan's bits and
    group size, symmetric unless the tensor is int4z). One scheme targets every Linear but the
    dense ones (`ignore`); several (group_fallback: divisor, or a mixed import) name their
    linears."""
    by_scheme: dict[tuple, list[str]] = {}
    for p in plans:
        if p.scheme is not None:
            sym = tensors[p.name + ".weight"].format != "int4z"
            by_scheme.setdefault((p.scheme.bits, p.group_size, sym), []).append(p.name)
    groups = {}
    for i, ((bits, gs, sym), names) in enumerate(by_scheme.items()):
        weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
                   "strategy": "channel" if gs is None else "group", "group_size": gs,
                   "actorder": None, "observer": "minmax", "observer_kwargs": {}}
        groups[f"group_{i}"] = {"targets": ["Linear"] if len(by_scheme) == 1 else names,
                                "weights": weights, "input_activations": None,
                                "output_activations": None, "format": FORMAT}
    ignore = [p.name for p in plans if p.scheme is None and p.name != "model.embed_tokens"]
    return {"quant_method": "compressed-tensors", "format": FORMAT,
            "quantization_status": "compressed", "ignore": ignore or ["lm_head"],
            "config_groups": groups, "kv_cache_scheme": None}


def export(out: Path, loaded, tensors: dict, plans, atomic_dir) -> None:
    """Write the directory `out` through atomic_dir(out, write) (quantize's: a temporary
    sibling, then a rename)."""
    from qserve.loader.checkpoint import WEIGHTS_FILE, hf_config, save_checkpoint

    if not any(p.scheme is not None for p in plans):
        raise QServeError("the recipe keeps every linear dense: nothing to export quantized")
    flat = {}
    for name, w in tensors.items():
        if isinstance(w, QuantizedTensor):
            flat |= module_tensors(name, w)
        else:
            flat[name] = w
    config = hf_config(loaded.arch) | {"quantization_config": quantization_config(plans,
                                                                                  tensors)}
    assert WEIGHTS_FILE in WRITTEN

    def write(tmp: Path) -> None:
        save_checkpoint(tmp, loaded.arch, loaded.tokenizer, flat, {})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")  # not qserve's
    atomic_dir(out, write)
