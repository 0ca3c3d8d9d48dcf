#!/usr/bin/env python3
"""Peak RSS of `qserve quantize` on an fp16/bf16 Hugging Face checkpoint, against the streaming
bound: output size + one transformer layer in fp32 + 1 GiB.

    python scripts/bench_quantize_memory.py HF_DIR [--recipe w4g64] [--layers-of-model 32]

Make the checkpoint with scripts/make_shaped_model.py (e.g. llama-3.1-8b --layers 2 --no-gguf).
The quantizer reads one tensor at a time (qserve/loader/weights.py LazyWeights), so its peak
grows with the output, not with the fp16 input. `--layers-of-model N` also prints the figures
scaled to the full model: the output and peak grow by one layer's output per layer.
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GiB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("hf_dir", type=Path)
    ap.add_argument("--recipe", default="w4g64")
    ap.add_argument("--layers-of-model", type=int, default=None,
                    help="scale the figures to a model of this many layers")
    args = ap.parse_args()
    cfg = json.loads((args.hf_dir / "config.json").read_text())
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    layer_fp32 = 4 * (h * q + 2 * h * kv + q * h + 3 * h * i)
    src = sum(p.stat().st_size for p in args.hf_dir.glob("*.safetensors"))
    out = Path(tempfile.mkdtemp()) / "q"
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "qserve", "quantize", str(args.hf_dir), "-o",
                        str(out), "--recipe", args.recipe], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"quantize failed: {r.stderr.strip()[-500:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    written = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    outside = _bytes_outside_layers(out)
    shutil.rmtree(out.parent)
    bound = written + layer_fp32 + GiB
    rows = [("measured", L, src, written, layer_fp32, peak, bound)]
    if args.layers_of_model and args.layers_of_model != L:
        n = args.layers_of_model
        per_layer_out = (written - outside) / L
        grow = (n - L) * per_layer_out
        src_n = src + (n - L) * 2 * layer_fp32 // 4
        rows.append((f"scaled to {n} layers", n, src_n, written + grow, layer_fp32,
                     peak + grow, bound + grow))
    print(f"qserve quantize --recipe {args.recipe} {args.hf_dir}  ({wall:.1f} s)")
    print("| run | layers | source GB | output GB | one layer fp32 GB | peak RSS GB | "
          "bound GB | within |")
    print("|---|---|---|---|---|---|---|---|")
    for name, n, s, w, lf, p, b in rows:
        print(f"| {name} | {n} | {s / 1e9:.2f} | {w / 1e9:.2f} | {lf / 1e9:.2f} | "
              f"{p / 1e9:.2f} | {b / 1e9:.2f} | {'yes' if p <= b else 'NO'} |")


def _bytes_outside_layers(ckpt: Path) -> int:
    """Bytes of the checkpoint's tensors outside model.layers.* (embedding, LM head, final
    norm), from the safetensors header."""
    total = 0
    for f in ckpt.glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        total += sum(m["data_offsets"][1] - m["data_offsets"][0] for k, m in header.items()
                     if k != "__metadata__" and not k.startswith("model.layers."))
    return total


if __name__ == "__main__":
    main()
