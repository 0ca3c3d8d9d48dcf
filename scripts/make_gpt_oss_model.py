#!/usr/bin/env python3
"""A random-init GGUF with gpt-oss-20b's shapes, as llama-quantize's MXFP4_MOE lays it out:
the experts MXFP4, every other matrix Q8_0, vectors F32. For benchmarks at a size no small
download reaches (the real file is 12 GB).

    python scripts/make_gpt_oss_model.py --out ~/.cache/qserve-bench/gpt-oss-20b --layers 12

Writes <out>/gpt-oss-20b[-<N>L]-MXFP4_MOE.gguf with the gguf package, block by block:

    layers      24 (or --layers N), hidden 2880, 64 query heads and 8 kv heads of 64, a
                128-position window on even layers, attention sinks, q/k/v/o biases
    experts     32 a layer, top 4, each 2880 wide, gate/up/down MXFP4 with F32 biases;
                the router F32, as llama-quantize leaves it
    vocabulary  201,088 (the real one's size: the default model's tokens, padded as
                make_shaped_model.py pads them), so the output matrix is real-size too
    rope        YaRN, factor 32 over 4,096 positions, base 150,000

The weights come out about N(0, 0.02): MXFP4 codes uniform with block exponents near
2^-8, Q8_0 codes uniform with d = 0.02 / 74. A token's decode reads its 4 experts of 32 in
each layer: 1.6 GB a token at 12 layers, of which the output matrix is 0.6 GB.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import make_shaped_model as shaped  # noqa: E402  (scripts/make_shaped_model.py)

SHAPES = dict(layers=24, hidden=2880, heads=64, kv_heads=8, head_dim=64, experts=32, top_k=4,
              expert_ff=2880, vocab=201088, window=128, context=131072)
# MXFP4's codes over 16 values of RMS 5.85; Q8_0's int8 codes of RMS 73.9
MXFP4_E, Q8_0_D = 120, 0.02 / 74  # 2^(120 - 128) * 5.85 = 0.023


def tensors(s: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, shape (E, out, in), (out, in) or (n,), GGML type) of every tensor."""
    h, q, kv, E, f = (s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"],
                      s["experts"], s["expert_ff"])
    out = [("token_embd.weight", (s["vocab"], h), "Q8_0"), ("output_norm.weight", (h,), "F32"),
           ("output.weight", (s["vocab"], h), "Q8_0")]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,), "F32"),
                (b + "attn_q.weight", (q, h), "Q8_0"), (b + "attn_q.bias", (q,), "F32"),
                (b + "attn_k.weight", (kv, h), "Q8_0"), (b + "attn_k.bias", (kv,), "F32"),
                (b + "attn_v.weight", (kv, h), "Q8_0"), (b + "attn_v.bias", (kv,), "F32"),
                (b + "attn_output.weight", (h, q), "Q8_0"), (b + "attn_output.bias", (h,), "F32"),
                (b + "attn_sinks.weight", (s["heads"],), "F32"),
                (b + "post_attention_norm.weight", (h,), "F32"),
                (b + "ffn_gate_inp.weight", (E, h), "F32"), (b + "ffn_gate_inp.bias", (E,), "F32"),
                (b + "ffn_gate_exps.weight", (E, f, h), "MXFP4"),
                (b + "ffn_gate_exps.bias", (E, f), "F32"),
                (b + "ffn_up_exps.weight", (E, f, h), "MXFP4"),
                (b + "ffn_up_exps.bias", (E, f), "F32"),
                (b + "ffn_down_exps.weight", (E, h, f), "MXFP4"),
                (b + "ffn_down_exps.bias", (E, h), "F32")]
    return out


def random_data(rng, name: str, shape: tuple[int, ...], type_name: str):
    """A tensor's bytes (quantized: (..., row bytes) uint8) or F32 values."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if type_name == "F32":
        if name.endswith("norm.weight"):
            return np.ones(shape, np.float32)
        return rng.normal(0.0, 0.02, shape).astype(np.float32)  # biases, sinks, the router
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    *lead, n_in = shape
    blocks = rng.integers(0, 256, (*lead, n_in // block, size), dtype=np.uint8)
    if type_name == "MXFP4":  # e | 16 bytes of codes
        blocks[..., 0] = rng.integers(MXFP4_E - 1, MXFP4_E + 2, blocks.shape[:-1], dtype=np.uint8)
    else:  # Q8_0: d fp16 | 32 int8
        d = (Q8_0_D * rng.uniform(0.5, 1.5, blocks.shape[:-1])).astype(np.float16)
        blocks[..., 0:2] = d.view(np.uint8).reshape(*blocks.shape[:-1], 2)
    return blocks.reshape(*lead, -1)


def write(out: Path, s: dict, seed: int) -> None:
    """Write `out` through a temporary file renamed at the end."""
    import gguf
    import numpy as np

    arch = "gpt-oss"
    listed = tensors(s)
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(tmp, arch)
    w.add_type("model")
    w.add_name("gpt-oss-20b shaped, random MXFP4_MOE blocks")
    w.add_block_count(s["layers"])
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["expert_ff"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(150000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(s["experts"])
    w.add_expert_used_count(s["top_k"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_sliding_window(s["window"])
    w.add_expert_feed_forward_length(s["expert_ff"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_vocab_size(s["vocab"])
    for key, value in shaped.padded_tokenizer(s["vocab"]).items():
        w.add_key_value(key, value, *shaped._metadata_type(value))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    shaped.add_tensor_infos(w, listed)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape, type_name in listed:
        w.write_tensor_data(random_data(rng, name, shape, type_name))
    w.close()
    tmp.rename(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--layers", type=int, help="keep only the first N of 24 layers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="remake the file if it exists")
    args = ap.parse_args()
    full = SHAPES["layers"]
    if args.layers is not None and not 1 <= args.layers <= full:
        ap.error(f"--layers {args.layers}: gpt-oss-20b has {full}; give 1 to {full}")
    layers = args.layers or full
    name = "gpt-oss-20b" + (f"-{layers}L" if layers != full else "") + "-MXFP4_MOE.gguf"
    out = args.out.expanduser() / name
    if args.force or not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {out} ...", file=sys.stderr)
        write(out, SHAPES | {"layers": layers}, args.seed)
    print(f"{out.stat().st_size / 2**20:>10,.1f} MiB  {out}")


if __name__ == "__main__":
    main()
