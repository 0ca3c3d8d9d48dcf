#!/usr/bin/env python3
"""A random-init Llama with a real model's layer shapes, as an HF checkpoint and as GGUFs made by
llama.cpp's own tools: for benchmarks and memory tests at sizes no small download reaches.

    python scripts/make_shaped_model.py llama-3.2-1b --out ~/.cache/qserve-bench/llama-3.2-1b
    python scripts/make_shaped_model.py llama-3.1-8b --layers 2 --no-gguf --out DIR

Writes, under --out:

    hf/                        config.json, model*.safetensors (fp16 or bf16), the tokenizer
    <name>-F16.gguf            convert_hf_to_gguf.py's output (BF16 with --dtype bf16)
    <name>-<TYPE>.gguf         llama-quantize's output, one per --types entry

<name> is the preset, with -<N>L when --layers cuts it. The weights are N(0, 0.02) (norms 1),
drawn tensor by tensor in the target dtype, so even the 8B shape never needs fp32 memory. The
vocabulary is the default model's (SmolLM2, 49,152 tokens), so the embedding and output matrices
are smaller than the real models' (128,256); every layer is the real shape. Outputs that exist
are kept (delete them or pass --force); llama.cpp comes from scripts/peer.py.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "scripts")]

import peer  # noqa: E402  (scripts/peer.py)

LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
PRESETS = {  # LlamaConfig fields, as in each model's config.json (vocabulary excepted)
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                         rope_theta=500000.0, rope_scaling=LLAMA3_ROPE | {"factor": 32.0},
                         max_position_embeddings=131072, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                         rope_theta=500000.0, rope_scaling=LLAMA3_ROPE | {"factor": 8.0},
                         max_position_embeddings=131072, rms_norm_eps=1e-5,
                         tie_word_embeddings=False),
}
DTYPES = {"fp16": (torch.float16, "f16", "F16"), "bf16": (torch.bfloat16, "bf16", "BF16")}
INIT_STD = 0.02
SHARD_BYTES = 2 << 30  # safetensors files of at most ~2 GiB, so no step holds much more
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "added_tokens.json")


def quant_types() -> list[str]:
    """The file types llama-quantize accepts by name (gguf's LlamaFileType, MOSTLY_ dropped)."""
    from gguf import LlamaFileType

    return [n.removeprefix("MOSTLY_") for n in LlamaFileType.__members__
            if n.startswith("MOSTLY_")]


def tokenizer_source() -> Path:
    """The default model as an HF directory (tests/hf_reference.py, cached): its tokenizer
    files and special token ids are the shaped model's."""
    from qserve.loader.registry import model_home, resolve_model

    os.environ.setdefault("QSERVE_HOME", str(model_home()))
    from hf_reference import hf_reference_dir

    return hf_reference_dir(resolve_model(None))


def llama_config(preset: str, layers: int | None, dtype: torch.dtype, tok_dir: Path):
    from transformers import LlamaConfig

    ref = json.loads((tok_dir / "config.json").read_text())
    fields = PRESETS[preset] | {"num_hidden_layers": layers or PRESETS[preset]["num_hidden_layers"]}
    return LlamaConfig(vocab_size=ref["vocab_size"], bos_token_id=ref.get("bos_token_id"),
                       eos_token_id=ref.get("eos_token_id"), pad_token_id=ref.get("pad_token_id"),
                       initializer_range=INIT_STD, dtype=dtype,
                       architectures=["LlamaForCausalLM"], **fields)


def write_weights(config, dtype: torch.dtype, out: Path, seed: int) -> None:
    """Random weights for every parameter of LlamaForCausalLM(config), in `dtype`, as sharded
    safetensors. Names and shapes come from the model built on the meta device."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    shapes = {n: p.shape for n, p in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")  # the embedding, as in the real checkpoint
    shards, size = [[]], 0  # shard -> parameter names, in state-dict order
    for name, shape in shapes.items():
        nbytes = shape.numel() * dtype.itemsize
        if size and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    gen = torch.Generator().manual_seed(seed)
    weight_map = {}
    for i, names in enumerate(shards):
        fname = ("model.safetensors" if len(shards) == 1
                 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        tensors = {}
        for name in names:
            t = torch.empty(shapes[name], dtype=dtype)
            tensors[name] = t.fill_(1.0) if name.endswith("norm.weight") else t.normal_(
                0.0, INIT_STD, generator=gen)
            weight_map[name] = fname
        save_file(tensors, out / fname, metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        total = sum(s.numel() for s in shapes.values()) * dtype.itemsize
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def make_hf_dir(args, out: Path) -> Path:
    """out/hf: config, weights and tokenizer; kept when it exists and was made with the same
    preset, layers, dtype and seed."""
    spec = {"preset": args.preset, "layers": args.layers, "dtype": args.dtype, "seed": args.seed}
    hf = out / "hf"
    made = hf / "qserve_shaped.json"
    if hf.exists() and not args.force:
        if made.exists() and json.loads(made.read_text()) == spec:
            print(f"kept {hf}", file=sys.stderr)
            return hf
        sys.exit(f"error: {hf} exists but was not made with {spec}; pass --force to remake it "
                 f"or choose another --out")
    dtype = DTYPES[args.dtype][0]
    tok_dir = tokenizer_source()
    tmp = hf.with_name("hf.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = llama_config(args.preset, args.layers, dtype, tok_dir)
    print(f"writing random {args.dtype} weights to {hf} ...", file=sys.stderr)
    config.save_pretrained(tmp)
    write_weights(config, dtype, tmp, args.seed)
    for name in TOKENIZER_FILES:
        if (tok_dir / name).exists():
            shutil.copy2(tok_dir / name, tmp / name)
    (tmp / made.name).write_text(json.dumps(spec) + "\n")
    shutil.rmtree(hf, ignore_errors=True)
    tmp.rename(hf)
    return hf


def run_to(out: Path, command, **kw) -> None:
    """Run command(tmp), which writes the file tmp, then rename tmp to `out`, so an interrupted
    run leaves no file that looks finished."""
    tmp = out.with_name(out.name + ".tmp")
    cmd = [str(c) for c in command(tmp)]
    print(f"making {out.name}: {' '.join(cmd)}", file=sys.stderr)
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
        tmp.unlink(missing_ok=True)
        sys.exit(f"{tail}\nerror: making {out.name} failed (exit status {r.returncode})")
    tmp.rename(out)


def make_ggufs(args, hf: Path, out: Path, name: str) -> list[Path]:
    _, outtype, ftype = DTYPES[args.dtype]
    dense = out / f"{name}-{ftype}.gguf"
    if args.force or not dense.exists():
        run_to(dense, lambda tmp: [sys.executable, peer.convert_script(), hf,
                                   "--outtype", outtype, "--outfile", tmp],
               env=peer.convert_env())
    made = [dense]
    for qtype in args.types:
        q = out / f"{name}-{qtype}.gguf"
        if args.force or not q.exists():
            run_to(q, lambda tmp: [peer.binary("llama-quantize"), dense, tmp, qtype,
                                   os.cpu_count() or 1])
        made.append(q)
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("preset", choices=PRESETS)
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--layers", type=int, help="keep only the first N layers (saves disk and time)")
    ap.add_argument("--types", default="Q4_0,Q4_K_M,Q8_0",
                    help="llama-quantize types, comma-separated  [default: Q4_0,Q4_K_M,Q8_0]")
    ap.add_argument("--dtype", choices=DTYPES, default="fp16",
                    help="checkpoint dtype, and the GGUF's dense type (F16 / BF16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-gguf", action="store_true", help="write the HF directory only")
    ap.add_argument("--force", action="store_true", help="remake outputs that already exist")
    args = ap.parse_args()
    full = PRESETS[args.preset]["num_hidden_layers"]
    if args.layers is not None and not 1 <= args.layers <= full:
        ap.error(f"--layers {args.layers}: {args.preset} has {full}; give 1 to {full}")
    args.types = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    if bad := [t for t in args.types if t not in quant_types()]:
        ap.error(f"--types: unknown {', '.join(bad)}; llama-quantize knows "
                 f"{', '.join(quant_types())}")
    if args.layers == full:
        args.layers = None
    name = args.preset + (f"-{args.layers}L" if args.layers else "")
    out = args.out.expanduser()
    try:
        hf = make_hf_dir(args, out)
        ggufs = [] if args.no_gguf else make_ggufs(args, hf, out, name)
    except peer.PeerError as e:
        sys.exit(f"error: {e}")
    for f in [*sorted(hf.iterdir()), *ggufs]:
        print(f"{f.stat().st_size / 2**20:>10,.1f} MiB  {f}")
    hf_size = sum(f.stat().st_size for f in hf.iterdir())
    print(f"{hf_size / 2**20:>10,.1f} MiB  {hf}/ in all")


if __name__ == "__main__":
    main()
