"""`qserve quantize`: a loaded model and a recipe in, a qserve checkpoint directory out.

    plan_layers(arch, recipe)      which linears are packed how (group-size fallbacks decided
                                   here, so a recipe that cannot apply fails before any work)
    quantize_weights(...)          HF state dict -> packed state dict (+ AWQ scaling first)
    quantize(src, out, recipe)     load, plan, quantize, write to a temporary directory, rename

Every linear of every layer is planned, and the token embedding when the recipe says so. A
source that is quantized already (a qserve checkpoint, an AWQ / GPTQ directory) is copied as
stored instead, its plans read off its own tensors: rounded weights are never rounded again.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from qserve.errors import ConfigError, QServeError
from qserve.formats import ggml
from qserve.models.registry import num_params
from qserve.models.registry import fused_groups
from qserve.quant.recipe import Recipe, load_recipe
from qserve.quant.schemes import GROUP_SIZES, QuantizedTensor, WeightScheme, quantize as rtn

CALIB_TOKENS = 512
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class LayerPlan:
    name: str  # HF linear name without ".weight"
    shape: tuple[int, int]  # (out, in)
    scheme: WeightScheme | None  # None: kept dense
    group_size: int | None = None  # the group size used (None: per channel)
    note: str = ""
    # a copied source tensor's own format (int4z, ...), or with no scheme a GGUF tensor's GGML
    # blocks kept as stored (q4_k, iq4_xs, ...); None: rounded by the scheme
    format: str | None = None

    @property
    def packed(self) -> bool:
        """Stored packed: rounded by its scheme, copied, or a GGUF tensor's own blocks."""
        return self.scheme is not None or self.format in ggml.IN_PLACE

    def entry(self, w: QuantizedTensor) -> dict:
        """Its quantization_config.layers entry for the tensor written, w: the format is w's
        (an int4z tensor has 4 bits too, so the bits cannot name it; GGML blocks carry their
        own scales, so their format alone says how to read them)."""
        if self.scheme is None:
            assert w.format == self.format, (self.name, w.format)
            return {"format": w.format}
        assert self.format in (None, w.format) and w.bits == self.scheme.bits, (self.name,
                                                                                w.format)
        return {"format": w.format, "bits": w.bits, "group_size": self.group_size,
                "symmetric": self.scheme.sym}

    def describe(self) -> str:
        if self.scheme is None:
            return f"{self.format} (GGUF blocks)" if self.packed else "dense"
        text = str(WeightScheme(self.scheme.bits, self.group_size, self.scheme.sym))
        return text if self.format is None else f"{self.format} {text.split(' ', 1)[1]}"


def layer_entries(plans: list[LayerPlan], tensors: dict) -> dict[str, dict]:
    """quantization_config.layers: each packed linear's entry, its format read off its tensor."""
    return {p.name: p.entry(tensors[p.name + ".weight"]) for p in plans if p.packed}


EMBEDDING = "model.embed_tokens"


def linear_shapes(arch, embedding: bool = False) -> dict[str, tuple[int, int]]:
    """HF name (no ".weight") -> (out, in) of every linear [and the embedding, (vocab, hidden)]."""
    from qserve.loader.hf_loader import expected_shapes

    return {n.removesuffix(".weight"): s for n, s in expected_shapes(arch).items()
            if len(s) == 2 and (embedding or n != EMBEDDING + ".weight")}


