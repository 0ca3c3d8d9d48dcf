"""Prefix-aware routing against round-robin on `qserve serve --replicas`: the prefix-cache hit
rate the replicas report and the time to first token the clients see.

    python scripts/bench_routing.py                       # 8 system prompts x 16 users, 2 replicas
    python scripts/bench_routing.py --systems 2 --users 2 --max-tokens 2 --system-words 40 \
        --max-model-len 256                                               # smoke

The workload is a chat service with a few long system prompts (assistants) shared by many
users: --systems prompts of about --system-words words each, and --users users per prompt,
each sending one chat message (a short, distinct question) with stream=true, temperature 0
and ignore_eos. Requests arrive in a seeded random order with --concurrency in flight, so
under round-robin every replica sees every prompt.

The KV pool: each replica's holds --cache-share (default 0.5) of the system prompts' blocks,
plus the blocks of its share of the requests in flight beyond their system prompt (computed
from the tokenizer and the engine's KV layout, and printed). That is the deployment prefix
routing is for: a hot set of prompts that one replica's cache cannot hold but the replicas'
caches together can. With pools that hold every prompt, any policy hits (only each replica's
first request of a prompt misses: with the defaults, prefix routing can gain at most the 8 of
128 requests that round-robin sends cold to the second replica); with pools far below half,
neither can. Both policies run in the same run, with the same pools and requests;
--kv-cache-memory sets the pools directly instead.

Each policy gets a fresh deployment (a local Ray cluster of --replicas replicas, so the caches
start empty and equal) and the same requests:

    hit rate  prefix-cache hit blocks x block size / prompt tokens, summed over the replicas'
              /metrics (qserve_prefix_cache_hit_blocks, counted once per request, at its
              first admission; qserve_prompt_tokens)
    TTFT      request sent -> first text chunk, client side (includes queueing)
    sticky    the share of requests that went to their system prompt's most used replica
    preempt   the replicas' preemptions (a pool too small for the requests in flight)

Round-robin makes every replica cache every prompt and evict them in turn; prefix routing
gives each prompt a home replica, so each replica caches its half. Needs Ray Serve
(pip install 'qserve[cluster]'), openai and httpx.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("QSERVE_HOME", str(REPO / ".cache" / "qserve"))
MODEL_NAME = "bench"
WORDS = ("harbour tide lantern compass anchor ledger orchard meadow granite ember willow "
         "falcon cobalt saffron thistle quarry beacon glacier canyon prairie").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def system_prompts(n: int, words: int, seed: int) -> list[str]:
    """n distinct system prompts of `words` words; they differ from their first words on, so
    no two share a KV block."""
    rng = random.Random(seed)
    return [f"Assistant {k} of {n}. Follow these house rules: "
            + " ".join(rng.choice(WORDS) for _ in range(words)) for k in range(n)]


def workload(systems: list[str], users: int, seed: int) -> list[tuple[int, str]]:
    """(system prompt index, user message) in a seeded random order. Not a fixed interleave:
    with an even number of prompts, round-robin over 2 replicas would then send each prompt
    to the same replica every time, by accident."""
    requests = [(s, f"User {u} asks: what does rule {u + 1} mean for me?")
                for u in range(users) for s in range(len(systems))]
    random.Random(seed).shuffle(requests)
    return requests


def shared_blocks(model: str | None, systems: list[str], block_size: int) -> tuple[int, int]:
    """(KV blocks two users of one system prompt share, prompt tokens of one request): the
    working set is these blocks times the number of system prompts."""
    from qserve.loader import load_tokenizer

    tok = load_tokenizer(model)

    def ids(user: str) -> list[int]:
        return tok.encode(tok.apply_chat_template(
            [{"role": "system", "content": systems[0]}, {"role": "user", "content": user}]))
    a, b = ids("User 0 asks: what does rule 1 mean for me?"), ids("User 1 asks: why?")
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return common // block_size, len(a)


def pool_blocks(args, shared: int, prompt_tokens: int) -> int:
    """A replica's KV pool in blocks: --cache-share of the system prompts' shared blocks, and
    the blocks of its share of the requests in flight beyond those (their user part and
    output); at least one --max-model-len sequence, which the engine requires."""
    own = -(-(prompt_tokens + args.max_tokens) // args.block_size) - shared
    in_flight = -(-args.concurrency // args.replicas)
    blocks = math.ceil(args.cache_share * args.systems * shared) + in_flight * own
    return max(blocks, -(-args.max_model_len // args.block_size))  # the engine's minimum


def pool_bytes(args, blocks: int) -> int:
    """What `blocks` KV blocks take in a replica's engine (its KV dtype on its device)."""
    from qserve.config import engine_config
    from qserve.engine.cache_engine import bytes_per_block
    from qserve.engine.memory_plan import resolve_kv_dtype
    from qserve.loader import load_arch, resolve_model

    cfg = engine_config(args.model, block_size=args.block_size,
                        device="cuda" if args.replica_gpus > 0 else "cpu")
    path = resolve_model(args.model)
    arch = load_arch(path)
    dtype = resolve_kv_dtype(path, arch, cfg)
    return blocks * bytes_per_block(arch, args.block_size, dtype)


