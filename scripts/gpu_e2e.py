#!/usr/bin/env python3
"""The engine on a GPU, end to end: `check` its outputs against the CPU reference carried
in .gpu/ (scripts/make_gpu_fixture.py), `bench` its decode speed at real layer shapes, or
`all`: the whole device run in one command, within one deadline.

    python scripts/gpu_e2e.py check [--device cuda] [--dtypes fp32,bf16] [--kv fp32,int8,int4]
    python scripts/gpu_e2e.py bench [--shapes smollm2,llama8b] [--batches 1,32]
    python scripts/gpu_e2e.py all --deadline 520 --out "$OUT"     # README: "On a GPU"

gguf is blocked before qserve is imported (the GPU machine has no gguf package), so a
stray gguf import on the CUDA path fails here first.

check, each case a table row, PASS / FAIL against the bound printed beside it:
    greedy        for each dtype x KV dtype: greedy tokens and top-5 logprobs of the fixture's
                  prompts against the reference's (fp32 activations, CPU, reference kernels).
                  fp32 with fp32 KV: the same tokens, except after a near-tie (the reference's
                  top two within TIE nats), and logprobs within FP32_LOGPROB; otherwise the
                  first QUALITY_PREFIX tokens of every prompt, or a divergence onto a token
                  the reference had within QUALITY_LOGPROB of its top, and logprobs within
                  QUALITY_LOGPROB
    reference     QSERVE_KERNELS=reference on the device: fp32 greedy, as exact as above
    graphs off    QSERVE_CUDA_GRAPHS=0: the same tokens as with CUDA graphs, bit for bit
    seeded        a seeded sample alone, twice, and inside a batch: the same tokens each time
    swap / chunked / layerwise: a small KV pool with swap preemption, 8-token prefill chunks,
                  layer-wise offload: the same greedy tokens as an unconstrained engine

bench: random weights in memory with SmolLM2-135M's and Llama-3.1-8B's layer shapes,
fp16 / w4 / w8 weights x fp16 / int8 / int4 KV, batch 1 and 32: decode tokens/s, kernel
launches per step and host ms per step (step wall time less GPU kernel time, from
torch.profiler), next to Hugging Face transformers fp16 eager and torch.compile'd (static
cache) where they run in the time left. Each section stops starting new rows at --deadline.
"""
from __future__ import annotations

import argparse
import importlib.abc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TIE = 2e-3  # nats between the reference's top two: a flip there is not an error
FP32_LOGPROB = 2e-3
QUALITY_PREFIX = 4
QUALITY_LOGPROB = 0.5
T0 = time.monotonic()
CASES = ("greedy", "reference", "cuda", "seeded", "swap", "chunked", "layer-wise")


class _NoGguf(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "gguf" or name.startswith("gguf."):
            raise ImportError("gguf is blocked: the GPU machine has no gguf package")


sys.meta_path.insert(0, _NoGguf())


class Report:
    """Rows of one table, and the run's go / no-go."""

    failures: list[str] = []

    def __init__(self, title: str, header: list[str]):
        print(f"\n## {title}\n\n| {' | '.join(header)} |\n|{'---|' * len(header)}", flush=True)

    @staticmethod
    def row(*cells) -> None:
        print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)

    @classmethod
    def case(cls, name: str, ok: bool, measured: str, bound: str) -> None:
        cls.row(name, "PASS" if ok else "FAIL", measured, bound)
        if not ok:
            cls.failures.append(name)


def left(deadline: float | None) -> float:
    return float("inf") if deadline is None else deadline - (time.monotonic() - T0)


# ---- check ---------------------------------------------------------------------------------
def _generate(model: Path, prompts, params, stats: dict | None = None, **engine) -> list:
    """The outputs of an engine made for this call; `stats` gets its scheduler's counts."""
    from qserve.llm import LLM

    llm = LLM(str(model), **engine)
    try:
        return llm.generate(prompts, params)
    finally:
        if stats is not None:
            sched = llm.engine.scheduler
            stats.update(preemptions=sched.num_preemptions, swap_outs=sched.num_swap_outs,
                         layerwise=getattr(sched, "num_layerwise_admits", 0))
        del llm
        _empty_cache()