def plan_layers(arch, recipe: Recipe, gguf_types: dict[str, str] | None = None
                ) -> list[LayerPlan]:
    """One plan per linear. gguf_types (method gguf): HF linear name -> GGUF type name.
    Raises ConfigError when the recipe's group size cannot apply and it says `error`."""
    plans = {}
    for name, shape in linear_shapes(arch, recipe.embedding == "quantize").items():
        if name != EMBEDDING and recipe.kept(name, arch.num_layers):
            plans[name] = LayerPlan(name, shape, None, note="kept by the recipe")
        elif recipe.method == "gguf":
            plans[name] = _gguf_plan(name, shape, gguf_types[name])
        else:
            plans[name] = _rtn_plan(name, shape, recipe)
    for parts in fused_groups(arch):  # the model runs each as one matrix: one format for all
        group = [plans[p] for p in parts]
        kinds = {(p.scheme, p.group_size, p.packed) for p in group}
        if len(kinds) == 1 or (recipe.method == "gguf" and all(p.packed for p in group)):
            continue  # GGUF blocks of different types run as row segments of one matrix
        if recipe.method != "gguf":
            raise ConfigError(
                f"recipe {recipe.name!r} treats {', '.join(p.name for p in group)} "
                f"differently, but they run as one fused matrix; keep or quantize them together")
        for p in group:  # e.g. an F16 v_proj next to Q4_0 q/k: keep the three dense
            p.scheme, p.group_size, p.format = None, None, None
            p.note = "kept dense: its fused partners have other GGUF types"
    return list(plans.values())


def _rtn_plan(name: str, shape: tuple[int, int], recipe: Recipe) -> LayerPlan:
    n_in, gs = shape[1], recipe.group_size
    plan = LayerPlan(name, shape, recipe.scheme, gs)
    if gs is None or n_in % gs == 0:
        return plan
    if recipe.group_fallback == "pad":
        plan.note = f"{n_in} inputs: last group of {gs} padded ({n_in % gs} real)"
    elif recipe.group_fallback == "divisor":
        fits = [g for g in GROUP_SIZES if g <= gs and n_in % g == 0]
        if not fits:
            raise ConfigError(f"group size {gs} does not divide {name}'s {n_in} inputs and no "
                              f"smaller group size of {GROUP_SIZES} does; use group_fallback: pad")
        plan.group_size = fits[-1]
        plan.note = f"group size {gs} does not divide {n_in} inputs: used {fits[-1]}"
    else:
        raise ConfigError(f"group size {gs} does not divide {name}'s {n_in} inputs; set the "
                          f"recipe's weights.group_fallback to pad or divisor")
    return plan


def _gguf_plan(name: str, shape: tuple[int, int], ggml_type: str) -> LayerPlan:
    """Q4_0 / Q4_1 / Q8_0 repacked into qserve's int4 / int8 (the loader's lossless repack),
    the types read in place kept as their blocks, the rest (F32, F16, BF16) dense."""
    schemes = {"Q4_0": WeightScheme(4, 32, True), "Q4_1": WeightScheme(4, 32, False),
               "Q8_0": WeightScheme(8, 32, True)}
    if ggml_type.lower() in ggml.IN_PLACE:
        return LayerPlan(name, shape, None, note=f"GGUF {ggml_type}, blocks as stored",
                         format=ggml_type.lower())
    if ggml_type not in schemes:
        return LayerPlan(name, shape, None, note=f"GGUF {ggml_type}: kept dense, as loaded")
    return LayerPlan(name, shape, schemes[ggml_type], 32, note=f"GGUF {ggml_type}, lossless")


