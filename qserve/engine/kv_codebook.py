"""Calibrated codebooks for int4 keys (kernels/kv_quant.py, "int4 keys"): which key channels
get how many of the 4 bits a key value has on average.

A key's error reaches attention through q . k, so channel j's share of the score error is
E[k_j^2] E[q_j^2] times its relative quantization error. Post-RoPE, Llama keys put most of
their energy in a few slowly rotating channel pairs, and the queries that read them agree, so
the products span orders of magnitude across channels. Transform coding's answer is bit
allocation: give each bit to the channel whose weighted error it lowers most. Widths are
allocated per RoPE pair (j, j + d/2), whose two channels share one rotation and so one energy
budget over positions. Over 12 windows of the eval text, `qserve eval` measures int4 KV so
calibrated at +2.32% perplexity (70 bytes per token-head), against +3.95% for 5-bit rotated
keys and 3-bit values (72 bytes).

Calibration runs the model over CALIBRATION_WINDOWS windows of text from Python's standard
library docstrings (not the eval text), records the energy of every layer's post-RoPE keys
and queries (past position 0, the attention sink), and allocates. It takes a few seconds, so
the result is cached under $QSERVE_HOME/kv-codebooks, keyed by a fingerprint of the weights.
The text comes from the running Python's own modules, so another Python version calibrates on
slightly different text (and caches under the same key: a codebook, once made, is kept).
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import os
import tempfile

import torch

from qserve.kernels.kv_quant import KEY_BITS, MAX_KEY_WIDTH, key_codebook

log = logging.getLogger("qserve.kv_codebook")

# 1,024 tokens: a few seconds on a CPU. Against 4,096 tokens, 5% of the widths differ (by
# about a bit) and sigma by 6% on average; over 12 windows of the eval text int4 KV measured
# +2.32% PPL (KL 0.024) with this, +2.33% (KL 0.021) with 4,096.
CALIBRATION_WINDOWS = 2
WINDOW = 512
VERSION = 2  # bump when calibration or allocation changes, so no stale cache is read
# Modules whose documentation is the calibration text: English prose about code, like the
# eval text, but none of it.
DOC_MODULES = ("argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses",
               "datetime", "decimal", "email.message", "functools", "heapq", "http.client",
               "itertools", "json", "logging", "os", "pathlib", "pickle", "random", "re",
               "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile",
               "tempfile", "textwrap", "threading", "typing", "unittest", "urllib.parse",
               "zipfile")


def calibration_text() -> str:
    """The docstrings of DOC_MODULES and their public members, in a fixed order."""
    parts = []
    for name in DOC_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr in sorted(getattr(module, "__all__", None) or dir(module)):
            obj = getattr(module, attr, None)
            if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and getattr(obj, "__module__", "").startswith(name.split(".")[0]):
                parts.append(doc)
    return "\n\n".join(p for p in parts if p)


def allocate(weight: torch.Tensor, total: int) -> torch.Tensor:
    """Integer widths for weight (R, P) >= 0: per row, `total` bits given one at a time to the
    entry whose weighted error falls most, each at most MAX_KEY_WIDTH. Error model: uniform
    levels over +-3 sigma leave 3 / 4^b of sigma^2 (b >= 1); no bits leave all of it."""
    bits = torch.zeros(weight.shape, dtype=torch.long)

    def err(b: torch.Tensor) -> torch.Tensor:
        return weight * torch.where(b == 0, 1.0, 3.0 / 4.0 ** b.double())

    rows = torch.arange(weight.shape[0])
    for _ in range(total):
        gain = err(bits) - err(bits + 1)
        gain[bits >= MAX_KEY_WIDTH] = -1.0
        bits[rows, gain.argmax(-1)] += 1
    return bits


def codebook_from_energy(k2: torch.Tensor, q2: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean squared keys and queries (L, hkv, d) (queries averaged over each kv head's group)
    -> the codebook tensors, each (L, hkv, d)."""
    L, hkv, d = k2.shape
    half = d // 2
    k2, q2 = k2.double(), q2.double()
    weight = (k2[..., :half] + k2[..., half:]) * (q2[..., :half] + q2[..., half:])
    pair = allocate(weight.reshape(L * hkv, half), KEY_BITS * half).view(L, hkv, half)
    sigma = k2.clamp_min(1e-12).sqrt().float()
    return key_codebook(sigma, torch.cat([pair, pair], -1))