def chat(client, system: str, user: str, max_tokens: int) -> tuple[float, str]:
    """TTFT in seconds, and the replica that answered."""
    t0 = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, stream=True, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])
    ttft = None
    for chunk in raw.parse():
        if ttft is None and any(c.delta.content for c in chunk.choices):
            ttft = time.perf_counter() - t0
    return (ttft if ttft is not None else time.perf_counter() - t0,
            raw.headers["x-qserve-replica"])


def scrape(httpx, url: str) -> dict[str, float]:
    """The replicas' summed counters (the unlabelled series of the aggregated /metrics)."""
    text = httpx.get(url + "/metrics", timeout=60).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\w+) ([\d.e+-]+)$", text, re.M)}


def run_policy(args, routing: str, requests, systems) -> dict:
    import httpx
    import openai
    from ray import serve

    from qserve.server import cluster as C
    from qserve.server.config import ServerConfig

    engine = dict(kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, block_size=args.block_size, device="auto")
    cfg = C.ClusterConfig(replicas=args.replicas, replica_cpus=args.replica_cpus,
                          replica_gpus=args.replica_gpus,
                          routing=routing, max_ongoing_requests=args.max_num_seqs,
                          **({} if args.max_imbalance is None
                             else {"max_imbalance": args.max_imbalance}))
    C.deploy(cfg, args.model, engine, MODEL_NAME, ServerConfig(port=args.port))
    url = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + 600
    while httpx.get(url + "/health", timeout=30).json().get("healthy_replicas") != args.replicas:
        if time.monotonic() > deadline:
            raise SystemExit(f"error: {routing}: the replicas did not come up")
        time.sleep(1)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    before = scrape(httpx, url)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(lambda r: chat(client, systems[r[0]], r[1], args.max_tokens),
                                requests))
    wall = time.perf_counter() - t0
    after = scrape(httpx, url)
    serve.delete(C.APP_NAME)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)
    prompt_tokens = delta("qserve_prompt_tokens_total")
    hit_tokens = delta("qserve_prefix_cache_hit_blocks_total") * args.block_size
    ttfts = sorted(t for t, _ in results)
    per_replica: dict[str, int] = {}
    by_system: dict[int, dict[str, int]] = {}  # system prompt -> replica -> requests
    for (system, _), (_, replica) in zip(requests, results):
        per_replica[replica] = per_replica.get(replica, 0) + 1
        counts = by_system.setdefault(system, {})
        counts[replica] = counts.get(replica, 0) + 1
    return {"routing": routing, "requests": len(results),
            "hit_rate": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
            "ttft_p50_s": statistics.median(ttfts),
            "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
            "wall_s": wall, "per_replica": sorted(per_replica.values(), reverse=True),
            # the share of requests that went to their system prompt's most used replica
            "sticky": sum(max(c.values()) for c in by_system.values()) / len(results),
            "preemptions": int(delta("qserve_preemptions_total")),
            "kv_blocks": int(after.get("qserve_kv_blocks_total", 0)) // args.replicas}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="MODEL as qserve names it [default: the default model]")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--replica-cpus", type=float, default=1.0)
    ap.add_argument("--replica-gpus", type=float, default=0.0, help="> 0: replicas on CUDA")
    ap.add_argument("--systems", type=int, default=8, help="distinct system prompts")
    ap.add_argument("--users", type=int, default=16, help="users (requests) per system prompt")
    ap.add_argument("--system-words", type=int, default=300,
                    help="words per system prompt (about 1.3 tokens each)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ap.add_argument("--cache-share", type=float, default=0.5,
                    help="size each replica's KV pool to hold this share of the system "
                         "prompts' blocks, plus its share of the requests in flight")
    ap.add_argument("--kv-cache-memory",
                    help="per replica, instead of --cache-share (e.g. 96MiB)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--routings", default="prefix,round-robin")
    ap.add_argument("--max-imbalance", type=int,
                    help="prefix routing's bound on load imbalance (router.rank) [default: "
                         "qserve serve's, ClusterConfig.max_imbalance]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="also print one JSON object per row")
    args = ap.parse_args()
    try:
        import ray
    except ImportError:
        raise SystemExit("error: needs Ray Serve: pip install 'qserve[cluster]'") from None

    systems = system_prompts(args.systems, args.system_words, args.seed)
    requests = workload(systems, args.users, args.seed)
    shared, prompt_tokens = shared_blocks(args.model, systems, args.block_size)
    if args.kv_cache_memory is None:
        args.kv_cache_memory = pool_bytes(args, pool_blocks(args, shared, prompt_tokens))
    args.port = free_port()
    ray.init(num_cpus=max(2, int(args.replicas * args.replica_cpus)),
             num_gpus=int(args.replicas * args.replica_gpus + 0.999) or None,
             include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=False)
    rows = []
    try:
        for routing in args.routings.split(","):
            rows.append(run_policy(args, routing, requests, systems))
    finally:
        from ray import serve
        serve.shutdown()
        ray.shutdown()

    blocks = rows[0]["kv_blocks"] if rows else 0
    memory = args.kv_cache_memory
    memory = f"{memory / 2**20:.1f}MiB" if isinstance(memory, int) else memory
    print(f"\n{args.systems} system prompts x {args.users} users, {args.replicas} replicas, "
          f"{args.concurrency} in flight, {args.max_tokens} tokens out; KV {memory} each")
    print(f"a request: {prompt_tokens} prompt tokens, {shared} blocks of {args.block_size} of "
          f"them its system prompt's; all {args.systems} prompts: {shared * args.systems} "
          f"blocks; a replica's pool: {blocks} blocks")
    print(f"{'routing':<12} {'requests':>8} {'hit rate':>9} {'TTFT p50':>9} {'TTFT p90':>9} "
          f"{'wall':>7} {'sticky':>7} {'preempt':>7}  per replica")
    for r in rows:
        print(f"{r['routing']:<12} {r['requests']:>8} {100 * r['hit_rate']:>8.1f}% "
              f"{1000 * r['ttft_p50_s']:>7.0f}ms {1000 * r['ttft_p90_s']:>7.0f}ms "
              f"{r['wall_s']:>6.1f}s {100 * r['sticky']:>6.0f}% {r['preemptions']:>7}  "
              f"{r['per_replica']}")
        if args.json:
            print(json.dumps(r))
    by = {r["routing"]: r for r in rows}
    if "prefix" in by and "round-robin" in by and by["round-robin"]["hit_rate"] > 0:
        p, rr = by["prefix"], by["round-robin"]
        print(f"prefix / round-robin: hit rate x{p['hit_rate'] / rr['hit_rate']:.2f}, "
              f"TTFT p50 x{p['ttft_p50_s'] / rr['ttft_p50_s']:.2f}")


if __name__ == "__main__":
    main()
