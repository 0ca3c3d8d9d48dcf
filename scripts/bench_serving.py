"""Serving benchmark: N concurrent streaming clients against `qserve serve` and, in the same
run, against llama.cpp's own `llama-server` on the same GGUF. Prints one row per server,
workload and client count.

    python scripts/bench_serving.py --clients 1,4,16,64 --requests-per-client 4
    python scripts/bench_serving.py --clients 1 --requests-per-client 2 --output-len 8 \
        --structured-clients 1          # a smoke test

The peer is llama.cpp's `llama-server` built natively by scripts/peer.py, with continuous
batching over one shared KV pool: `-np 16 -kvu -c 16384 -t 2` (--llama-parallel, --llama-ctx,
--threads). qserve serves the same file at its own precision. Each server is started once and
runs every client count.

Workloads (closed loop: each client sends its requests one after another, streaming):
    text   /v1/completions, temperature 0, ignore_eos, prompt and output lengths drawn
           uniformly from --input-len / --output-len (same draws for every server)
    json   /v1/chat/completions with response_format json_schema (nested objects, enums),
           temperature 0; each answer is parsed and validated: `valid_pct`
    twin   the json workload's prompts without the schema, ignore_eos, each request as long as
           its json answer was: the same decode work unconstrained. The masking overhead is
           json TPOT p50 / twin TPOT p50 - 1 (llama-server's grammar, or qserve's xgrammar),
           json and twin run alternately --structured-repeats times (a 2-core VM drifts by
           tens of % between minutes); the table shows the pair of median overhead.
Output tokens are the server's own count (`stream_options.include_usage`, which both servers
answer), the EOS token included. Re-tokenizing the text instead undercounts constrained output,
whose tokens a grammar often splits where the tokenizer would not (the json answers here: 87
tokens generated, 74 re-tokenized), and so inflated the json TPOT by ~18%; it is the fallback
for a server that reports no usage.

    TTFT  request sent -> first text chunk            (client side, includes queueing)
    TPOT  (last chunk - first chunk) / (tokens - 1)   per request, over the tokens that carry
                                                      text (an ending EOS carries none)

Needs httpx (and jsonschema for the json workload).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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
sys.path.insert(0, str(REPO / "scripts"))
os.environ.setdefault("QSERVE_HOME", str(REPO / ".cache" / "qserve"))
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge every "
         "boxing match in the old town square near river banks and tall green hills").split()


# The structured workload's schema: nested objects, enums, bounded strings and array.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "plan": {"enum": ["free", "pro", "team"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 16},
                                   "country": {"enum": ["FR", "DE", "US", "JP"]}},
                    "required": ["city", "country"], "additionalProperties": False},
        "orders": {"type": "array", "maxItems": 3, "items": {
            "type": "object",
            "properties": {"item": {"enum": ["book", "lamp", "desk"]},
                           "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["item", "quantity"], "additionalProperties": False}},
    },
    "required": ["name", "plan", "address", "orders"],
    "additionalProperties": False,
}


@dataclass
class Request:
    path: str  # /v1/completions or /v1/chat/completions
    body: dict


@dataclass
class Result:
    ttft: float
    tpot: float | None
    tokens: int
    latency: float
    text: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def text_workload(tokenizer, n: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  seed: int) -> list[Request]:
    """n completions; each prompt is exactly its drawn length in tokens."""
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        want = rng.randint(*input_len)
        text = " ".join(rng.choice(WORDS) for _ in range(want * 2))
        ids = tokenizer.encode(text, add_special_tokens=False)[:want]
        work.append(Request("/v1/completions", {
            "prompt": tokenizer.decode(ids), "max_tokens": rng.randint(*output_len),
            "temperature": 0, "ignore_eos": True}))
    return work


def json_workload(n: int, max_tokens: int, seed: int) -> list[Request]:
    """n chat requests for a customer record that must follow SCHEMA."""
    rng = random.Random(seed)
    fmt = {"type": "json_schema", "json_schema": {"name": "customer", "schema": SCHEMA,
                                                  "strict": True}}
    return [Request("/v1/chat/completions", {
        "messages": [{"role": "user", "content": f"Invent customer number {rng.randint(1, 999)} "
                                                 f"of a {rng.choice(WORDS)} shop, as JSON."}],
        "max_tokens": max_tokens, "temperature": 0, "response_format": fmt}) for _ in range(n)]


def twin_workload(json_work: list[Request], results: list[Result]) -> list[Request]:
    """The json requests unconstrained, each forced to its json answer's length."""
    twins = []
    for req, res in zip(json_work, results):
        body = {k: v for k, v in req.body.items() if k != "response_format"}
        twins.append(Request(req.path, body | {"max_tokens": max(res.tokens, 2),
                                               "ignore_eos": True}))
    return twins


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


