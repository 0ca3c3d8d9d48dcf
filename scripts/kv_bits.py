#!/usr/bin/env python3
"""How many bits do keys and values each need? Perplexity of the default model over the eval
text with K and V fake-quantized (quantize, then dequantize) at different widths, in the cache's
own basis (Hadamard-rotated, one fp16 scale and offset per token and kv head), before attention.

    python scripts/kv_bits.py [--windows 2] [--variants fp32,K5-V3-clip,...]

This is a study, not the serving path: attention here is dense causal SDPA over the window,
and the K/V it reads are quantized the way a paged cache would store them. `qserve eval` gives
the served number for what the cache implements (int8, and int4 = KA4-V4-clip below, with
the cache's own calibration text); this script also explores allocations it does not. Bytes
per (token, kv head) are K + V at head_dim 64, against fp16's 256; the issue's
3.5x-fewer-bytes bound is 73 bytes.

Variants: "fp32"; "K<b>-V<b>" with widths 2..8 (2..7 with -clip) or "fp" for one side
unquantized; a suffix "-clip" quantizes as the cache does (the range cut that gives the least
squared error, kv_quant.quantize_packed; without it, plain min-max), and "-sink<n>" keeps the
first n positions of each window unquantized (attention-sink tokens). "K5-V3-clip" was the
cache's int4 before the keys' bit allocation.

Keys can also be coded with bit allocation instead of the rotation: "KA<b>" (b may be
fractional, e.g. KA4.25) gives each RoPE channel pair of each layer and kv head its own integer
width, b on average, by the calibrated energy of the keys times that of the queries that read
them (transform coding: bits go where q . k errors are largest), then quantizes each channel
over +-t sigma_j, sigma_j its calibrated RMS and t the token's largest |k_j| / sigma_j over
coded channels, stored as one fp16 (d b / 8 + 2 bytes). "KA4-V4-clip" is the cache's int4
(qserve/engine/kv_codebook.py). Calibration here: the last 4 windows of the text, never scored
(the cache calibrates on other text).
The same allocation for values, weighted by the output projection's columns, measured worse
than the rotation in a one-off run (4 windows, values alone at 4 bits: +0.81% vs +0.60%), so
values keep the rotation here.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("QSERVE_HOME", str(REPO / ".cache" / "qserve"))

from qserve.eval import default_text  # noqa: E402
from qserve.kernels import kv_quant  # noqa: E402
from qserve.loader import load_model  # noqa: E402
from qserve.models import llama  # noqa: E402
from qserve.quant.calibration import build_model  # noqa: E402
from qserve.engine.kv_codebook import allocate  # noqa: E402

DEFAULT = ("fp32,K4-V4,K4-V4-clip,K5-V3,K5-V3-clip,K5-V3-clip-sink1,K5-V4-clip,Kfp-V3-clip,"
           "K5-Vfp-clip")


def fake_asym(y: torch.Tensor, bits: int, clip: bool = False) -> torch.Tensor:
    """Asymmetric per-row quantization of y (..., d) to `bits`, fp16 scale and offset, over
    the row's min-max range; with `clip`, the cache's own quantizer, which also tries ranges
    cut at both ends and keeps the least squared error (kv_quant.quantize_packed)."""
    if clip:
        return kv_quant.dequantize_packed(*kv_quant.quantize_packed(y, bits), bits, y.dtype)
    lo = y.amin(-1, keepdim=True).half().float()
    levels = 2 ** bits - 1
    s = ((y.amax(-1, keepdim=True) - lo) / levels).clamp_min(2 ** -14).half().float()
    return torch.round((y - lo) / s).clamp(0, levels) * s + lo


def fake_alloc(x: torch.Tensor, sigma: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """x (T, hkv, d) -> each channel j on 2^bits_j midrise levels over +-t sigma_j, with t the
    token's largest coded |x_j| / sigma_j in fp16; sigma, bits (hkv, d). At 4 bits this is
    the cache's int4 keys (kv_quant.quantize_keys); here the average may be any."""
    z = x / sigma
    t = torch.where(bits > 0, z.abs(), 0).amax(-1, keepdim=True).half().float().clamp_min(2 ** -14)
    n = 2.0 ** bits
    step = 2 * t / n
    q = torch.minimum(torch.floor((z + t) / step).clamp_min(0), n - 1)
    return torch.where(bits > 0, (q + 0.5) * step - t, 0.0) * sigma


def quantizer(bits: str, clip: bool = False, which: str = "K"):
    """'fp' -> None; '<b>' -> (x, layer) -> H fake_asym(H x) (H the cache's Hadamard rotation);
    'A<b>' (keys) -> (x, layer) -> fake_alloc with that layer's allocation (make_allocation)."""
    if bits == "fp":
        return None
    if bits.startswith("A"):
        if which != "K":
            raise SystemExit("bit allocation (A<b>) is for keys only")
        avg = float(bits[1:])
        return lambda x, layer: fake_alloc(x, *ALLOC[avg][layer])
    b = int(bits)
    if not 2 <= b <= (7 if clip else 8):
        raise SystemExit(f"bit width {b} is outside 2..{7 if clip else 8}")
    return lambda x, layer: kv_quant.hadamard_transform(
        fake_asym(kv_quant.hadamard_transform(x), b, clip))


CALIBRATION_WINDOWS = 4
ALLOC: dict[float, list] = {}  # average key bits -> per layer (sigma, bits), each (hkv, d)
STATS: list = []  # per layer: key energy, query energy per kv head, each (hkv, d)