def _empty_cache() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compare(got: list, ref: list[dict], exact: bool, max_tokens: int) -> tuple[bool, str]:
    """Outputs against the reference's entries: (within the bound, what was measured)."""
    worst_lp, matched, total, note = 0.0, 0, 0, ""
    ok = True
    for out, r in zip(got, ref):
        toks = out.outputs[0].token_ids[:max_tokens]
        want = r["token_ids"][:len(toks)]
        lps = out.outputs[0].logprobs
        n = next((i for i, (a, b) in enumerate(zip(toks, want)) if a != b), len(toks))
        matched, total = matched + n, total + len(toks)
        for i in range(n):  # the chosen token's logprob, where both chose it
            worst_lp = max(worst_lp, abs(lps[i][toks[i]] - r["logprobs"][i][str(want[i])]))
        if n < len(toks):
            lp = r["logprobs"][n]
            top = sorted(lp.values(), reverse=True)
            tie = len(top) > 1 and top[0] - top[1] < TIE
            # not exact: a divergence is fine late, or onto a token the reference nearly chose
            near = str(toks[n]) in lp and top[0] - lp[str(toks[n])] <= QUALITY_LOGPROB
            note += f" diverged at {n}{' (a tie)' if tie else ' (near)' if near else ''};"
            ok &= tie if exact else (near or n >= min(QUALITY_PREFIX, len(toks)))
    ok &= worst_lp <= (FP32_LOGPROB if exact else QUALITY_LOGPROB)
    return ok, f"{matched}/{total} tokens, max dlogprob {worst_lp:.2e};{note}"