class _Recorder:
    """Stands in for a layer's RotaryEmbedding during calibration: rotates with `rope`, adds
    the rotated keys' and queries' squared means (past position 0) to `sums`, and tells
    `done()` (a progress bar's update) that this layer has run."""

    def __init__(self, rope, sums: list, layer: int, done):
        self.rope, self.sums, self.layer, self.done = rope, sums, layer, done

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        q, k = self.rope(positions, q, k)  # (T, H, d), (T, hkv, d)
        keep = positions > 0
        kk, qq = k[keep].float(), q[keep].float()
        hkv = k.shape[1]
        q2 = qq.unflatten(1, (hkv, -1)).pow(2).sum((0, 2)) / (q.shape[1] // hkv)
        s = self.sums[self.layer]  # on the CPU, in fp64
        s[0] += kk.pow(2).sum(0).cpu()
        s[1] += q2.cpu()
        s[2] += kk.shape[0]
        self.done()
        return q, k


@torch.inference_mode()
def calibrate(model, tokenizer) -> dict[str, torch.Tensor]:
    """Run `model` over the calibration text and allocate: codebook tensors (L, hkv, d)."""
    from qserve.models.build import prefill
    from qserve.models.rope import RotaryEmbedding
    from qserve.progress import bar

    arch = model.arch
    # the windows depend on the model alone, not on the context length it was built for (its
    # rope tables' size), so every engine of these weights calibrates alike
    window = min(WINDOW, arch.max_position_embeddings)

    def fresh(theta, scaling):
        return RotaryEmbedding(arch.head_dim, window, theta, scaling, model.dtype,
                               model.device, arch.rotary_dim)
    # each layer's own kind of rope (Gemma 3's sliding layers have a local base)
    own = {id(model.rope): fresh(arch.rope_theta, arch.rope_scaling)}
    if getattr(model, "local_rope", None) is not None:
        own[id(model.local_rope)] = fresh(arch.rope_local_theta, None)
    text = calibration_text()[: 16 * window * CALIBRATION_WINDOWS]  # > 4 characters a token
    ids = tokenizer.encode(text, add_special_tokens=False)
    windows = [ids[i * window:(i + 1) * window] for i in range(CALIBRATION_WINDOWS)]
    windows = [w for w in windows if len(w) > 1]
    zeros = torch.zeros(arch.num_kv_heads, arch.head_dim, dtype=torch.float64)
    sums = [[zeros.clone(), zeros.clone(), 0] for _ in model.layers]
    ropes = [layer.self_attn.rope for layer in model.layers]
    # a few seconds for 135M parameters, minutes for billions on a CPU: a bar of layers run
    shown = bar(len(windows) * len(model.layers), "calibrating the int4 KV codebook",
                unit="layer")
    try:
        for i, layer in enumerate(model.layers):
            rope = layer.self_attn.rope  # (one that rotates nothing has no table to rebuild)
            layer.self_attn.rope = _Recorder(own.get(id(rope), rope), sums, i, shown.update)
        for w in windows:
            prefill(model, w)
    finally:
        shown.close()
        for layer, rope in zip(model.layers, ropes):
            layer.self_attn.rope = rope
    k2 = torch.stack([s[0] / s[2] for s in sums])
    q2 = torch.stack([s[1] / s[2] for s in sums])
    return codebook_from_energy(k2, q2)


def fingerprint(model) -> str:
    """A digest of the model's weights: names, shapes, dtypes and an evenly spaced sample of
    every tensor's elements (all of a small one), plus VERSION and the calibration setup."""
    h = hashlib.sha256(f"{VERSION} {CALIBRATION_WINDOWS} {WINDOW} {DOC_MODULES}".encode())
    for name, t in sorted(model.state_dict().items()):
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)].cpu().contiguous()
        h.update(f"{name} {tuple(t.shape)} {t.dtype}".encode())
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:24]


def for_model(model, tokenizer) -> dict[str, torch.Tensor]:
    """The model's codebook: from the cache when this model was calibrated before, else
    calibrated now and cached (written to a temporary file, then renamed)."""
    from safetensors.torch import load_file, save_file

    from qserve.config import model_home

    path = model_home() / "kv-codebooks" / f"{fingerprint(model)}.safetensors"
    if path.exists():
        try:
            saved = load_file(str(path))
            return key_codebook(saved["sigma"], saved["width"])
        except Exception as e:  # unreadable or invalid (e.g. cut short): calibrate again
            log.warning("ignoring the cached KV codebook %s: %s", path, e)
    log.info("calibrating the int4 KV key codebook (first use of these weights): %s", path)
    book = calibrate(model, tokenizer)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        save_file({"sigma": book["k_sigma"], "width": book["k_width"]}, tmp)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home only costs calibrating again next time
        log.warning("cannot cache the KV codebook in %s: %s", path.parent, e)
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
    return book


def for_cache(model, tokenizer, kv_dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """The codebook a KV cache of storage dtype `kv_dtype` needs for `model`: int4's, or None."""
    return for_model(model, tokenizer) if kv_dtype == torch.uint8 else None
