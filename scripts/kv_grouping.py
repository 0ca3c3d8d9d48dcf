"""Which grouping should quantized KV use? Measures, on the real default model, the error each
scheme puts into the attention output, layer by layer, against fp32 K/V.

    python scripts/kv_grouping.py [--tokens 512]

Q/K/V are captured from a fp32 engine run over the start of the pydoc topics text (the eval
text). For each scheme, K and V are quantized then dequantized, causal attention is recomputed,
and the table prints the relative error ||o - o_q|| / ||o|| (mean over layers) with the bytes
each (token, kv head) costs. "per-channel keys" is KIVI's grouping (one scale/offset per channel
over the 16 tokens of a block), measured here with the whole block known up front: the most
favourable case for it, since a paged cache writes a block one token at a time.
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
    packed, scale, offset = kv_quant.quantize_int4(g)
    return kv_quant.dequantize_int4(packed, scale, offset, torch.float32).reshape(T, h, d)


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
    return kv_quant.dequantize_int4(*kv_quant.quantize_int4(x), torch.float32)


def rotated(fake):
    """Quantize in a Hadamard-rotated basis (QuaRot-style), rotate back after."""
    def f(x):
        h = kv_quant.hadamard(x.shape[-1])
        return fake(x @ h) @ h
    return f


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q (T, H, d), k/v (T, hkv, d) -> (T, H, d), causal."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, enable_gqa=True)
    return out.transpose(0, 1)


def capture(num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer: q (T, H, d), k, v (T, hkv, d) of one fp32 prefill."""
    from qserve import LLM, SamplingParams
    from qserve.eval import default_text
    from qserve.models import llama

    llm = LLM(kv_cache_memory="64MiB", max_model_len=num_tokens + 16)
    ids = llm.tokenizer.encode(default_text(), add_special_tokens=False)[:num_tokens]
    seen = []
    real = llama.paged_attention

    def spy(q, cache, meta, scale, k_new=None, v_new=None):
        seen.append((q.clone(), k_new.clone(), v_new.clone()))
        return real(q, cache, meta, scale, k_new=k_new, v_new=v_new)

    llama.paged_attention = spy
    try:
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    finally:
        llama.paged_attention = real
    return seen[: llm.engine.arch.num_layers]


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
    print(f"{'scheme':<30}{'bytes/tok/head':>15}{'K err':>10}{'mean':>10}{'max':>10}")
    for name, (nbytes, fk, fv) in schemes.items():
        errs, kerrs = [], []
        for q, k, v in layers:
            ref = attention(q, k, v)
            kq = fk(k)
            out = attention(q, kq, fv(v))
            errs.append(((out - ref).norm() / ref.norm()).item())
            kerrs.append(((kq - k).norm() / k.norm()).item())
        print(f"{name:<30}{nbytes:>15}{sum(kerrs) / len(kerrs):>10.4f}"
              f"{sum(errs) / len(errs):>10.4f}{max(errs):>10.4f}")


if __name__ == "__main__":
    main()