def _params(max_tokens: int, **kw):
    from qserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def check(args) -> None:
    import torch

    fixture = Path(args.fixture)
    ref = json.loads((fixture / "reference.json").read_text())
    model = fixture / "model"
    prompts = [r["prompt"] for r in ref["kv"]["fp32"]]
    n = min(args.max_tokens or ref["max_tokens"], ref["max_tokens"])
    dev = args.device
    params = _params(n, logprobs=ref["top_logprobs"])
    Report("check: the engine against the CPU reference", ["case", "result", "measured", "bound"])
    base = dict(device=dev, max_model_len=256)

    wanted = set(args.cases.split(","))

    def run(name: str, fn) -> None:
        if name.split()[0].lower().rstrip("-") not in wanted:
            return
        if left(args.deadline) < 20:
            Report.row(name, "skipped", "deadline", "")
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
            Report.case(name, False, f"{type(e).__name__}: {str(e)[:120]}", "")
            traceback.print_exc(file=sys.stderr)

    for dtype in args.dtypes.split(","):
        for kv in args.kv.split(","):
            def greedy(dtype=dtype, kv=kv):
                exact = dtype == "fp32" and kv == "fp32"
                got = _generate(model, prompts, params, dtype=dtype, kv_dtype=kv, **base)
                ok, measured = compare(got, ref["kv"][kv], exact, n)
                Report.case(f"greedy {dtype} KV {kv}", ok, measured,
                            "tokens exact but ties, dlogprob <= %g" % FP32_LOGPROB if exact
                            else f"first {QUALITY_PREFIX} tokens or a near choice, dlogprob "
                            f"<= {QUALITY_LOGPROB}")
            run(f"greedy {dtype} KV {kv}", greedy)

    def reference_kernels():
        from qserve.kernels import dispatch

        os.environ["QSERVE_KERNELS"] = "reference"
        dispatch._triton_available.cache_clear()
        try:
            got = _generate(model, prompts, params, dtype="fp32", kv_dtype="fp32", **base)
        finally:
            os.environ.pop("QSERVE_KERNELS")
            dispatch._triton_available.cache_clear()
        ok, measured = compare(got, ref["kv"]["fp32"], True, n)
        Report.case("reference kernels fp32", ok, measured, "as greedy fp32")
    if dev == "cuda":
        run("reference kernels fp32", reference_kernels)

    def tokens(outs) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in outs]

    fp32 = dict(dtype="fp32", kv_dtype="fp32", **base)
    plain_runs: list = []

    def plain() -> list[list[int]]:  # unconstrained fp32 greedy tokens, made once
        if not plain_runs:
            plain_runs.append(tokens(_generate(model, prompts, _params(n), **fp32)))
        return plain_runs[0]

    def graphs_off():
        os.environ["QSERVE_CUDA_GRAPHS"] = "0"
        try:
            got = tokens(_generate(model, prompts, _params(n), **fp32))
        finally:
            os.environ.pop("QSERVE_CUDA_GRAPHS")
        Report.case("CUDA graphs off", got == plain(), f"{_same(got, plain())}/{len(got)} "
                    "prompts equal", "all")
    if dev == "cuda":
        run("CUDA graphs off", graphs_off)

    def seeded():
        from qserve.sampling_params import SamplingParams

        sp = [SamplingParams(max_tokens=n, temperature=0.8, seed=7 + i, ignore_eos=True)
              for i in range(len(prompts))]
        one = tokens(_generate(model, prompts[:1], sp[:1], **fp32))
        again = tokens(_generate(model, prompts[:1], sp[:1], **fp32))
        batch = tokens(_generate(model, prompts, sp, **fp32))
        ok = one == again and one[0] == batch[0]
        Report.case("seeded sampling", ok, f"alone twice {one == again}, in a batch "
                    f"{one[0] == batch[0]}", "both")
    run("seeded sampling", seeded)

    # a pool that holds the longest sequence and one block more: not all of them at once
    from qserve.loader import load_tokenizer

    tok = load_tokenizer(str(model))
    need = [-(-(len(tok.encode(p)) + n) // 16) for p in prompts]  # blocks of 16 tokens
    small = dict(kv_cache_memory=_blocks(model, max(need) + 1), swap_space="64MiB",
                 watermark=0.0, max_model_len=16 * (max(need) + 1))
    # layer-wise admission: three long prompts (the fixture's, joined in turn), admitted in
    # one step, over a pool that holds one of them and the staging blocks of one more (one
    # layer in flight: with 4 layers, 4 in flight would stage the whole prompt at once)
    long = [" ".join(prompts[i:] + prompts[:i]) * 2 for i in range(3)]
    need = -(-(max(len(tok.encode(t)) for t in long) + n) // 16)
    pool = need + 2 + -(-need // 4)
    offload = dict(kv_offload="layerwise", kv_offload_lookahead=1, swap_space="64MiB",
                   watermark=0.0, kv_cache_memory=_blocks(model, pool),
                   max_model_len=16 * pool)
    for name, extra, texts in (
            ("swap preemption", dict(preemption_mode="swap", **small), prompts),
            ("chunked prefill", dict(max_num_batched_tokens=8), prompts),
            ("layer-wise offload", offload, long)):
        def constrained(name=name, extra=extra, texts=texts):
            stats: dict = {}
            if texts is not prompts:  # its own unconstrained run
                want = tokens(_generate(model, texts, _params(n), **fp32))
            else:
                want = plain()
            got = tokens(_generate(model, texts, _params(n), stats, **{**fp32, **extra}))
            # swap: at the fixture's full length the sequences outgrow the pool; layer-wise:
            # the long prompt never fits. Either must then occur.
            key = {"swap preemption": "swap_outs", "layer-wise offload": "layerwise"}.get(name)
            occurred = (key is None or stats[key] > 0
                        or key == "swap_outs" and n < 16)
            Report.case(name, got == want and occurred, f"{_same(got, want)}/{len(got)} "
                        f"prompts equal; {stats}", "all" + (f", {key} > 0" if key else ""))
        run(name, constrained)
    print(f"\n(check: {time.monotonic() - T0:.0f} s, device {dev}, torch {torch.__version__})")


def _same(a: list, b: list) -> int:
    return sum(x == y for x, y in zip(a, b))


def _blocks(model: Path, blocks: int) -> int:
    """Bytes of `blocks` fp32 KV blocks of 16 tokens for the fixture's model."""
    from qserve.engine.cache_engine import bytes_per_block
    from qserve.loader import load_arch
    import torch

    return blocks * bytes_per_block(load_arch(str(model)), 16, torch.float32)


# ---- bench ---------------------------------------------------------------------------------
SHAPES = {  # Hugging Face config fields of the layer shapes benchmarked
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    tie_word_embeddings=True),
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                    tie_word_embeddings=False),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 tie_word_embeddings=False),  # K of 256 and 512: whole GGML super-blocks
}


def random_loaded(shape: str, weights: str, device: str, tokenizer):
    """A LoadedModel of random weights with `shape`'s layers: fp16 dense, int4 g128
    symmetric / int8 per channel codes, or "q4km": random GGML blocks as a Q4_K_M file mixes
    them (gpu_check.random_weight), made on the device."""
    import torch

    from qserve.config import ModelArchConfig
    from qserve.loader import LoadedModel
    from scripts.gpu_check import random_weight

    s = SHAPES[shape]
    h, inter, L = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    H, hkv = s["num_attention_heads"], s["num_key_value_heads"]
    d = h // H
    arch = ModelArchConfig(architecture="llama", vocab_size=s["vocab_size"], hidden_size=h,
                           intermediate_size=inter, num_layers=L, num_heads=H, num_kv_heads=hkv,
                           head_dim=d, max_position_embeddings=4096,
                           tie_word_embeddings=s["tie_word_embeddings"])

    def fmt(name: str) -> str:
        if weights != "q4km":
            return {"fp16": "fp16", "w4": "w4", "w8": "w8"}[weights]
        # a Q4_K_M file's mix: Q6_K for the value and down projections and the output
        return "q6_k" if name.split(".")[-1] in ("v_proj", "down_proj", "lm_head") else "q4_k"

    w = {"model.embed_tokens.weight": random_weight(s["vocab_size"], h, "fp16", device),
         "model.norm.weight": torch.ones(h, device=device)}
    if not arch.tie_word_embeddings:
        w["lm_head.weight"] = random_weight(s["vocab_size"], h, fmt("lm_head"), device)
    for i in range(L):
        p = f"model.layers.{i}."
        for name, (n, k) in {"self_attn.q_proj": (H * d, h), "self_attn.k_proj": (hkv * d, h),
                             "self_attn.v_proj": (hkv * d, h), "self_attn.o_proj": (h, H * d),
                             "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                             "mlp.down_proj": (h, inter)}.items():
            w[p + name + ".weight"] = random_weight(n, k, fmt(name), device,
                                                    group=128 if k % 128 == 0 else 64)
        w[p + "input_layernorm.weight"] = torch.ones(h, device=device)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, device=device)
    return LoadedModel(arch=arch, weights=w, tokenizer=tokenizer, path=Path(f"random-{shape}"),
                       source_format="qserve")


def _decode_rate(engine, batch: int, steps: int, vocab: int) -> tuple[float, float, int, float]:
    """Decode `steps` tokens for `batch` sequences after their 32-token prefill:
    (tokens/s, step ms, launches per step, host ms per step)."""
    import torch

    from qserve.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        ids = torch.randint(0, min(vocab, 49152), (32,), generator=g).tolist()
        engine.add_request(f"b{i}", None, SamplingParams(max_tokens=steps + 4, temperature=0.0,
                                                         ignore_eos=True),
                           prompt_token_ids=ids)
    while any(len(s.output_token_ids) < 2 for s in engine.scheduler.running) or (
            engine.scheduler.waiting):  # prefill, then two warm decode steps (graph capture)
        engine.step()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    step_s = (time.perf_counter() - t) / steps
    launches, gpu_ms = _profile_step(engine)
    while engine.has_unfinished_requests():
        engine.step()
    return batch / step_s, step_s * 1e3, launches, max(0.0, step_s * 1e3 - gpu_ms)


def _profile_step(engine) -> tuple[int, float]:
    """(kernel launches incl. graph launches, GPU kernel ms) of one step; (0, 0) on CPU."""
    import torch

    if not torch.cuda.is_available():
        engine.step()
        return 0, 0.0
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    launches, gpu_us = 0, 0.0
    for e in prof.events():
        if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                      "cudaLaunchKernelExC", "cudaGraphLaunch"):
            launches += 1
        elif e.device_type == torch.autograd.DeviceType.CUDA:  # a kernel or copy on the GPU
            gpu_us += e.time_range.elapsed_us()
    return launches, gpu_us / 1e3