def quantize_weights(loaded, recipe: Recipe, plans: list[LayerPlan], calib_ids=None,
                     progress=None) -> tuple[dict[str, torch.Tensor], dict]:
    """HF state dict -> the checkpoint's weights: dense tensors, and each packed linear as a
    QuantizedTensor under `<name>.weight`. Returns (weights, extra info for the summary: AWQ
    alphas). progress(label, total) is called once per finished step: each transformer
    block's calibration (AWQ), then each block's rounding; `total` counts them all."""
    weights, info = loaded.weights, {}
    by_name = {p.name: p for p in plans}
    total = num_steps(loaded.arch, recipe, plans)
    if recipe.method == "awq":
        import qserve.quant.awq as awq

        def fake_quant(name: str, w: torch.Tensor) -> torch.Tensor:
            p = by_name[name]
            return w if p.scheme is None else rtn(w, p.scheme, p.group_size).dequantize()

        weights, info["awq_alpha"] = awq.calibrate(
            loaded.arch, weights, calib_ids, fake_quant,
            progress=progress and (lambda i: progress(f"calibrated layer {i}", total)))
    dense = None if recipe.dense_dtype == "source" else _DTYPES[recipe.dense_dtype]
    out: dict[str, torch.Tensor] = {}
    for name in weights:  # dense tensors: norms, biases, embedding, kept linears
        plan = by_name.get(name.removesuffix(".weight"))
        if plan is not None and plan.packed:
            continue
        w = weights[name]
        if isinstance(w, QuantizedTensor):  # a GGUF tensor the plan keeps dense
            w = w.dequantize()
        if w.dim() == 1:
            out[name] = w.float()  # norms and biases: tiny, and AWQ may have rescaled them
        else:
            out[name] = w if dense is None else w.to(dense)
    for block, group in itertools.groupby(plans, key=_block_of):
        for plan in group:
            if not plan.packed:
                continue
            w = weights[plan.name + ".weight"]
            if recipe.method == "gguf":  # the loader repacked it or kept its blocks already
                want = plan.format or f"int{plan.scheme.bits}"
                assert isinstance(w, QuantizedTensor) and w.format == want, (plan.name, w.format)
                out[plan.name + ".weight"] = w
            else:  # a quantized source (a GGUF's blocks) is dequantized first
                w = w.dequantize() if isinstance(w, QuantizedTensor) else w.float()
                out[plan.name + ".weight"] = rtn(w, plan.scheme, plan.group_size)
        if progress:
            progress(block, total)
    return out, info


def num_steps(arch, recipe: Recipe, plans: list[LayerPlan]) -> int:
    """How many steps quantize_weights reports: each transformer block's AWQ calibration,
    then each block's rounding (and the embedding's and lm_head's, by name)."""
    blocks = sum(1 for _ in itertools.groupby(plans, key=_block_of))
    return blocks + (arch.num_layers if recipe.method == "awq" else 0)


def _block_of(plan: LayerPlan) -> str:
    """'layer 3' for model.layers.3.*, else the tensor's own name (embedding, lm_head)."""
    m = re.match(r"model\.layers\.(\d+)\.", plan.name)
    return f"layer {m.group(1)}" if m else plan.name


def summarize(loaded, plans: list[LayerPlan], tensors: dict[str, torch.Tensor]) -> dict:
    """Bytes before (fp16) and after, per linear and in total. `resident_*` counts what a
    --dtype fp16 engine keeps: packed linears, and every dense tensor at 2 bytes a value."""
    def nbytes(w) -> int:
        return w.nbytes if isinstance(w, QuantizedTensor) else w.numel() * w.element_size()

    layers = []
    for p in plans:
        layers.append({"name": p.name, "shape": list(p.shape), "scheme": p.describe(),
                       "note": p.note, "bytes_fp16": 2 * p.shape[0] * p.shape[1],
                       "bytes": nbytes(tensors[p.name + ".weight"])})
    fp16_total = 2 * num_params(loaded.arch)
    embed_fp16 = 2 * loaded.arch.vocab_size * loaded.arch.hidden_size
    embed = next((row["bytes"] for row, p in zip(layers, plans)
                  if p.name == EMBEDDING and p.packed), embed_fp16)
    packed = sum(row["bytes"] for row, p in zip(layers, plans) if p.packed)
    packed_fp16 = sum(row["bytes_fp16"] for row, p in zip(layers, plans) if p.packed)
    resident = fp16_total - packed_fp16 + packed
    return {
        "layers": layers,
        "bytes_fp16": fp16_total,
        "bytes": sum(nbytes(w) for w in tensors.values()),  # as written (dense tensors in the recipe's dense_dtype)
        "resident_bytes_fp16_engine": resident,
        "resident_ratio": resident / fp16_total,
        "resident_ratio_without_embedding": (resident - embed) / (fp16_total - embed_fp16),
        "quantized_linear_ratio": packed / packed_fp16 if packed_fp16 else 1.0,
    }


