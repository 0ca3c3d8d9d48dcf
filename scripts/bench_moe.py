#!/usr/bin/env python3
"""Batch-1 decode speed of a mixture of experts against a dense model of the same total size:
does a MoE decode step read only the experts its token picked?

    python scripts/bench_moe.py                       # 8 layers of hidden 2048, 2.9B params
    python scripts/bench_moe.py --hidden 64 --layers 2 --expert-intermediate 64 --heads 4 \\
        --kv-heads 2 --vocab 512 --prompt-len 8 --tokens 8           # a smoke test

Both models are random-init and built in memory, one after the other:

    MoE    Mixtral layout: E experts of --expert-intermediate, top-k routing (qserve's
           SparseMoE, layers run one by one)
    dense  Llama layout with the same hidden size, attention and vocabulary, and one MLP of
           E x --expert-intermediate: the same total parameters (the routers aside)

and quantized the same way, with the linears --recipe packs (default w4g32: int4, groups of
32, as Q4_0/Q4_1 lay them out) and the rest as the recipe keeps them (fp16). Weights are
N(0, 0.02), norms 1. The expert intermediate is 3.5x the hidden size by default, Mixtral's
ratio, and the vocabulary is the first --vocab ids of the default model's tokenizer, so the
output matrix (the same in both) has Mixtral's share of a step, not a tiny model's. Each
model packs to about 1.7 GB at the defaults (w4g32), built one after the other; the MoE's
layers run one by one in Python, whose fixed cost per layer a small hidden size exaggerates.

Each row is qserve's own measurement (qserve/bench.py, batch 1, greedy, EOS ignored). The
issue's target: MoE decode tokens/s >= 2.5x the dense model's. A step of the dense model
reads all of its MLP; the MoE's reads top_k / E of it, so the ratio's ceiling is about
E / top_k where the MLPs dominate a step. Don't run this on a shared machine.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]
os.environ.setdefault("QSERVE_HOME", str(REPO / ".cache" / "qserve"))

INIT_STD = 0.02


def arch_of(args, moe: bool):
    from qserve.config import ModelArchConfig

    E, inter = args.experts, args.expert_intermediate
    fields = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                  num_heads=args.heads, num_kv_heads=args.kv_heads,
                  head_dim=args.hidden // args.heads, rope_theta=1e6,
                  max_position_embeddings=args.prompt_len + args.tokens + 16)
    if moe:
        return ModelArchConfig(architecture="mixtral", intermediate_size=inter, num_experts=E,
                               num_experts_per_tok=args.top_k, moe_intermediate_size=inter,
                               **fields)
    return ModelArchConfig(architecture="llama", intermediate_size=E * inter, **fields)


def random_weights(arch, recipe, seed: int) -> dict:
    """Every tensor the model needs, HF-named: the recipe's linears packed, the rest dense
    (fp16 2-D, fp32 norms), generated and packed one tensor at a time."""
    from qserve.models.registry import checkpoint_shapes
    from qserve.quant.schemes import quantize as rtn

    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in checkpoint_shapes(arch).items():
        if len(shape) == 1:
            weights[name] = torch.ones(shape)
            continue
        w = torch.randn(shape, generator=gen) * INIT_STD
        linear = name.removesuffix(".weight")
        packed = (linear != "model.embed_tokens" and not recipe.kept(linear, arch.num_layers)
                  and not linear.endswith(".gate"))  # routers stay dense, as in llama.cpp
        weights[name] = rtn(w, recipe.scheme, recipe.group_size) if packed else w.half()
    return weights


def bench(args, moe: bool, tokenizer, recipe) -> dict:
    from qserve import LLM
    from qserve.bench import run_bench
    from qserve.loader import LoadedModel
    from qserve.models.registry import num_params

    arch = arch_of(args, moe)
    arch.eos_token_ids = sorted(tokenizer.eos_token_ids)
    weights = random_weights(arch, recipe, args.seed)
    nbytes = sum(sum(t.numel() * t.element_size() for t in w.tensors().values())
                 if hasattr(w, "tensors") else w.numel() * w.element_size()
                 for w in weights.values())
    loaded = LoadedModel(arch, weights, tokenizer, Path("random-init"), "hf")
    llm = LLM(loaded=loaded, kv_cache_memory="64MiB", max_num_seqs=1,
              max_model_len=arch.max_position_embeddings, kv_dtype=args.kv_dtype)
    del weights, loaded
    [row] = run_bench(llm.engine, [1], args.prompt_len, args.tokens, seed=args.seed)
    total = num_params(arch)
    if moe:  # the experts a token does not pick
        idle = arch.num_layers * (arch.num_experts - arch.num_experts_per_tok) * (
            3 * arch.hidden_size * arch.moe_intermediate_size)
    else:
        idle = 0
    fused = getattr(llm.engine.model, "_fused", None)  # the dense family's fused C step
    result = {"model": "MoE" if moe else "dense", "params": total, "active": total - idle,
              "weight_mib": nbytes / 2**20, "tok_s": row["decode_tokens_per_s"],
              "path": "fused C step" if fused and fused[1] is not None else "layer by layer"}
    del llm
    gc.collect()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-intermediate", type=int, default=7168)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--recipe", default="w4g32", help="a recipes/ name (its linears packed)")
    p.add_argument("--kv-dtype", default="fp16")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="decode steps timed")
    p.add_argument("--threads", type=int, default=None, help="torch / kernel threads")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from qserve.loader import load_tokenizer
    from qserve.quant.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    if recipe.method != "rtn":
        sys.exit(f"error: recipe {args.recipe!r} uses method {recipe.method}; choose an rtn "
                 f"recipe (e.g. w4g32, w4g64-sym, w8)")
    tokenizer = load_tokenizer(None)  # the default model's
    if args.vocab > tokenizer.vocab_size:
        sys.exit(f"error: --vocab {args.vocab} exceeds the tokenizer's {tokenizer.vocab_size}")
    rows = [bench(args, True, tokenizer, recipe), bench(args, False, tokenizer, recipe)]
    print(f"hidden {args.hidden}, {args.layers} layers, {args.experts} experts of "
          f"{args.expert_intermediate} (top-{args.top_k}) vs one MLP of "
          f"{args.experts * args.expert_intermediate}; recipe {recipe.name}, KV {args.kv_dtype},"
          f" {torch.get_num_threads()} threads, batch 1, {args.tokens} decode steps")
    print(f"{'model':6} {'params':>8} {'active':>8} {'weights':>10} {'decode tok/s':>13}  path")
    for r in rows:
        print(f"{r['model']:6} {r['params'] / 1e6:7.1f}M {r['active'] / 1e6:7.1f}M "
              f"{r['weight_mib']:7.1f}MiB {r['tok_s']:13.2f}  {r['path']}")
    ratio, fewer = rows[0]["tok_s"] / rows[1]["tok_s"], rows[1]["active"] / rows[0]["active"]
    print(f"MoE / dense: {ratio:.2f}x (target >= 2.5x; a MoE step reads {fewer:.2f}x fewer "
          f"parameters)")


if __name__ == "__main__":
    main()
