#!/usr/bin/env python3
"""The engine's host time per decode step: step wall time less the model's forward and
logits, on the CPU with a tiny random model (so the model is cheap and what is left is the
scheduler, input packing, sampling bookkeeping and outputs, the work a GPU waits on between
CUDA-graph replays), at a batch and after a number of generated tokens.

    python scripts/bench_host_step.py [--batch 32] [--after 5,1000,2000] [--steps 200]
                                      [--output-kind cumulative|delta|final_only]
                                      [--processor] [--model FILE]

Each --after value is its own engine run: `after` warm-up steps, then --steps timed ones.
Detokenizing is off (as in gpu_e2e.py bench); greedy, ignoring EOS. --processor also runs
each step's outputs through an OutputProcessor, as the server's output thread does (text,
stop strings), the engine reporting what engine_params asks and the processor handing out
--output-kind; its time is its own column, not in the host ms.

The "outside C ms" column is the step's time outside the C calls that stream the weights (the
fused decode step, decode_layers, and the row kernels' wmatmul: the output matrix): on a CPU
what is left of a decode step beyond reading the model, Python and torch included (the
embedding lookup, norms, sampling). --model FILE measures a real model (a GGUF or checkpoint,
as qserve loads it by default) instead of the tiny random one, e.g. `--model FILE --batch 1
--after 128 --steps 128` for bench_vs_peers.py's batch-1 decode.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))


class _CTimer:
    """A stand-in for cpu_ops.lib() that adds the time of its decode_layers and wmatmul calls
    to spent[0]."""

    TIMED = ("decode_layers", "wmatmul")

    def __init__(self, lib, spent: list[float]):
        self._lib, self._spent = lib, spent

    def __getattr__(self, name: str):
        fn = getattr(self._lib, name)
        if name not in self.TIMED:
            return fn

        def run(*args):
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self._spent[0] += time.perf_counter() - t
        return run


def host_ms(batch: int, after: int, steps: int, output_kind: str = "cumulative",
            processor: bool = False, model: str | None = None
            ) -> tuple[float, float, float, float]:
    """(step ms, host ms, outside-C ms, processor ms) of `steps` decode steps after `after`
    warm-up steps; `model`: a model path, else the tiny random model."""
    import torch

    import gpu_e2e
    from qserve.config import engine_config
    from qserve.engine.llm_engine import LLMEngine
    from qserve.kernels import cpu_ops
    from qserve.loader import load_tokenizer
    from qserve.sampling_params import SamplingParams

    if model is None:
        loaded = gpu_e2e.random_loaded("tiny", "w4", "cpu",
                                       load_tokenizer(str(REPO / ".gpu" / "model")))
        cfg = engine_config(None, device="cpu", dtype="fp32", kv_dtype="fp16",
                            max_model_len=after + steps + 64, max_num_seqs=batch,
                            enable_prefix_caching=False)
        engine = LLMEngine(cfg, loaded=loaded)
    else:
        cfg = engine_config(model, max_model_len=after + steps + 64, max_num_seqs=batch,
                            enable_prefix_caching=False)
        engine = LLMEngine(cfg)
    engine.detokenize = False
    outputs = None
    if processor:
        from qserve.engine.output_processor import OutputProcessor
        try:
            from qserve.engine.output_processor import engine_params
        except ImportError:  # a qserve from before delta outputs: the engine's are cumulative
            engine_params = lambda p: p  # noqa: E731
        outputs = OutputProcessor(engine.tokenizer)
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        ids = torch.randint(0, engine.arch.vocab_size, (32,), generator=g).tolist()
        kind = {} if output_kind == "cumulative" else {"output_kind": output_kind}  # (also
        # runs on a qserve from before output_kind, for a comparison)
        params = SamplingParams(max_tokens=after + steps + 8, temperature=0.0,
                                ignore_eos=True, **kind)
        if outputs is not None:
            outputs.add(f"b{i}", ids, params)
            params = engine_params(params)
        engine.add_request(f"b{i}", None, params, prompt_token_ids=ids)
    processed = [0.0]

    def step() -> None:
        outs = engine.step()
        if outputs is not None:
            t = time.perf_counter()
            for out in outs:
                outputs.process(out)
            processed[0] += time.perf_counter() - t
    for _ in range(after + 2):  # the prefill, then `after` decode steps
        step()
    model, spent, processed[0] = engine.runner.model, [0.0], 0.0

    def timed(fn):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t
        return run
    model.forward, model.compute_logits = timed(model.forward), timed(model.compute_logits)
    lib, in_c = cpu_ops.lib(), [0.0]
    if lib is not None:
        cpu_ops._lib = _CTimer(lib, in_c)
    try:
        t = time.perf_counter()
        for _ in range(steps):
            step()
        ms = (time.perf_counter() - t - processed[0]) / steps * 1e3
    finally:
        if lib is not None:
            cpu_ops._lib = lib
    return (ms, ms - spent[0] / steps * 1e3, ms - in_c[0] / steps * 1e3,
            processed[0] / steps * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--after", default="5,1000,2000", help="generated tokens before timing")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--output-kind", default="cumulative",
                    choices=["cumulative", "delta", "final_only"],
                    help="cumulative: everything so far every step; delta: what each step "
                         "added (a server's streams); final_only: at the end (LLM.generate)")
    ap.add_argument("--processor", action="store_true",
                    help="also time an OutputProcessor on the outputs (the server's path)")
    ap.add_argument("--model", help="a model to load (as qserve does by default) instead of "
                                    "the tiny random one")
    args = ap.parse_args()
    print(f"{args.model or 'tiny random model'}; outputs: {args.output_kind}"
          f"{', processed' if args.processor else ''}\n"
          "| batch | tokens generated before | step ms | host ms | outside C ms "
          "| processor ms |\n|---|---|---|---|---|---|")
    for after in (int(a) for a in args.after.split(",")):
        step, host, outside, proc = host_ms(args.batch, after, args.steps, args.output_kind,
                                            args.processor, args.model)
        print(f"| {args.batch} | {after} | {step:.2f} | {host:.3f} | {outside:.3f} | {proc:.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
