"""Quality of every weight recipe x KV dtype on the default model, against its fp32 weights with
fp32 KV, through the real engine path; peers (bitsandbytes, optimum-quanto) measured on the
same windows in the same run where they work on this machine.

    python scripts/quality_table.py [--windows 2] [--context 1024] [--max-tokens N]
                                    [--recipes w8,w4g64,...] [--kv-dtypes auto,int8,int4]

Text: the first --windows x --context tokens (or --max-tokens) of Python's pydoc topics text
(qserve.eval.default_text), non-overlapping windows of --context. AWQ recipes calibrate on the
text that follows that slice, never on the scored tokens. Recipe checkpoints are written once
under $QSERVE_HOME/quality/ and reused. Columns: KV = --kv-dtype (auto: the recipe's kv_dtype
for a checkpoint, in brackets); size = weight bytes of the checkpoint on disk (the fp32 row: 4
bytes a parameter); res/fp16 = weights a --dtype fp16 engine keeps resident over the fp16
model, with and without the token embedding; ΔPPL relative to fp32/auto; KL = mean
KL(fp32 || row), nats per token; top-1 = agreement of the argmax with fp32. The default (2
windows of 1024, every recipe x 3 KV dtypes, 4 peers) takes about 10 minutes on 2 idle cores.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("QSERVE_HOME", str(REPO / ".cache" / "qserve"))

from qserve.eval import (Scorer, default_text, eval_engine, evaluate_all,  # noqa: E402
                         tokenize_for_eval)
from qserve.loader import load_model  # noqa: E402
from qserve.loader.registry import resolve_model  # noqa: E402


def recipe_names() -> list[str]:
    return sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))


def build_recipe(name: str, src: str, calib: Path) -> Path:
    """The recipe's checkpoint of the default model, quantized once and kept."""
    from qserve.quant.quantize import quantize
    from qserve.quant.recipe import load_recipe

    out = Path(os.environ["QSERVE_HOME"]) / "quality" / name
    if not (out / "config.json").exists():
        awq = load_recipe(name).method == "awq"
        quantize(src, out, name, calib if awq else None, force=True)
    return out


def dir_bytes(path: Path) -> int:
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    return sum(p.stat().st_size for p in files if p.suffix in (".safetensors", ".gguf", ".bin"))


def hf_scorer(name: str, model) -> Scorer:
    """A transformers model scored on the same windows (no paged engine: its own forward)."""
    def fn(window: list[int]) -> torch.Tensor:
        # evaluate_all runs under inference_mode, which quanto's autograd Function refuses
        with torch.inference_mode(False), torch.no_grad():
            logits = model(input_ids=torch.tensor([window])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)
    return Scorer(name, "peer", fn)


