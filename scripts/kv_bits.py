#!/usr/bin/env python3
"""How many bits do keys and values each need? Perplexity of the default model over the eval
text with K and V fake-quantized (quantize, then dequantize) at different widths, in the cache's
own basis (Hadamard-rotated, one fp16 scale and offset per token and kv head), before attention.

    python scripts/kv_bits.py [--windows 2] [--variants fp32,K5-V3-clip,...]

This is a study, not the serving path: attention here is dense causal SDPA over the window,
and the K/V it reads are quantized the way a paged cache would store them. `qserve eval` gives
the served number for what the cache implements (int8, and int4 = K5-V3-clip below); this
script also explores allocations it does not. Bytes per (token, kv head) are K + V at head_dim
64, against fp16's 256; the issue's 3.5x-fewer-bytes bound is 73 bytes.

Variants: "fp32"; "K<b>-V<b>" with widths 2..8 (2..7 with -clip) or "fp" for one side
unquantized; a suffix "-clip" quantizes as the cache does (the range cut that gives the least
squared error, kv_quant.quantize_packed; without it, plain min-max), and "-sink<n>" keeps the
first n positions of each window unquantized (attention-sink tokens). "K5-V3-clip" is the
cache's int4.
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


def quantizer(bits: str, clip: bool = False):
    """'fp' -> None; '<b>' -> x -> H fake_asym(H x) (H the cache's Hadamard rotation)."""
    if bits == "fp":
        return None
    b = int(bits)
    if not 2 <= b <= (7 if clip else 8):
        raise SystemExit(f"bit width {b} is outside 2..{7 if clip else 8}")
    return lambda x: kv_quant.hadamard_transform(fake_asym(kv_quant.hadamard_transform(x), b, clip))


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
    size = sum(128 if b == "fp" else 64 * int(b) // 8 + 4 for b in (parts[0][1:], parts[1][1:]))
    return quantizer(parts[0][1:], clip), quantizer(parts[1][1:], clip), sink, size


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
    current = {}

    def attention(q, k, v, cache, meta, scale):  # dense causal attention over quantized K/V
        fk, fv, sink, _ = current["v"]
        kq, vq = (fk(k) if fk else k), (fv(v) if fv else v)
        kq[:sink], vq[:sink] = k[:sink], v[:sink]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), kq.transpose(0, 1),
                                           vq.transpose(0, 1), is_causal=True, scale=scale,
                                           enable_gqa=True)
        return o.transpose(0, 1)

    llama.attention = attention  # what Attention.forward calls after the projections and rope
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
                pos = torch.arange(len(w))
                x = model.embed_tokens(torch.tensor(w))
                for layer in model.layers:
                    x = layer(x, pos, None, None)
                lp = torch.log_softmax(model.compute_logits(model.norm(x)), -1)[:-1]
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
