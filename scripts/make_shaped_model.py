#!/usr/bin/env python3
"""A random-init Llama with a real model's layer shapes, as an HF checkpoint and as GGUFs made by
llama.cpp's own tools: for benchmarks and memory tests at sizes no small download reaches.

    python scripts/make_shaped_model.py llama-3.2-1b --out ~/.cache/qserve-bench/llama-3.2-1b
    python scripts/make_shaped_model.py llama-3.1-8b --layers 2 --no-gguf --out DIR
    python scripts/make_shaped_model.py llama-3.1-8b --direct --out DIR

Writes, under --out:

    hf/                        config.json, model*.safetensors (fp16 or bf16), the tokenizer
    <name>-F16.gguf            convert_hf_to_gguf.py's output (BF16 with --dtype bf16)
    <name>-<TYPE>.gguf         llama-quantize's output, one per --types entry

--direct writes only <name>-Q4_K_M.gguf, with the gguf package: random K-quant blocks in the
type mix llama-quantize gives Q4_K_M (q4_k_m_type), no checkpoint and no F16 file in between
(the full 8B shape: 4.9 GB in about a minute, where converting and quantizing 16 GB of fp16
takes long on a small machine). Its vocabulary is the real model's (128,256: the default
model's tokens, padded as Llama 3's are: ordinary tokens, then 256 control ones), so its
embedding and output matrices are real-size too.

<name> is the preset, with -<N>L when --layers cuts it. The weights are N(0, 0.02) (norms 1),
drawn tensor by tensor in the target dtype, so even the 8B shape never needs fp32 memory.
Without --direct the vocabulary is the default model's (SmolLM2, 49,152 tokens), so the
embedding and output matrices are smaller than the real models'; every layer is the real
shape. Outputs that exist are kept (delete them or pass --force); llama.cpp comes from
scripts/peer.py.
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
VOCAB = {"llama-3.2-1b": 128256, "llama-3.1-8b": 128256}  # the real models', for --direct
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


# ---- --direct: a Q4_K_M GGUF written block by block ------------------------------------------
# Per-block fp16 scales that make weights come out about N(0, INIT_STD)-sized (see random_blocks).
# Q4_K: w = d * sc * q - dmin * m with sc, m uniform 6-bit and q 4-bit: dmin = 7.5 d centres it,
# and its std is then ~258 d. Q6_K: w = d * sc * (q - 32), sc int8, q 6-bit: std ~1367 d
# (a subnormal fp16 d, as llama-quantize writes for weights this small).
BLOCK_STEP = {"Q4_K": INIT_STD / 258, "Q6_K": INIT_STD / 1367}


def q4_k_m_type(name: str, layer: int | None, num_layers: int, tied: bool) -> str:
    """The GGML type llama-quantize gives GGUF tensor `name` ('attn_v', 'output', ...) of a
    dense Llama for Q4_K_M (llama.cpp src/llama-quant.cpp, llama_tensor_get_type_impl): Q6_K
    for the output matrix (and the embedding when it is tied to it), and for attn_v and
    ffn_down in the layers use_more_bits picks: the first and last eighth and every third
    layer between; Q4_K for every other matrix. Vectors (norms, rope_freqs) stay F32."""
    if name == "output" or (tied and name == "token_embd"):
        return "Q6_K"
    if name in ("attn_v", "ffn_down"):
        n, i = num_layers, layer
        more_bits = i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2
        return "Q6_K" if more_bits else "Q4_K"
    return "Q4_K"


def gguf_tensors(fields: dict, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, shape (out, in) or (n,), GGML type) of every tensor of a Llama with these
    LlamaConfig fields, in llama-quantize's output order, Q4_K_M types."""
    h, i, n = fields["hidden_size"], fields["intermediate_size"], fields["num_hidden_layers"]
    hd = fields["head_dim"]
    q, kv = fields["num_attention_heads"] * hd, fields["num_key_value_heads"] * hd
    tied = fields["tie_word_embeddings"]
    out = [] if tied else [("output.weight", (vocab, h), "Q6_K")]
    out += [("output_norm.weight", (h,), "F32"), ("rope_freqs.weight", (hd // 2,), "F32"),
            ("token_embd.weight", (vocab, h), q4_k_m_type("token_embd", None, n, tied))]
    layer = {"attn_k": (kv, h), "attn_norm": (h,), "attn_output": (h, q), "attn_q": (q, h),
             "attn_v": (kv, h), "ffn_down": (h, i), "ffn_gate": (i, h), "ffn_norm": (h,),
             "ffn_up": (i, h)}
    for li in range(n):
        out += [(f"blk.{li}.{name}.weight", shape,
                 "F32" if len(shape) == 1 else q4_k_m_type(name, li, n, tied))
                for name, shape in layer.items()]
    return out


def random_blocks(rng, type_name: str, rows: int, cols: int):
    """(rows, bytes per row) uint8 blocks of GGML type `type_name` (Q4_K or Q6_K): random
    quants and sub-block scales, and finite fp16 block scales around BLOCK_STEP."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    d = (BLOCK_STEP[type_name] * rng.uniform(0.5, 1.5, len(blocks))).astype(np.float16)
    if type_name == "Q4_K":  # d, dmin, scales[12], qs[128]
        blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
        blocks[:, 2:4] = (d * np.float16(7.5)).view(np.uint8).reshape(-1, 2)
    else:  # Q6_K: ql[128], qh[64], scales[16], d
        blocks[:, -2:] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _metadata_type(value):
    """(GGUFValueType, array element type or None) to write a GGUF metadata value read back by
    qserve's GGUFFile: ids and counts as u32, token types as i32, scores as f32."""
    from gguf import GGUFValueType as T

    if isinstance(value, list):
        first = value[0]
        sub = (T.STRING if isinstance(first, str) else T.FLOAT32 if isinstance(first, float)
               else T.INT32)
        return T.ARRAY, sub
    if isinstance(value, bool):
        return T.BOOL, None
    if isinstance(value, int):
        return T.UINT32, None
    return (T.FLOAT32 if isinstance(value, float) else T.STRING), None


def padded_tokenizer(vocab: int) -> dict:
    """The default model's tokenizer.* GGUF metadata, its vocabulary padded to `vocab` tokens
    as Llama 3's is: ordinary tokens (unreachable: no merge makes them), then up to 256
    control ones."""
    from qserve.loader.gguf_loader import GGUFFile, GGUFStrings
    from qserve.loader.registry import resolve_model

    src = GGUFFile(resolve_model(None))
    tok = {k: list(v) if isinstance(v, GGUFStrings) else v  # (the writer's types: lists)
           for k, v in src.metadata.items() if k.startswith("tokenizer.")}
    have = len(tok["tokenizer.ggml.tokens"])
    assert vocab >= have, (vocab, have)
    pad = vocab - have
    control = min(pad, 256)
    tok["tokenizer.ggml.tokens"] = (tok["tokenizer.ggml.tokens"]
                                    + [f"[pad{k}]" for k in range(pad - control)]
                                    + [f"<|reserved_special_token_{k}|>" for k in range(control)])
    types = tok.get("tokenizer.ggml.token_type", [1] * have)
    tok["tokenizer.ggml.token_type"] = types + [1] * (pad - control) + [3] * control  # 3: CONTROL
    return tok


def add_tensor_infos(w, tensors: list[tuple[str, tuple[int, ...], str]]) -> None:
    """Declare each (GGUF name, shape (..., in), GGML type) to GGUFWriter `w`: F32 values, or
    rows of quantized blocks (written later as (..., row bytes) uint8)."""
    import gguf
    import numpy as np

    for name, shape, type_name in tensors:
        if type_name == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
            continue
        qtype = gguf.GGMLQuantizationType[type_name]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        byte_shape = (*shape[:-1], shape[-1] // block * size)
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qtype)


def write_direct(preset: str, layers: int | None, out: Path, seed: int,
                 fields: dict | None = None, vocab: int | None = None) -> None:
    """Write `out`, a Q4_K_M GGUF of `preset`'s shapes (or of these LlamaConfig `fields`) with
    random blocks, the default model's tokenizer padded to `vocab` tokens (the preset's real
    vocabulary by default), through a temporary file renamed at the end."""
    import gguf
    import numpy as np

    from qserve.loader.gguf_loader import llama3_rope_divisors

    fields = dict(fields or PRESETS[preset])
    if layers:
        fields["num_hidden_layers"] = layers
    vocab = vocab or VOCAB[preset]
    tok = padded_tokenizer(vocab)
    tensors = gguf_tensors(fields, vocab)

    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_type("model")
    w.add_name(f"{preset} shaped, random Q4_K_M blocks")
    w.add_block_count(fields["num_hidden_layers"])
    w.add_context_length(fields["max_position_embeddings"])
    w.add_embedding_length(fields["hidden_size"])
    w.add_feed_forward_length(fields["intermediate_size"])
    w.add_head_count(fields["num_attention_heads"])
    w.add_head_count_kv(fields["num_key_value_heads"])
    w.add_rope_freq_base(fields["rope_theta"])
    w.add_layer_norm_rms_eps(fields["rms_norm_eps"])
    w.add_key_length(fields["head_dim"])
    w.add_value_length(fields["head_dim"])
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(fields["head_dim"])
    for key, value in tok.items():
        w.add_key_value(key, value, *_metadata_type(value))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tensor_infos(w, tensors)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    rope = fields.get("rope_scaling")
    for name, shape, type_name in tensors:
        if name == "rope_freqs.weight":  # Llama 3's scaling, as convert_hf_to_gguf writes it
            data = llama3_rope_divisors(rope, fields["rope_theta"], fields["head_dim"]).numpy()
        elif type_name == "F32":  # norms
            data = np.ones(shape, np.float32)
        else:
            data = random_blocks(rng, type_name, *shape)
        w.write_tensor_data(data)
    w.close()
    tmp.rename(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("preset", choices=PRESETS)
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--layers", type=int, help="keep only the first N layers (saves disk and time)")
    ap.add_argument("--types", help="llama-quantize types, comma-separated  "
                                     "[default: Q4_0,Q4_K_M,Q8_0]")
    ap.add_argument("--dtype", choices=DTYPES, default="fp16",
                    help="checkpoint dtype, and the GGUF's dense type (F16 / BF16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-gguf", action="store_true", help="write the HF directory only")
    ap.add_argument("--force", action="store_true", help="remake outputs that already exist")
    ap.add_argument("--direct", action="store_true",
                    help="write <name>-Q4_K_M.gguf only, random blocks through the gguf package "
                         "(real vocabulary; no checkpoint, no llama.cpp)")
    args = ap.parse_args()
    if args.direct and (args.types or args.no_gguf):
        ap.error("--direct writes one Q4_K_M file; it takes no --types or --no-gguf")
    full = PRESETS[args.preset]["num_hidden_layers"]
    if args.layers is not None and not 1 <= args.layers <= full:
        ap.error(f"--layers {args.layers}: {args.preset} has {full}; give 1 to {full}")
    args.types = [t.strip().upper() for t in (args.types or "Q4_0,Q4_K_M,Q8_0").split(",")
                  if t.strip()]
    if bad := [t for t in args.types if t not in quant_types()]:
        ap.error(f"--types: unknown {', '.join(bad)}; llama-quantize knows "
                 f"{', '.join(quant_types())}")
    if args.layers == full:
        args.layers = None
    name = args.preset + (f"-{args.layers}L" if args.layers else "")
    out = args.out.expanduser()
    if args.direct:
        q = out / f"{name}-Q4_K_M.gguf"
        if args.force or not q.exists():
            out.mkdir(parents=True, exist_ok=True)
            print(f"writing {q} ...", file=sys.stderr)
            write_direct(args.preset, args.layers, q, args.seed)
        print(f"{q.stat().st_size / 2**20:>10,.1f} MiB  {q}")
        return
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