def start_qserve(gguf: str, port: int, args, log: Path) -> Process:
    argv = [sys.executable, "-m", "qserve", "serve", gguf, "--port", str(port),
            "--served-model-name", "bench", "--max-model-len", str(args.ctx),
            *args.qserve_flags.split()]
    return Process("qserve", argv, f"http://127.0.0.1:{port}", log)


def start_llama(gguf: str, port: int, args, log: Path) -> Process:
    """llama.cpp's server: continuous batching over --llama-parallel slots sharing one KV pool
    of --llama-ctx tokens (-kvu)."""
    import peer

    try:
        server = str(peer.binary("llama-server"))
    except peer.PeerError as e:
        sys.exit(f"error: no llama-server: {e} (build it with `python scripts/peer.py`)")
    argv = [server, "-m", gguf, "--port", str(port), "--alias", "bench",
            "-np", str(args.llama_parallel), "-kvu", "-c", str(args.llama_ctx),
            "-t", str(args.threads)]
    return Process("llama-server", argv, f"http://127.0.0.1:{port}", log)


async def one_request(client: httpx.AsyncClient, url: str, req: Request, tokenizer) -> Result:
    chat = req.path.endswith("/chat/completions")
    body = {"model": "bench", "stream": True, "stream_options": {"include_usage": True},
            **req.body}
    start = time.perf_counter()
    pieces: list[str] = []
    times: list[float] = []
    try:
        async with client.stream("POST", url + req.path, json=body) as r:
            if r.status_code != 200:
                sys.exit(f"error: {url}{req.path} answered {r.status_code}: "
                         f"{(await r.aread())[:300]!r}")
            usage, reason = await _read_stream(r, chat, pieces, times)
    except httpx.TransportError as e:  # the server died or dropped us: say so, no traceback
        sys.exit(f"error: {url}{req.path} stopped answering ({type(e).__name__}: {e}); "
                 f"see the server's log")
    first, last = (times[0], times[-1]) if times else (None, None)
    end = time.perf_counter()
    text = "".join(pieces)
    if usage is not None:
        n = usage
        with_text = n - (reason == "stop")  # an EOS ends it, with no text
    else:
        n = with_text = len(tokenizer.encode(text, add_special_tokens=False))
    first = first or end
    tpot = (last - first) / (with_text - 1) if with_text > 1 and last is not None else None
    return Result(first - start, tpot, n, end - start, text)


async def _read_stream(r, chat: bool, pieces: list[str], times: list[float]
                       ) -> tuple[int | None, str | None]:
    """Append each streamed text piece to `pieces` and its arrival time to `times`.
    Returns the completion tokens the server counted (None if it said nothing) and the
    finish reason."""
    usage = reason = None
    async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"].get("completion_tokens")
        choices = chunk.get("choices") or []
        reason = next((c["finish_reason"] for c in choices if c.get("finish_reason")), reason)
        text = "".join(((c.get("delta") or {}).get("content") if chat else c.get("text"))
                       or "" for c in choices)
        if text:
            times.append(time.perf_counter())
            pieces.append(text)
    return usage, reason


async def run_load(url: str, work: list[Request], clients: int, tokenizer
                   ) -> tuple[list[Result], float]:
    """Results in the order of `work`, and the wall time."""
    queue = list(reversed(list(enumerate(work))))
    results: list[Result | None] = [None] * len(work)

    async def client_loop(client):
        while queue:
            i, req = queue.pop()
            results[i] = await one_request(client, url, req, tokenizer)

    # a new connection per request: llama-server (cpp-httplib) closes a keep-alive connection
    # after a few requests or seconds, and a request sent on one it just closed fails unsent
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        wall = time.perf_counter() - start
    return results, wall  # type: ignore[return-value]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def valid_pct(results: list[Result]) -> float:
    import jsonschema

    ok = 0
    for r in results:
        try:
            jsonschema.validate(json.loads(r.text), SCHEMA)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return 100 * ok / max(len(results), 1)


