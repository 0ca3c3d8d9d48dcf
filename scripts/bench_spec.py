"""Speculative decoding on the default model: decode tokens/s at batch 1 without and with each
draft kind, on two workloads, then throughput at N concurrent requests without and with.

    python scripts/bench_spec.py                                   # ngram, self:w8, self:w4g64
    python scripts/bench_spec.py --drafts ngram --max-tokens 32 --concurrent 16

Workloads (chat template, greedy, so every row produces the same text as the baseline):
    chat     free questions: the reply shares little with the prompt
    rewrite  "rewrite this passage": the reply repeats much of its input

Batch 1: each prompt runs alone; decode tok/s = (tokens - 1) / (finish - first token), summed
over the workload's prompts; speedup is against the no-draft row of the same workload, measured
in the same run. Acceptance = accepted / proposed draft tokens; accepted/step = accepted draft
tokens per verifying step (each such step also emits one token of the target's own).
Concurrent: all prompts of both workloads, repeated to N, queued at once; tokens/s = generated
tokens / wall time from the first request added to the last one finished.

A draft *model* needs a smaller model with the target's vocabulary; SmolLM2-135M is the
smallest of its family, so that kind is exercised by the tests only (pass --drafts PATH to
measure one). self:RECIPE drafts are the target's own weights quantized: on this model they cost
about as much per token as the target, so they show acceptance more than speed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("QSERVE_HOME", str(REPO / ".cache" / "qserve"))

CHAT = ["What are three good habits for staying healthy? Answer briefly.",
        "Explain why the sky is blue to a ten year old.",
        "Write a short poem about autumn leaves."]
PASSAGES = [
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in the salt "
    "wind. Every night for forty years the keeper climbed the spiral stairs, trimmed the wick "
    "and watched the ships pass safely by. When the lamp was finally automated, he kept "
    "climbing the stairs anyway, because the sea had become his oldest friend.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon "
    "dioxide to make glucose and oxygen. It takes place mainly in the leaves, inside small "
    "structures called chloroplasts, which contain the green pigment chlorophyll.",
]
REWRITE = [f"Rewrite the following passage with correct punctuation, keeping every word:\n\n{p}"
           for p in PASSAGES]


def run_batch(llm, prompts: list[str], params) -> tuple[list, float]:
    """All prompts queued at once; (outputs, wall seconds)."""
    t0 = time.monotonic()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    return outs, time.monotonic() - t0


def batch1(llm, prompts: list[str], params) -> dict:
    tokens = seconds = steps = drafts = accepted = 0
    texts = []
    for p in prompts:
        [out], _ = run_batch(llm, [p], params)
        c, m = out.outputs[0], out.metrics
        tokens += len(c.token_ids) - 1
        seconds += m.finished_time - m.first_token_time
        steps += c.spec_steps
        drafts += c.spec_draft_tokens
        accepted += c.spec_accepted_tokens
        texts.append(c.token_ids)
    return {"tok_s": tokens / seconds, "accept": accepted / drafts if drafts else None,
            "per_step": accepted / steps if steps else None, "texts": texts}


def spec_options(draft: str | None, args) -> dict:
    return dict(draft=draft, num_speculative_tokens=args.num_speculative_tokens) if draft else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="target model  [default: the default model]")
    ap.add_argument("--drafts", default="ngram,self:w8,self:w4g64",
                    help="comma-separated --draft values to measure")
    ap.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--concurrent-draft", default="ngram",
                    help="the draft used for the concurrent rows")
    ap.add_argument("--threads", type=int, help="torch threads  [default: torch's]")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()

    import torch

    from qserve import LLM, SamplingParams
    from qserve.loader import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    engine = dict(loaded=loaded, device=args.device, kv_cache_memory="512MiB",
                  max_model_len=2048)
    workloads = {"chat": CHAT, "rewrite": REWRITE}
    drafts = [None] + [d for d in args.drafts.split(",") if d]
    t_start = time.monotonic()

    rows, base = [], {}
    for draft in drafts:
        llm = LLM(args.model, **engine, **spec_options(draft, args))
        run_batch(llm, CHAT[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        for name, prompts in workloads.items():
            r = batch1(llm, prompts, params)
            if draft is None:
                base[name] = r
            same = r["texts"] == base[name]["texts"]
            rows.append((draft or "none", name, r["tok_s"], r["tok_s"] / base[name]["tok_s"],
                         r["accept"], r["per_step"], same))
        del llm

    print(f"target {loaded.path.name}, K={args.num_speculative_tokens}, greedy, "
          f"max_tokens {args.max_tokens}, torch threads {torch.get_num_threads()}, "
          f"device {args.device}\n")
    print("| draft        | workload | decode tok/s | speedup | accept % | accepted/step | "
          "same text |")
    print("|--------------|----------|--------------|---------|----------|---------------|"
          "-----------|")
    for draft, name, tok_s, speedup, acc, per_step, same in rows:
        acc_s = "-" if acc is None else f"{100 * acc:.1f}"
        ps_s = "-" if per_step is None else f"{per_step:.2f}"
        print(f"| {draft:<12} | {name:<8} | {tok_s:12.2f} | {speedup:6.2f}x | {acc_s:>8} | "
              f"{ps_s:>13} | {'yes' if same else 'NO':>9} |")

    prompts = (CHAT + REWRITE) * (-(-args.concurrent // (len(CHAT) + len(REWRITE))))
    prompts = prompts[:args.concurrent]
    print(f"\n{args.concurrent} concurrent requests (both workloads), max_tokens "
          f"{args.max_tokens}\n")
    print("| draft        | tokens | seconds | tok/s   | vs none |")
    print("|--------------|--------|---------|---------|---------|")
    first = None
    for draft in (None, args.concurrent_draft):
        llm = LLM(args.model, **engine, **spec_options(draft, args))
        run_batch(llm, CHAT[:1], SamplingParams(temperature=0, max_tokens=4))
        outs, seconds = run_batch(llm, prompts, params)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        first = first or tokens / seconds
        print(f"| {draft or 'none':<12} | {tokens:6d} | {seconds:7.1f} | {tokens / seconds:7.2f} |"
              f" {tokens / seconds / first:6.2f}x |")
        del llm
    print(f"\n({time.monotonic() - t_start:.0f} s in all)")


if __name__ == "__main__":
    main()
