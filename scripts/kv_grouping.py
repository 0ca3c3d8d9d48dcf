"""Which grouping should quantized KV use? Measures, on the real default model, the error each
scheme puts into the attention output, layer by layer, against fp32 K/V.

    python scripts/kv_grouping.py [--tokens 512]

Q/K/V are captured from one fp32 prefill over the start of the pydoc topics text (the eval
text). For each scheme, K and V are quantized then dequantized, causal attention is recomputed,
and the table prints the relative error ||o - o_q|| / ||o|| (mean over layers) with the bytes
each (token, kv head) costs. "per-channel keys" is KIVI's grouping (one scale/offset per channel
over the 16 tokens of a block), measured here with the whole block known up front: the most
favourable case for it, since a paged cache writes a block one token at a time.

"smoothed keys" first applies the exact rewrite q_c * s_c, k_c / s_c (smooth_keys; foldable into
q_proj / k_proj rows at load time, s a power of two so even packed rows scale exactly) with the
per-channel s that minimizes the logit error under the cache's unchanged int4 numerics. It
gains nothing on SmolLM2-135M: each head's query and key energy spectra are nearly
proportional (the same low-frequency RoPE pairs carry most of both), and for proportional
spectra s = 1 is already optimal; the most it can cut the logit error's variance,
(sum Q)(sum K) / (sum sqrt(QK))^2, is 1.02-1.12x per head (1.4x in one head of layer 0).
Through `qserve eval` (2 windows of 1024) the same rewrite folded into the weights moved int4
KV from +6.69% PPL to +7.30% (keys only) and +7.07% (values also smoothed, against o_proj's
columns; KL 0.0627 -> 0.0575): noise, not a gain. Keys carry most of the error
(attention-output error 0.141 with only K quantized, 0.063 with only V), hence the
"int8 keys, int4 values" row.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from qserve.kernels import kv_quant


def fake_int4_groups(x: torch.Tensor, group: int, symmetric: bool = False) -> torch.Tensor:
    """x (T, hkv, d) -> quantize/dequantize in groups of `group` channels per (token, head)."""
    T, h, d = x.shape
    g = x.reshape(T, h, d // group, group)
    if symmetric:  # levels -7..7, one fp16 scale per group
        s = (g.abs().amax(-1, keepdim=True) / 7).clamp_min(2 ** -14).half().float()
        return (torch.round(g / s).clamp(-7, 7) * s).reshape(T, h, d)
    packed, scale, offset = kv_quant.quantize_packed(g, 4)
    return kv_quant.dequantize_packed(packed, scale, offset, 4, torch.float32).reshape(T, h, d)


def fake_per_channel(x: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """KIVI keys: asymmetric, one fp16 scale/offset per (block of tokens, head, channel)."""
    T, h, d = x.shape
    pad = -T % block
    xp = torch.cat([x, x[-1:].expand(pad, h, d)]) if pad else x
    g = xp.reshape(-1, block, h, d)
    lo = g.amin(1, keepdim=True).half().float()
    levels = 2 ** bits - 1
    s = ((g.amax(1, keepdim=True) - lo) / levels).clamp_min(2 ** -14).half().float()
    out = torch.round((g - lo) / s).clamp(0, levels) * s + lo
    return out.reshape(-1, h, d)[:T]


def fake_int8(x: torch.Tensor) -> torch.Tensor:
    return kv_quant.dequantize_int8(*kv_quant.quantize_int8(x), torch.float32)


def fake_int4(x: torch.Tensor) -> torch.Tensor:
    return kv_quant.dequantize_packed(*kv_quant.quantize_packed(x, 4), 4, torch.float32)


def rotated(fake):
    """Quantize in a Hadamard-rotated basis (QuaRot-style), rotate back after."""
    def f(x):
        h = kv_quant.hadamard(x.shape[-1])
        return fake(x @ h) @ h
    return f


def smooth_keys(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact rewrite q_c * s_c, k_c / s_c (q . k unchanged), s equal within each RoPE pair
    (c, c + d/2) and a power of two, s = (K_c / Q_c)^(1/4) with K, Q the pair's mean key energy
    and its query heads' mean query energy: the s that minimizes the logit error
    (sum s^2 Q)(sum K / s^2) when quantization leaves an isotropic error of size ~|k / s|."""
    T, H, d = q.shape
    hkv = k.shape[1]
    pair = lambda e: e[..., : d // 2] + e[..., d // 2:]  # noqa: E731  RoPE-invariant energies
    Q = pair(q.pow(2).mean(0)).view(hkv, H // hkv, d // 2).mean(1)  # (hkv, d/2)
    K = pair(k.pow(2).mean(0))
    s = torch.exp2(torch.round(torch.log2((K / Q) ** 0.25)))
    s = torch.cat([s, s], -1)  # (hkv, d)
    return q * s.repeat_interleave(H // hkv, 0), k / s


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q (T, H, d), k/v (T, hkv, d) -> (T, H, d), causal."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, enable_gqa=True)
    return out.transpose(0, 1)


def capture(num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer: q (T, H, d), k, v (T, hkv, d) of one fp32 prefill, q and k after RoPE (taken
    at each layer's fused q|k|v projection, whatever attention kernel runs after it)."""
    from qserve.eval import default_text
    from qserve.loader import load_model
    from qserve.quant.calibration import build_model, prefill

    loaded = load_model(None)
    ids = loaded.tokenizer.encode(default_text(), add_special_tokens=False)[:num_tokens]
    model = build_model(loaded.arch, loaded.weights, num_tokens)
    a, positions = loaded.arch, torch.arange(len(ids))
    seen = []

    def hook(_, __, out):  # out (T, (H + 2 hkv) d)
        q, k, v = out.split([a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim,
                             a.num_kv_heads * a.head_dim], dim=-1)
        q, k = model.rope(positions, q.reshape(len(ids), a.num_heads, a.head_dim),
                          k.reshape(len(ids), a.num_kv_heads, a.head_dim))
        seen.append((q, k, v.reshape(len(ids), a.num_kv_heads, a.head_dim)))

    hooks = [layer.self_attn.qkv_proj.register_forward_hook(hook) for layer in model.layers]
    try:
        prefill(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    layers = capture(args.tokens)
    d = layers[0][1].shape[-1]
    schemes = {  # name: (bytes per (token, head) for K + V, fake-quant K, fake-quant V)
        "int8 per-token": (2 * (d + 2), fake_int8, fake_int8),
        "int8 per-token, Hadamard": (2 * (d + 2), rotated(fake_int8), rotated(fake_int8)),
        "int8 per-channel keys": (d + 2 + d + d * 4 // 16, lambda x: fake_per_channel(x, 16, 8),
                                  fake_int8),
        "int4 per-token g64": (2 * (d // 2 + 4), fake_int4, fake_int4),
        "int4 per-token g64, Hadamard": (2 * (d // 2 + 4), rotated(fake_int4),
                                         rotated(fake_int4)),
        "int8 keys, int4 values, Hadamard": (d + 2 + d // 2 + 4, rotated(fake_int8),
                                              rotated(fake_int4)),
        "int4 per-token g32": (2 * (d // 2 + 4 * d // 32), lambda x: fake_int4_groups(x, 32),
                               lambda x: fake_int4_groups(x, 32)),
        "int4 per-token g32 sym": (2 * (d // 2 + 2 * d // 32),
                                   lambda x: fake_int4_groups(x, 32, True),
                                   lambda x: fake_int4_groups(x, 32, True)),
        "int4 per-channel keys": (d // 2 + d * 4 // 16 + d // 2 + 4,
                                  lambda x: fake_per_channel(x, 16, 4), fake_int4),
    }
    print(f"{args.tokens} tokens, {len(layers)} layers; error of the attention output, "
          f"relative to fp32 K/V (mean / max over layers)")
    print(f"{'scheme':<44}{'bytes/tok/head':>15}{'K err':>10}{'mean':>10}{'max':>10}")
    smoothed = "int4 per-token g64, Hadamard, smoothed keys"
    schemes[smoothed] = schemes["int4 per-token g64, Hadamard"]
    for name, (nbytes, fk, fv) in schemes.items():
        errs, kerrs = [], []
        for q, k, v in layers:
            ref = attention(q, k, v)
            qs, ks = smooth_keys(q, k) if name == smoothed else (q, k)
            kq = fk(ks)
            out = attention(qs, kq, fv(v))
            errs.append(((out - ref).norm() / ref.norm()).item())
            kerrs.append(((kq - ks).norm() / ks.norm()).item())
        print(f"{name:<44}{nbytes:>15}{sum(kerrs) / len(kerrs):>10.4f}"
              f"{sum(errs) / len(errs):>10.4f}{max(errs):>10.4f}")


if __name__ == "__main__":
    main()