def resident_bytes(path: Path, arch) -> dict:
    """summarize()'s resident_* figures for a written checkpoint, from its safetensors header
    alone (no tensor data read): packed tensors as stored, dense ones at 2 bytes a value."""
    from safetensors import safe_open

    from qserve.loader.checkpoint import WEIGHTS_FILE

    itemsize = {"U8": 1, "I8": 1, "F16": 2, "BF16": 2, "F32": 4}
    resident = embed = 0
    with safe_open(str(Path(path) / WEIGHTS_FILE), "pt") as f:
        for name in f.keys():
            sl = f.get_slice(name)
            packed = name.rsplit(".", 1)[1] in ("qweight", "scales", "offsets")
            n = itemsize[sl.get_dtype()] if packed else 2
            for dim in sl.get_shape():
                n *= dim
            resident += n
            embed += n if name.startswith(EMBEDDING + ".") else 0
    fp16_total = 2 * num_params(arch)
    embed_fp16 = 2 * arch.vocab_size * arch.hidden_size
    return {"resident_bytes_fp16_engine": resident, "resident_ratio": resident / fp16_total,
            "resident_ratio_without_embedding": (resident - embed) / (fp16_total - embed_fp16)}


EXPORT_FORMATS = ("qserve", "gguf", "compressed-tensors")  # quantize(fmt=...)


def quantize(src: str | None, out: str | Path, recipe: str | Path | None = None,
             calib_text: str | Path | None = None, force: bool = False, progress=None,
             fmt: str = "qserve") -> dict:
    """Quantize the model `src` with `recipe` into the checkpoint directory `out`, or with
    fmt "gguf" / "compressed-tensors" into that format (export_gguf.py, export_compressed.py:
    recipes they cannot hold exactly are refused before any work; a copied source's layers
    once loaded, before anything is written).

    recipe None: a quantized source (a qserve checkpoint, an AWQ / GPTQ directory) copied as
    stored; gguf-native for a GGUF source with quantized linears (Q4_0 / Q4_1 / Q8_0 repacked,
    the other types' blocks kept, its float tensors dense: lossless); else w4g64. A recipe
    for a quantized source is refused unless it is a qserve checkpoint's own. Returns the
    summary. Nothing is left at `out` unless it succeeds.
    """
    from qserve.loader import load_arch, load_model, resolve_model

    out = Path(out)
    if out.exists() and not force:
        raise QServeError(f"{out} already exists; pass --force to replace it")
    src_path = resolve_model(src)
    exporter = _exporter(fmt)
    if out.exists() or out.is_symlink():
        (exporter.check_replaceable if exporter else _check_replaceable)(out, src_path)
    arch = load_arch(src_path)
    gguf_types = _gguf_types(src_path, arch)
    stored = _stored_quantization(src_path)
    if recipe is None and stored is None:
        quantized = {t for n, t in (gguf_types or {}).items() if n != EMBEDDING} - {
            "F32", "F16", "BF16"}  # the author's quantization is kept, never rounded again
        recipe = "gguf-native" if quantized else "w4g64"
    r = None if recipe is None else load_recipe(recipe)
    if r is not None and r.method == "gguf" and gguf_types is None:
        raise QServeError(f"recipe {r.name!r} imports GGUF blocks, but {src_path} is not a "
                          f"GGUF file; choose an rtn or awq recipe")
    if stored is not None:
        record, kv_dtype = _copied_recipe(src_path, stored, r, calib_text)
        loaded = load_model(src_path)
        tensors, plans = _copy(loaded)
        if exporter:
            exporter.check_plans(arch, plans)  # nothing written yet
        info = {}
    else:
        plans = plan_layers(arch, r, gguf_types)  # ConfigError here: nothing loaded or written
        if exporter:
            exporter.check_plans(arch, plans)
        loaded, tensors, info = _round(src_path, arch, r, plans, calib_text, progress)
        record, kv_dtype = r.to_dict(), r.kv_dtype
    summary = summarize(loaded, plans, tensors) | {
        "source": str(src_path), "out": str(out), "recipe": record.get("name"), **info}
    if exporter:
        exporter.export(out, loaded, tensors, plans, atomic_dir=_write_atomically)
        return summary | {"format": fmt}
    quant = {"recipe": record, "kv_dtype": kv_dtype, "layers": layer_entries(plans, tensors)}
    _write_atomically(out, lambda tmp: _save(tmp, loaded, tensors, quant))
    return summary