def peers(hf_dir: Path) -> tuple[list[tuple[str, Scorer, int]], list[tuple[str, str]]]:
    """(label, scorer, weight bytes) for each peer that runs here; (label, reason) for those
    that don't."""
    from transformers import AutoModelForCausalLM

    rows, skipped = [], []
    attempts = []
    try:
        from transformers import BitsAndBytesConfig

        attempts += [("bitsandbytes int8", lambda: BitsAndBytesConfig(load_in_8bit=True)),
                     ("bitsandbytes nf4", lambda: BitsAndBytesConfig(
                         load_in_4bit=True, bnb_4bit_quant_type="nf4"))]
    except ImportError as e:
        skipped.append(("bitsandbytes", str(e)))
    try:
        from transformers import QuantoConfig

        attempts += [("quanto int8", lambda: QuantoConfig(weights="int8")),
                     ("quanto int4", lambda: QuantoConfig(weights="int4"))]
    except ImportError as e:
        skipped.append(("optimum-quanto", str(e)))
    for label, config in attempts:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(hf_dir), dtype=torch.float32, quantization_config=config()).eval()
            scorer = hf_scorer(label, model)
            with torch.inference_mode():  # as evaluate_all will call it: fail here, not there
                scorer.fn([1, 2, 3])
            rows.append((label, scorer, model.get_memory_footprint()))
        except Exception as e:  # a peer that does not run on this machine is reported, not fatal
            skipped.append((label, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}"))
    return rows, skipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=2, help="windows of --context to score")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, help="score this many tokens instead of --windows")
    ap.add_argument("--recipes", default=",".join(recipe_names()),
                    help="comma-separated recipes/*.yaml names  [default: all]")
    ap.add_argument("--kv-dtypes", default="auto,int8,int4")
    ap.add_argument("--no-peers", action="store_true")
    args = ap.parse_args()
    from qserve.engine.cache_engine import KV_STORAGE
    from qserve.quant.quantize import resident_bytes

    torch.manual_seed(0)
    t0 = time.time()
    src = str(resolve_model(None))
    loaded = load_model(src)
    ref = eval_engine(None, args.context, loaded=loaded)
    text = default_text()
    ids = tokenize_for_eval(ref, text, args.max_tokens or args.windows * args.context)
    calib = Path(os.environ["QSERVE_HOME"]) / "quality" / "calib.txt"
    calib.parent.mkdir(parents=True, exist_ok=True)
    calib.write_text(text[len(ref.tokenizer.decode(ids)):], encoding="utf-8")

    kv_names = {dt: name for name, dt in KV_STORAGE.items()}  # torch.uint8 -> "int4"
    kv_dtypes = args.kv_dtypes.split(",")
    rows: list[tuple[str, str, int, str]] = []  # (weights, KV, bytes on disk, res/fp16)
    models: list = []
    failed: list[tuple[str, str]] = []
    from qserve.models.registry import num_params

    n = num_params(loaded.arch)
    for kv in kv_dtypes:
        models.append(ref if kv == "auto" else
                      eval_engine(None, args.context, loaded=loaded, kv_dtype=kv))
        rows.append(("fp32", kv, 4 * n, "1.00 / 1.00"))
    for name in [r for r in args.recipes.split(",") if r]:
        try:
            path = build_recipe(name, src, calib)
            res = resident_bytes(path, loaded.arch)
            ratio = (f"{res['resident_ratio']:.2f} / "
                     f"{res['resident_ratio_without_embedding']:.2f}")
            ckpt = load_model(path)  # one copy of the weights for its KV dtypes
            for kv in kv_dtypes:
                eng = eval_engine(str(path), args.context, loaded=ckpt, kv_dtype=kv)
                label = f"auto ({kv_names[eng.kv_dtype]})" if kv == "auto" else kv
                models.append(eng)
                rows.append((name, label, dir_bytes(path), ratio))
        except Exception as e:
            traceback.print_exc(limit=2, file=sys.stderr)
            failed.append((name, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"))
    skipped: list[tuple[str, str]] = []
    if not args.no_peers:
        sys.path.insert(0, str(REPO / "tests"))
        from hf_reference import hf_reference_dir

        peer_rows, skipped = peers(hf_reference_dir(Path(src)))
        for label, scorer, size in peer_rows:
            models.append(scorer)
            rows.append((label, "fp32", size, "-"))

    results = evaluate_all(models, ids, args.context, ref_engine=ref)
    base = results[0].ppl if kv_dtypes[0] == "auto" else results[0].ref_ppl
    print(f"{results[0].num_tokens:,} tokens of the pydoc topics text, {results[0].num_windows} "
          f"non-overlapping windows of {args.context}; reference: fp32 weights, fp32 KV "
          f"(PPL {results[0].ref_ppl:.4f}); {time.time() - t0:.0f} s\n")
    print(f"| {'weights':<18} | {'KV':<11} | {'size MiB':>8} | {'res/fp16':>11} | {'PPL':>8} | "
          f"{'ΔPPL':>7} | {'KL':>7} | {'top-1':>6} |")
    print("|" + "|".join("-" * (w + 2) for w in (18, 11, 8, 11, 8, 7, 7, 6)) + "|")
    for (label, kv, size, ratio), r in zip(rows, results):
        print(f"| {label:<18} | {kv:<11} | {size / 2**20:>8.1f} | {ratio:>11} | {r.ppl:>8.4f} | "
              f"{100 * (r.ppl / base - 1):>+6.2f}% | {r.kl:>7.4f} | {100 * r.top1:>5.1f}% |")
    for label, why in failed + skipped:  # in the table too, so a missing row says why
        print(f"| {label:<18} | not run: {why}")


if __name__ == "__main__":
    main()