def _hf_rate(shape: str, batch: int, steps: int, device: str, compiled: bool) -> str:
    """Hugging Face transformers LlamaForCausalLM, random fp16 weights: decode tokens/s."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SHAPES[shape]
    dtype = torch.float16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM._from_config(LlamaConfig(**s), dtype=dtype).eval()
    kw = {}
    if compiled:
        model.generation_config.cache_implementation = "static"
        # inductor without its CUDA graphs: "reduce-overhead" failed under generate's loop on
        # the first GPU run (a graph's output read after the next replay overwrote it)
        model.forward = torch.compile(model.forward, mode="default", fullgraph=True)
    ids = torch.randint(0, s["vocab_size"], (batch, 32), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(n: int) -> float:
        sync()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       attention_mask=torch.ones_like(ids), **kw)
        sync()
        return time.perf_counter() - t

    timed(4)  # warm-up (compiles)
    dt = timed(steps + 1) - timed(1)  # the prefill and first token cancel
    del model
    _empty_cache()
    return f"{batch * steps / dt:.0f}"


def bench(args) -> None:
    """One table per run, per shape in order of what matters most when time runs short:
    for each batch, transformers eager, then qserve over weights x KV; torch.compile last."""
    import torch

    dev = args.device
    Report("bench: decode, random weights", ["shape", "runner", "weights", "KV", "batch",
                                             "tok/s", "step ms", "launches/step",
                                             "host ms/step"])
    batches = [int(b) for b in args.batches.split(",")]
    for shape in args.shapes.split(","):
        for batch in batches:
            _hf_row(shape, batch, dev, args, compiled=False)
            for weights in args.weights.split(","):
                for kv in args.kv_bench.split(","):
                    _engine_row(shape, weights, kv, batch, dev, args)
        for batch in batches:
            if dev == "cuda":
                _hf_row(shape, batch, dev, args, compiled=True)
    print(f"\n(bench: {time.monotonic() - T0:.0f} s, torch {torch.__version__})")


def _engine_row(shape: str, weights: str, kv: str, batch: int, dev: str, args) -> None:
    from qserve.config import engine_config
    from qserve.engine.llm_engine import LLMEngine
    from qserve.loader import load_tokenizer

    cells = [shape, "qserve", weights, kv, batch]
    if left(args.deadline) < 30:
        Report.row(*cells, "skipped (deadline)", "", "", "")
        return
    loaded = engine = None
    try:
        loaded = random_loaded(shape, weights, dev,
                               load_tokenizer(str(Path(args.fixture) / "model")))
        cfg = engine_config(None, device=dev, dtype="fp16" if dev == "cuda" else "fp32",
                            kv_dtype=kv, max_model_len=args.steps + 64, max_num_seqs=batch,
                            enable_prefix_caching=False)
        engine = LLMEngine(cfg, loaded=loaded)
        engine.detokenize = False
        rate, step_ms, launches, host_ms = _decode_rate(engine, batch, args.steps,
                                                        loaded.arch.vocab_size)
        Report.row(*cells, f"{rate:.0f}", f"{step_ms:.2f}", launches, f"{host_ms:.2f}")
    except Exception as e:  # noqa: BLE001
        Report.row(*cells, f"error: {type(e).__name__}: {str(e)[:80]}", "", "", "")
        traceback.print_exc(file=sys.stderr)
    finally:
        loaded = engine = None
        _empty_cache()


def _hf_row(shape: str, batch: int, dev: str, args, compiled: bool) -> None:
    cells = [shape, "transformers " + ("torch.compile" if compiled else "eager"), "fp16",
             "fp16", batch]
    if left(args.deadline) < (150 if compiled else 40):
        Report.row(*cells, "skipped (deadline)", "", "", "")
        return
    try:
        Report.row(*cells, _hf_rate(shape, batch, args.steps, dev, compiled), "", "", "")
    except Exception as e:  # noqa: BLE001
        Report.row(*cells, f"error: {type(e).__name__}: {str(e)[:60]}", "", "", "")


# ---- all -----------------------------------------------------------------------------------
def _xdist() -> list[str]:
    """pytest-xdist's workers where it is installed (the GPU machine has it): the kernel
    tests' Triton compiles then run on several cores."""
    import importlib.util

    return ["-n", "8"] if importlib.util.find_spec("xdist") else []