def _round(src: Path, arch, r: Recipe, plans: list[LayerPlan], calib_text, progress):
    """Load `src` and round its weights with recipe r (AWQ: calibrated on calib_text first).
    Returns (loaded, tensors, info)."""
    from qserve.loader import load_model

    text = None
    if r.method == "awq":
        from qserve.quant.awq import check
        from qserve.quant.calibration import read_text

        check(arch)  # before anything is loaded
        text = read_text(calib_text)
    elif calib_text is not None:
        raise QServeError(f"--calib-text applies to AWQ recipes; recipe {r.name!r} uses method "
                          f"{r.method}, which needs no calibration")
    # the gguf method keeps the file's blocks (repacked); the others round dense weights
    loaded = load_model(src, native=r.method == "gguf")
    ids = None
    if text is not None:
        ids = loaded.tokenizer.encode(text[:CALIB_TOKENS * 20],
                                      add_special_tokens=False)[:CALIB_TOKENS]
    tensors, info = quantize_weights(loaded, r, plans, ids, progress)
    return loaded, tensors, info


def _exporter(fmt: str):
    """The export module of a --format (None: a qserve checkpoint)."""
    if fmt == "gguf":
        import qserve.quant.export_gguf as exporter
    elif fmt == "compressed-tensors":
        import qserve.quant.export_compressed as exporter
    elif fmt == "qserve":
        return None
    else:
        raise QServeError(f"unknown format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}")
    return exporter


def _save(tmp: Path, loaded, tensors, quant) -> None:
    from qserve.loader.checkpoint import save_checkpoint

    if loaded.pooling is not None:  # an embedding model's own pooling stays its default
        quant = quant | {"pooling": loaded.pooling}
    save_checkpoint(tmp, loaded.arch, loaded.tokenizer, tensors, quant)


def _gguf_types(path: Path, arch) -> dict[str, str] | None:
    """HF linear (and embedding) name -> GGUF type name, or None if `path` is not a GGUF."""
    if path.is_dir():
        return None
    from qserve.loader.gguf_loader import GGUFFile, hf_names

    gguf = GGUFFile(path)
    linears = linear_shapes(arch, embedding=True)
    return {h.removesuffix(".weight"): gguf.tensors[g].ggml_type.name
            for g, h in hf_names(arch).items() if h.removesuffix(".weight") in linears}


def _stored_quantization(path: Path) -> dict | None:
    """The quantization_config of a source that is quantized already and so is copied, never
    rounded again: a qserve checkpoint's, an AWQ / GPTQ directory's; else None."""
    if not path.is_dir():
        return None
    from qserve.loader.awq_gptq import quant_config as awq_gptq_config
    from qserve.loader.checkpoint import quantization_config

    return quantization_config(path) or awq_gptq_config(path)


def _copied_recipe(src: Path, stored: dict, r: Recipe | None, calib_text) -> tuple[dict, str]:
    """(the recipe record, kv_dtype) a copy of the quantized source src writes. Only a qserve
    checkpoint's own recipe (or none) copies it; any other would re-round rounded weights."""
    if stored["quant_method"] == "qserve":
        have = stored.get("recipe") or {}
        if r is not None and _unnamed(have) != _unnamed(r.to_dict()):
            raise QServeError(f"{src} is already a qserve checkpoint (recipe "
                              f"{have.get('name')!r}); quantize its original model instead, or "
                              f"pass no --recipe to copy it")
        record, kv_dtype = have, stored.get("kv_dtype")
    else:
        method = stored["quant_method"]
        if r is not None:
            raise QServeError(f"{src} is already a quantized {method.upper()} checkpoint; "
                              f"quantize its original model instead, or pass no --recipe to copy "
                              f"its codes, scales and zero points as stored")
        record, kv_dtype = {"name": f"{method}-import", "kv_dtype": "auto",
                            "description": f"{method.upper()} codes, scales and zero points, "
                                           f"as stored",
                            "weights": {"method": "import", "quant_method": method}}, "auto"
    if calib_text is not None:
        raise QServeError(f"--calib-text applies to AWQ recipes; {src} is quantized already and "
                          f"copied as stored, which needs no calibration")
    return record, kv_dtype


