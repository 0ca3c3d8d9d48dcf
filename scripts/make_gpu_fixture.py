#!/usr/bin/env python3
"""Build .gpu/, what a GPU run carries (the GPU machine has no network and no gguf package,
and a run carries at most 64 MiB):

    .gpu/model/          the default model cut to its first LAYERS layers, every linear and
                         the (tied) embedding int4 g64 (recipe w4g64-all), as a qserve
                         checkpoint with its tokenizer: ~20 MB, read without gguf
    .gpu/reference.json  greedy tokens and top-5 logprobs of PROMPTS, computed here on the
                         CPU with the pure-torch reference kernels (QSERVE_KERNELS=reference),
                         fp32 activations, for each KV dtype of KV_DTYPES

scripts/gpu_e2e.py check compares the engine on CUDA against it. Rerun this script (and
commit the result) whenever the model format or the reference path changes:

    python scripts/make_gpu_fixture.py [--out .gpu]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ["QSERVE_KERNELS"] = "reference"  # before qserve: the reference is pure torch
REPO = Path(__file__).resolve().parent.parent
# where the tests keep the default model (and the int4 KV codebook this script calibrates)
os.environ.setdefault("QSERVE_HOME", str(REPO / ".cache" / "qserve"))
sys.path.insert(0, str(REPO))

LAYERS = 4
RECIPE = "w4g64-all"
KV_DTYPES = ("fp32", "int8", "int4")
MAX_TOKENS = 24
TOP_LOGPROBS = 5
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Water boils at a temperature of",
]


def cut_model(loaded, layers: int):
    """The model's first `layers` decoder layers, its embedding, final norm and head."""
    arch = loaded.arch
    arch = dataclasses.replace(
        arch, num_layers=layers,
        layer_types=None if arch.layer_types is None else arch.layer_types[:layers])
    keep = {}
    for name, w in loaded.weights.items():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m is None or int(m.group(1)) < layers:
            keep[name] = w
    return dataclasses.replace(loaded, arch=arch, weights=keep)


def write_model(out: Path, layers: int) -> None:
    from qserve.loader import load_model
    from qserve.loader.checkpoint import save_checkpoint
    from qserve.quant.quantize import layer_entries, plan_layers, quantize_weights
    from qserve.quant.recipe import load_recipe

    loaded = cut_model(load_model(None, native=False), layers)  # fp32, the default model
    recipe = load_recipe(RECIPE)
    plans = plan_layers(loaded.arch, recipe)
    tensors, _ = quantize_weights(loaded, recipe, plans)
    quant = {"recipe": recipe.to_dict(), "kv_dtype": recipe.kv_dtype,
             "layers": layer_entries(plans, tensors)}
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".model-"))
    try:
        save_checkpoint(tmp / "m", loaded.arch, loaded.tokenizer, tensors, quant)
        if out.exists():
            shutil.rmtree(out)
        (tmp / "m").rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def generate(model: Path, device: str, dtype: str, kv_dtype: str, prompts: list[str],
             max_tokens: int, **engine) -> list[dict]:
    """Greedy outputs of `prompts`: per prompt its token ids and, per generated token, the
    top-TOP_LOGPROBS {id: logprob} (JSON keys are strings)."""
    from qserve.llm import LLM
    from qserve.sampling_params import SamplingParams

    llm = LLM(str(model), device=device, dtype=dtype, kv_dtype=kv_dtype, **engine)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=TOP_LOGPROBS,
                            ignore_eos=True)
    outs = llm.generate(prompts, params)
    return [{"prompt": p, "token_ids": o.outputs[0].token_ids,
             "logprobs": [{str(k): v for k, v in d.items()} for d in o.outputs[0].logprobs]}
            for p, o in zip(prompts, outs)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / ".gpu")
    ap.add_argument("--layers", type=int, default=LAYERS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    write_model(args.out / "model", args.layers)
    ref = {"layers": args.layers, "recipe": RECIPE, "max_tokens": MAX_TOKENS,
           "top_logprobs": TOP_LOGPROBS, "made_with": "CPU, QSERVE_KERNELS=reference, fp32",
           "kv": {}}
    for kv in KV_DTYPES:
        ref["kv"][kv] = generate(args.out / "model", "cpu", "fp32", kv, PROMPTS, MAX_TOKENS)
    (args.out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"wrote {args.out} ({size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
