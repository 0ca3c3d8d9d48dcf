"""Serving benchmark: N concurrent streaming clients against `qserve serve` and, in the same
run, against llama.cpp's server on the same GGUF. Prints one row per server and client count.

    python scripts/bench_serving.py --clients 1,16 --requests-per-client 2

Each client sends its requests one after another (a closed loop) to /v1/completions with
stream=true, temperature 0 and ignore_eos, so both servers produce the requested lengths.
Prompt and output lengths are drawn uniformly from --input-len and --output-len (same draws
for every server). Output tokens are counted by re-tokenizing each streamed text with the
model's tokenizer, identically for both servers.

    TTFT  request sent -> first text chunk            (client side, includes queueing)
    TPOT  (last chunk - first chunk) / (tokens - 1)   per request

The peer is `llama-server` (llama.cpp, continuous batching with --parallel N) when it is on
PATH, else llama-cpp-python's `llama_cpp.server` (pip install 'llama-cpp-python[server]'),
which serves one request at a time. Needs httpx.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("QSERVE_HOME", str(REPO / ".cache" / "qserve"))
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge every "
         "boxing match in the old town square near river banks and tall green hills").split()


@dataclass
class Result:
    ttft: float
    tpot: float | None
    tokens: int
    latency: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_workload(tokenizer, n: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  seed: int) -> list[tuple[str, int]]:
    """n (prompt, max_tokens) pairs; each prompt is exactly its drawn length in tokens."""
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        want = rng.randint(*input_len)
        text = " ".join(rng.choice(WORDS) for _ in range(want * 2))
        ids = tokenizer.encode(text, add_special_tokens=False)[:want]
        work.append((tokenizer.decode(ids), rng.randint(*output_len)))
    return work


class Process:
    def __init__(self, name: str, argv: list[str], url: str, log: Path):
        self.name, self.url = name, url
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"{name} exited during start-up; see {log}")
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        sys.exit(f"{name} did not come up in 300 s; see {log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_qserve(gguf: str, port: int, clients: int, args, log: Path) -> Process:
    argv = [sys.executable, "-m", "qserve", "serve", gguf, "--port", str(port),
            "--served-model-name", "bench", "--max-model-len", str(args.ctx),
            *args.qserve_flags.split()]
    return Process("qserve", argv, f"http://127.0.0.1:{port}", log)


def start_llama(gguf: str, port: int, clients: int, args, log: Path) -> Process:
    server = shutil.which("llama-server")
    if server:  # llama.cpp's own server: continuous batching over `clients` slots
        argv = [server, "-m", gguf, "--port", str(port), "--alias", "bench",
                "-c", str(args.ctx * clients), "--parallel", str(clients),
                "-t", str(args.threads), "--cont-batching"]
        name = "llama-server"
    else:
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port),
                "--model_alias", "bench", "--n_ctx", str(args.ctx),
                "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
                "--interrupt_requests", "False"]  # queue concurrent requests, don't cut them
        name = "llama_cpp.server"
    return Process(name, argv, f"http://127.0.0.1:{port}", log)


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                      tokenizer) -> Result:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    first = last = None
    pieces = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text = "".join(c.get("text") or "" for c in chunk.get("choices", []))
            if text:
                last = time.perf_counter()
                first = first or last
                pieces.append(text)
    end = time.perf_counter()
    n = len(tokenizer.encode("".join(pieces), add_special_tokens=False))
    first = first or end
    tpot = (last - first) / (n - 1) if n > 1 and last is not None else None
    return Result(first - start, tpot, n, end - start)


async def run_load(url: str, work: list[tuple[str, int]], clients: int, tokenizer):
    queue = list(reversed(work))
    results: list[Result] = []

    async def client_loop(client):
        while queue:
            prompt, max_tokens = queue.pop()
            results.append(await one_request(client, url, prompt, max_tokens, tokenizer))

    async with httpx.AsyncClient(timeout=None) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        wall = time.perf_counter() - start
    return results, wall


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def row(name: str, clients: int, results: list[Result], wall: float) -> dict:
    ttft = [r.ttft for r in results]
    tpot = [r.tpot for r in results if r.tpot is not None]
    tokens = sum(r.tokens for r in results)
    return {"server": name, "clients": clients, "requests": len(results),
            "req_per_s": len(results) / wall, "out_tok_per_s": tokens / wall,
            "ttft_p50_ms": 1000 * percentile(ttft, 50), "ttft_p99_ms": 1000 * percentile(ttft, 99),
            "tpot_p50_ms": 1000 * percentile(tpot, 50), "tpot_p99_ms": 1000 * percentile(tpot, 99)}


def format_table(rows: list[dict]) -> str:
    cols = ["server", "clients", "requests", "req_per_s", "out_tok_per_s", "ttft_p50_ms",
            "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"]
    cells = [[f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols]
             for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(cols)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(line, widths)) + " |"
              for line in cells]
    return "\n".join(lines)


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF path [default: the default model's]")
    ap.add_argument("--clients", default="16", help="comma-separated client counts")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--input-len", type=span, default=(32, 256), help="LO,HI tokens")
    ap.add_argument("--output-len", type=span, default=(16, 96), help="LO,HI tokens")
    ap.add_argument("--ctx", type=int, default=1024, help="context per request")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads")
    ap.add_argument("--qserve-flags", default="--kv-cache-memory 1GiB",
                    help="extra `qserve serve` flags")
    ap.add_argument("--servers", default="qserve,llama.cpp")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="also print one JSON object per row")
    args = ap.parse_args()

    from qserve.loader import load_tokenizer
    from qserve.loader.registry import resolve_model

    gguf = str(resolve_model(args.model))
    tokenizer = load_tokenizer(gguf)
    starters = {"qserve": start_qserve, "llama.cpp": start_llama}
    logs = REPO / ".cache" / "bench_serving"
    logs.mkdir(parents=True, exist_ok=True)
    rows = []
    for clients in (int(c) for c in args.clients.split(",")):
        work = make_workload(tokenizer, clients * args.requests_per_client, args.input_len,
                             args.output_len, args.seed)
        for key in args.servers.split(","):
            proc = starters[key](gguf, free_port(), clients, args, logs / f"{key}.log")
            try:
                asyncio.run(run_load(proc.url, work[:1], 1, tokenizer))  # warm-up
                results, wall = asyncio.run(run_load(proc.url, work, clients, tokenizer))
            finally:
                proc.stop()
            rows.append(row(proc.name, clients, results, wall))
            print(format_table(rows[-1:]).splitlines()[-1], file=sys.stderr)
    print(format_table(rows))
    if args.json:
        for r in rows:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