def make_allocation(avg: float) -> None:
    """ALLOC[avg] from STATS: one width per RoPE pair (j, j + d / 2), by key x query energy."""
    ALLOC[avg] = []
    for k2, q2 in STATS:
        half = k2.shape[-1] // 2
        sigma = k2.clamp_min(1e-12).sqrt()
        weight = (k2[:, :half] + k2[:, half:]) * (q2[:, :half] + q2[:, half:])  # (hkv, d / 2)
        bits = allocate(weight, round(avg * half))
        ALLOC[avg].append((sigma, torch.cat([bits, bits], -1)))


def parse(name: str) -> tuple:
    """'K5-V3-sink1' -> (K quantizer, V quantizer, sink, bytes per token-head)."""
    if name == "fp32":
        return None, None, 0, 256
    parts = name.split("-")
    flags = parts[2:]
    if len(parts) < 2 or parts[0][:1] != "K" or parts[1][:1] != "V" or not all(
            f == "clip" or (f.startswith("sink") and f[4:].isdigit()) for f in flags):
        raise SystemExit(f"variant {name!r}: expected K<bits>-V<bits>[-clip][-sink<n>]")
    sink = next((int(f[4:]) for f in flags if f.startswith("sink")), 0)
    clip = "clip" in flags
    size = 0
    for b in (parts[0][1:], parts[1][1:]):
        if b == "fp":
            size += 128
        elif b.startswith("A"):
            size += round(64 * float(b[1:]) / 8) + 2
        else:
            size += 64 * int(b) // 8 + 4
    return quantizer(parts[0][1:], clip, "K"), quantizer(parts[1][1:], clip, "V"), sink, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=2, help="windows of --context tokens")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--variants", default=DEFAULT)
    args = ap.parse_args()
    variants = {name: parse(name) for name in args.variants.split(",")}
    torch.set_num_threads(os.cpu_count() or 1)

    loaded = load_model(None)
    model = build_model(loaded.arch, loaded.weights, args.context)
    ids = loaded.tokenizer.encode(default_text(), add_special_tokens=False)
    windows = [ids[i * args.context:(i + 1) * args.context] for i in range(args.windows)]
    current = {"v": (None, None, 0, 256), "layer": 0, "calibrate": False}

    def attention(q, k, v, cache, meta, scale):  # dense causal attention over quantized K/V
        layer = current["layer"]
        current["layer"] += 1
        if current["calibrate"]:  # energies past the first (sink) position
            g = q.shape[1] // k.shape[1]
            k2 = k[1:].pow(2).mean(0)
            q2 = q[1:].unflatten(1, (k.shape[1], g)).pow(2).mean((0, 2))
            if len(STATS) <= layer:
                STATS.append([0, 0])
            STATS[layer][0] += k2 / CALIBRATION_WINDOWS
            STATS[layer][1] += q2 / CALIBRATION_WINDOWS
        fk, fv, sink, _ = current["v"]
        kq, vq = (fk(k, layer) if fk else k), (fv(v, layer) if fv else v)
        kq[:sink], vq[:sink] = k[:sink], v[:sink]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), kq.transpose(0, 1),
                                           vq.transpose(0, 1), is_causal=True, scale=scale,
                                           enable_gqa=True)
        return o.transpose(0, 1)

    llama.attention = attention  # what Attention.forward calls after the projections and rope

    def forward(w: list[int]) -> torch.Tensor:  # log-probs of the window's next tokens
        current["layer"] = 0
        pos = torch.arange(len(w))
        x = model.embed_tokens(torch.tensor(w))
        for layer in model.layers:
            x = layer(x, pos, None, None)
        return torch.log_softmax(model.compute_logits(model.norm(x)), -1)[:-1]

    averages = {float(n.split("-")[0][2:]) for n in variants if n.startswith("KA")}
    if averages and (args.windows + CALIBRATION_WINDOWS) * args.context > len(ids):
        raise SystemExit("the text is too short to calibrate on tokens that are not scored")
    if averages:
        current["calibrate"] = True
        with torch.inference_mode():
            for i in range(1, CALIBRATION_WINDOWS + 1):
                forward(ids[-i * args.context:len(ids) - (i - 1) * args.context])
        current["calibrate"] = False
        for avg in averages:
            make_allocation(avg)
    ref = None
    print(f"{sum(len(w) - 1 for w in windows)} predicted tokens, {args.windows} windows of "
          f"{args.context}; bytes are K + V per (token, kv head), fp16 = 256\n")
    print("| K / V        | bytes | x fp16 |      PPL |   dPPL |     KL | top-1 |")
    print("|--------------|-------|--------|----------|--------|--------|-------|")
    for name, variant in variants.items():
        current["v"] = variant
        logps, nll, n = [], 0.0, 0
        with torch.inference_mode():
            for w in windows:
                lp = forward(w)
                nll -= lp.gather(1, torch.tensor(w[1:])[:, None]).sum().item()
                n += len(w) - 1
                logps.append(lp)
        lp, ppl = torch.cat(logps), math.exp(nll / n)
        if ref is None:
            ref = (ppl, lp)
        kl = (ref[1].exp() * (ref[1] - lp)).sum(-1).mean().item()
        top1 = (ref[1].argmax(-1) == lp.argmax(-1)).float().mean().item()
        print(f"| {name:12s} | {variant[3]:5d} | {256 / variant[3]:5.2f}x | {ppl:8.4f} | "
              f"{100 * (ppl / ref[0] - 1):+5.2f}% | {kl:.4f} | {100 * top1:4.1f}% |", flush=True)


if __name__ == "__main__":
    main()
