"""Cold start of `qserve chat` to its first reply token and of `qserve serve` to its first
healthy answer, and where the time goes.

    python scripts/cold_start.py [--model MODEL] [--runs 3]

First the real thing: `echo Hi | qserve chat --max-tokens 1` in a fresh process, `--runs`
times (wall seconds and peak RSS), and `qserve serve` until GET /health answers 200 (the
targets are <= 5 s each on the default model). Then one in-process run split into phases
(imports, model resolution, reading and repacking weights, the KV pool, the first prefill),
with wall and CPU seconds each. Run it on a quiet machine: on a busy one the numbers mean
little.
"""
from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time


def end_to_end(model: str | None, runs: int) -> list[tuple[float, float]]:
    """(wall s, peak RSS MiB) of `echo Hi | qserve chat --max-tokens 1`, per run."""
    cmd = [sys.executable, "-m", "qserve", "chat", "--max-tokens", "1", "--temperature", "0"]
    cmd += [model] if model else []
    out = []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        t0 = time.perf_counter()
        r = subprocess.run(cmd, input="Hi\n", capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            sys.exit(r.stderr)
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest child so far
        out.append((wall, max(rss, before) / 1024))
    return out


def serve_ready(model: str | None) -> float:
    """Seconds from starting `qserve serve` on a free port to GET /health answering 200."""
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "qserve", "serve", "--port", str(port)]
    cmd += [model] if model else []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                time.sleep(0.05)
        sys.exit(f"qserve serve exited with status {proc.returncode}")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def phases(model: str | None) -> list[tuple[str, float, float]]:
    """(phase, wall s, CPU s) of one cold start in this process (run before anything else
    imported torch)."""
    marks = [("start", time.perf_counter(), time.process_time())]

    def mark(name: str) -> None:
        marks.append((name, time.perf_counter(), time.process_time()))

    import torch  # noqa: F401
    mark("import torch")
    import qserve.chat  # noqa: F401
    import qserve.cli  # noqa: F401
    import qserve.llm
    mark("import qserve (cli, chat, engine)")
    from qserve.config import engine_config
    from qserve.loader.registry import resolve_model
    resolve_model(model)
    mark("resolve and verify the model")
    import qserve.engine.llm_engine as le
    build_model, cache_engine = le.build_model, le.CacheEngine

    def timed_build(*a, **k):
        mark("memory plan, tokenizer, lazy weights")
        model_ = build_model(*a, **k)
        mark("read + repack weights, build model")
        return model_

    def timed_cache(*a, **k):
        mark("KV codebook (int4 KV only)")
        cache = cache_engine(*a, **k)
        mark("allocate the KV pool")
        return cache

    le.build_model, le.CacheEngine = timed_build, timed_cache
    try:
        eng = qserve.llm.make_engine(engine_config(model, max_num_seqs=1))  # as chat does
    finally:
        le.build_model, le.CacheEngine = build_model, cache_engine
    mark("scheduler and runner")
    from qserve.sampling_params import SamplingParams
    tok = eng.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    eng.add_request("r", None, SamplingParams(max_tokens=1, temperature=0),
                    prompt_token_ids=tok.encode(text, add_special_tokens=False))
    while not any(o.finished for o in eng.step()):
        pass
    mark("first reply token (prefill)")
    return [(n, w - w0, c - c0) for (_, w0, c0), (n, w, c) in zip(marks, marks[1:])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="alias, .gguf or directory  [default: the default model]")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    print("| run | qserve chat --max-tokens 1 (Hi piped in), s | peak RSS MiB (largest so far) |")
    print("|---|---|---|")
    for i, (wall, rss) in enumerate(end_to_end(args.model, args.runs), 1):
        print(f"| {i} | {wall:.2f} | {rss:,.0f} |")
    print(f"\nqserve serve until /health is 200: {serve_ready(args.model):.2f} s")
    rows = phases(args.model)
    print("\n| phase (one run, in process) | wall s | CPU s |")
    print("|---|---|---|")
    for name, wall, cpu in rows:
        print(f"| {name} | {wall:.2f} | {cpu:.2f} |")
    print(f"| total | {sum(r[1] for r in rows):.2f} | {sum(r[2] for r in rows):.2f} |")


if __name__ == "__main__":
    main()