def row(name: str, workload: str, clients: int, results: list[Result], wall: float) -> dict:
    ttft = [r.ttft for r in results]
    tpot = [r.tpot for r in results if r.tpot is not None]
    tokens = sum(r.tokens for r in results)
    return {"server": name, "workload": workload, "clients": clients,
            "requests": len(results), "req_per_s": len(results) / wall,
            "out_tok_per_s": tokens / wall,
            "ttft_p50_ms": 1000 * percentile(ttft, 50), "ttft_p99_ms": 1000 * percentile(ttft, 99),
            "tpot_p50_ms": 1000 * percentile(tpot, 50), "tpot_p99_ms": 1000 * percentile(tpot, 99),
            "valid_pct": valid_pct(results) if workload == "json" else "",
            "mask_overhead_pct": ""}


COLS = ["server", "workload", "clients", "requests", "req_per_s", "out_tok_per_s",
        "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "valid_pct",
        "mask_overhead_pct"]


def format_table(rows: list[dict]) -> str:
    cells = [[f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in COLS]
             for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(COLS)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(COLS, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(line, widths)) + " |"
              for line in cells]
    return "\n".join(lines)


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def counts(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c.strip()]


def bench_server(proc: Process, args, tokenizer) -> list[dict]:
    """Every client count of the text workload, then of the json workload and its twin."""
    rows = []

    def record(r: dict) -> None:
        rows.append(r)
        print(format_table([r]).splitlines()[-1], file=sys.stderr)

    warm = text_workload(tokenizer, 1, args.input_len, args.output_len, args.seed)
    if counts(args.structured_clients):  # the schema compiled once, as a server re-using it
        warm += json_workload(1, args.json_max_tokens, args.seed + 1)
    asyncio.run(run_load(proc.url, warm, 1, tokenizer))
    for clients in counts(args.clients):
        work = text_workload(tokenizer, clients * args.requests_per_client, args.input_len,
                             args.output_len, args.seed)
        results, wall = asyncio.run(run_load(proc.url, work, clients, tokenizer))
        record(row(proc.name, "text", clients, results, wall))
    for clients in counts(args.structured_clients):
        work = json_workload(clients * args.requests_per_client, args.json_max_tokens,
                             args.seed)
        pairs = []  # (overhead %, json row, twin row), run alternately: the machine drifts
        for _ in range(args.structured_repeats):
            results, wall = asyncio.run(run_load(proc.url, work, clients, tokenizer))
            structured = row(proc.name, "json", clients, results, wall)
            twins, wall = asyncio.run(run_load(proc.url, twin_workload(work, results),
                                               clients, tokenizer))
            twin = row(proc.name, "twin", clients, twins, wall)
            overhead = float("nan")
            if structured["tpot_p50_ms"] == structured["tpot_p50_ms"] and twin["tpot_p50_ms"]:
                overhead = 100 * (structured["tpot_p50_ms"] / twin["tpot_p50_ms"] - 1)
            pairs.append((overhead, structured, twin))
        pairs.sort(key=lambda p: p[0])
        print(f"{proc.name} json/twin at {clients} clients, masking overhead per pair: "
              + ", ".join(f"{p[0]:.1f}%" for p in pairs), file=sys.stderr)
        overhead, structured, twin = pairs[len(pairs) // 2]  # the median pair
        structured["mask_overhead_pct"] = overhead
        record(structured)
        record(twin)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF path [default: the default model's]")
    ap.add_argument("--clients", default="1,4,16,64", help="comma-separated client counts")
    ap.add_argument("--structured-clients", default="1,16",
                    help="client counts for the json workload ('' to skip it)")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--structured-repeats", type=int, default=3,
                    help="json / twin runs, alternately; the table shows the median pair")
    ap.add_argument("--input-len", type=span, default=(32, 256), help="LO,HI tokens")
    ap.add_argument("--output-len", type=span, default=(16, 96), help="LO,HI tokens")
    ap.add_argument("--json-max-tokens", type=int, default=200,
                    help="max_tokens of a json request (the schema ends well before)")
    ap.add_argument("--ctx", type=int, default=1024, help="qserve's --max-model-len")
    ap.add_argument("--llama-parallel", type=int, default=16, help="llama-server -np")
    ap.add_argument("--llama-ctx", type=int, default=16384,
                    help="llama-server -c: one KV pool for all slots (-kvu)")
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t")
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
    for key in args.servers.split(","):
        if key not in starters:
            sys.exit(f"error: --servers: {key!r} is not one of {', '.join(starters)}")
        proc = starters[key](gguf, free_port(), args, logs / f"{key}.log")
        try:
            rows += bench_server(proc, args, tokenizer)
        finally:
            proc.stop()
    rows.sort(key=lambda r: (r["workload"] != "text", r["workload"], r["clients"]))
    print(format_table(rows))
    if args.json:
        for r in rows:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