def run_all(args) -> None:
    """Kernel tests, gpu_check's perf sections (tune first: its table then serves the rest of
    the run), check, bench, in --parts' order; then the Triton cache to --out."""
    out = Path(args.out) if args.out else None
    parts = args.parts.split(",")
    unknown = set(parts) - {"kernels", "perf", "check", "bench"}
    if unknown:
        raise SystemExit(f"error: unknown part(s) {', '.join(sorted(unknown))}")
    for i, part in enumerate(parts):
        if part == "kernels":
            _subprocess_part(args, out, "kernel tests", [
                sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--maxfail=8",
                *_xdist(), "tests/test_triton_kernels.py", "tests/test_triton_ggml.py",
                "tests/test_cuda_path.py"], 150)
        elif part == "perf":
            later = {"check", "bench"} & set(parts[i + 1:])
            budget = 150 + args.tune_budget
            cmd = [sys.executable, "scripts/gpu_check.py", "--skip-tests", "--sections",
                   args.perf_sections, "--tune-budget", str(args.tune_budget),
                   "--e2e-kv", args.kv_bench,
                   "--deadline", str(int(min(budget, left(args.deadline)
                                             - (200 if later else 30))))]
            _subprocess_part(args, out, "gpu_check perf",
                             cmd + (["--tune-out", str(out)] if out is not None else []), budget)
            _use_tuning(out)
        elif part == "check":
            check(args)
        else:
            bench(args)
    cache = os.environ.get("TRITON_CACHE_DIR")
    if out is not None and cache and Path(cache).is_dir():
        shutil.make_archive(str(out / "triton-cache"), "gztar", cache)
        print(f"\nTriton cache saved to {out / 'triton-cache.tar.gz'}")