def _unnamed(recipe: dict) -> dict:
    """A recipe record without its name and description: what it does."""
    return {k: v for k, v in recipe.items() if k not in ("name", "description")}


def _copy(loaded) -> tuple[dict, list[LayerPlan]]:
    """A quantized source's weights as stored, and a plan per linear read off its own tensors
    (format, group size, symmetry): packed ones copied, dense ones kept (a dense embedding
    unplanned, as plan_layers leaves it)."""
    weights = dict(loaded.weights)
    plans = []
    for name, shape in linear_shapes(loaded.arch, embedding=True).items():
        w = weights[name + ".weight"]
        if not isinstance(w, QuantizedTensor):
            if name != EMBEDDING:
                plans.append(LayerPlan(name, shape, None, note="dense in the source"))
            continue
        if w.format in ggml.IN_PLACE:  # a gguf-native checkpoint's GGML blocks
            plans.append(LayerPlan(name, shape, None, note="copied", format=w.format))
            continue
        assert w.format in ("int4", "int4z", "int8"), (name, w.format)
        per_channel = w.bits == 8 and w.scales.shape[1] == 1
        gs = None if per_channel else w.group_size
        plans.append(LayerPlan(name, shape, WeightScheme(w.bits, gs, w.offsets is None), gs,
                               "copied", w.format))
    return weights, plans


def _check_replaceable(out: Path, src: Path) -> None:
    """Raise unless `--force` may delete `out`: only a checkpoint qserve wrote, holding only
    the files it wrote, and neither the source model nor the model cache."""
    from qserve.loader.registry import model_home
    from qserve.loader.checkpoint import WEIGHTS_FILE, quantization_config

    written = {"config.json", WEIGHTS_FILE, "tokenizer.json", "tokenizer_config.json",
               "generation_config.json", "chat_template.jinja"}  # what save_checkpoint writes
    target = out.resolve()
    if src.resolve().is_relative_to(target):
        raise QServeError(f"{out} holds the source model {src}; --force would delete it. "
                          f"Write the checkpoint somewhere else")
    if model_home().resolve().is_relative_to(target):
        raise QServeError(f"{out} holds the model cache {model_home()}; --force would delete "
                          f"it. Write the checkpoint somewhere else")
    if not out.is_dir() or quantization_config(out, check=False) is None:
        raise QServeError(f"{out} exists and is not a qserve checkpoint; --force only replaces "
                          f"a checkpoint qserve wrote. Remove it yourself or choose another "
                          f"directory")
    others = sorted(p.name for p in out.iterdir() if p.name not in written)
    if others:
        raise QServeError(f"{out} holds {', '.join(others[:3])}{' ...' * (len(others) > 3)} "
                          f"besides the checkpoint; --force would delete it. Move it out or "
                          f"choose another directory")


def _write_atomically(out: Path, write) -> None:
    """write(tmp) into a hidden sibling of `out`, then rename it into place; on any failure
    or interrupt the temporary directory goes and `out` is as it was. A full or read-only
    disk is a QServeError. Siblings a killed run left behind are removed first."""
    from safetensors import SafetensorError

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(out)
        write(tmp)
        if out.exists():
            out.rename(old)
        tmp.rename(out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out.exists():
            old.rename(out)
        if isinstance(e, (OSError, SafetensorError)):  # a full or read-only disk, ...
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise QServeError(f"cannot write the checkpoint {out}: {why}") from None
        raise
    shutil.rmtree(old, ignore_errors=True)


def _remove_stale(out: Path) -> None:
    """Remove `.OUT.tmp-PID` siblings (and `.OUT.old-PID` once OUT exists again) left by a run
    that was killed, i.e. whose PID is no longer alive, so they do not pile up."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(tmp|old)-(\d+)")
    for p in out.parent.iterdir():
        m = pattern.fullmatch(p.name)
        if m is None or not p.is_dir() or p.is_symlink() or _alive(int(m.group(2))):
            continue
        if m.group(1) == "tmp" or out.exists():
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # ours, from an earlier call in this process that was interrupted
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