def _subprocess_part(args, out: Path | None, name: str, cmd: list[str], budget: float) -> None:
    """One part run as a subprocess within its budget and the deadline; its whole output to
    out/<name>.log, the report gets its tail (all of it for gpu_check's tables)."""
    if left(args.deadline) < 60:
        Report.failures.append(f"{name} (deadline)")
        return
    print(f"\n## {name}\n\n`{' '.join(cmd[1:])}`\n", flush=True)
    log = out / (name.replace(" ", "-") + ".log") if out is not None else None
    try:
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                           timeout=max(30, min(budget, left(args.deadline) - 30)))
        text = (r.stdout + r.stderr).strip()
        failed = r.returncode != 0
    except subprocess.TimeoutExpired as e:
        text = e.stdout or b""
        text = (text.decode(errors="replace") if isinstance(text, bytes) else text).strip()
        text += f"\n(stopped after its {budget:.0f} s budget)"
        name += " (timeout)"
        failed = True
    if log is not None:
        log.write_text(text + "\n")
    print(text if name.startswith("gpu_check") else "\n".join(text.splitlines()[-15:]))
    if failed:
        Report.failures.append(name)


def _use_tuning(out: Path | None) -> None:
    """The table gpu_check's tune section wrote to `out` serves the rest of this run."""
    import torch

    from qserve.kernels.triton_dequant_gemm import device_slug

    if out is None or not torch.cuda.is_available():
        return
    tuned = out / f"{device_slug(torch.cuda.get_device_name())}.json"
    if tuned.is_file():
        os.environ["QSERVE_TRITON_TUNING"] = str(tuned)
        print(f"\n(dequant_matmul tuned by {tuned.name} from here on)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["check", "bench", "all"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--fixture", default=str(REPO / ".gpu"))
    ap.add_argument("--dtypes", default="fp32,bf16", help="check: activation dtypes")
    ap.add_argument("--kv", default="fp32,int8,int4", help="check: KV dtypes")
    ap.add_argument("--max-tokens", type=int, default=None, help="check: fewer tokens")
    ap.add_argument("--cases", default=",".join(CASES), help="check: " + ", ".join(CASES))
    ap.add_argument("--shapes", default="smollm2,llama8b", help="bench: " + ", ".join(SHAPES))
    ap.add_argument("--weights", default="fp16,w4,w8,q4km",
                    help="bench: weight formats (fp16, w4, w8, q4km)")
    ap.add_argument("--kv-bench", default="fp16,int8,int4",
                    help="bench (and gpu_check's e2e section): KV dtypes")
    ap.add_argument("--batches", default="1,32", help="bench: batch sizes")
    ap.add_argument("--steps", type=int, default=32, help="bench: decode steps timed")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from start after which no new case or row starts")
    ap.add_argument("--out", default=None,
                    help="all: where the Triton cache, the logs and the tuned table go")
    ap.add_argument("--parts", default="kernels,perf,check,bench",
                    help="all: which of kernels, perf, check, bench to run")
    ap.add_argument("--perf-sections", default="copy,tune,gemm,decode,prefill",
                    help="all: gpu_check's sections (e2e adds its torch fp16 eager layer loop)")
    ap.add_argument("--tune-budget", type=float, default=90.0,
                    help="all: seconds gpu_check's tune section may take")
    args = ap.parse_args()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: no CUDA device; use --device cpu for the smoke run", file=sys.stderr)
            return 2
    # int4 KV reads a calibrated codebook from $QSERVE_HOME: a fresh one, never the user's
    os.environ.setdefault("QSERVE_HOME", tempfile.mkdtemp(prefix="qserve-gpu-"))
    print(f"# qserve on {args.device}: gpu_e2e {args.command}")
    {"check": check, "bench": bench, "all": run_all}[args.command](args)
    verdict = "GO" if not Report.failures else "NO-GO: " + ", ".join(Report.failures)
    print(f"\n**{verdict}** ({time.monotonic() - T0:.0f} s)")
    return 0 if not Report.failures else 1


if __name__ == "__main__":
    sys.exit(main())
