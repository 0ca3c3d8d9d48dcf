"""`qserve serve --replicas`: the prefix-routing policy on its own, then a local Ray cluster
(2 CPUs, loopback only) serving the default model as 2 Ray Serve replicas with small KV pools,
driven by the unmodified `openai` client.

The cluster tests skip, saying why, when Ray Serve is not installed (pip install
'qserve[cluster]'). They are bounded: 16 clients, a few dozen tokens each, every wait with a
deadline.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from qserve.server.router import (PrefixPolicy, PrefixTable, RoundRobin, prefix_keys,
                                  rank, routing_text)

MODEL = "smollm2-135m-instruct"
SYSTEMS = [
    "You are a ship's cook. Answer every question about food in one short sentence, and "
    "mention the sea whenever you can.",
    "You are a lighthouse keeper on a remote rock. You answer questions about weather and "
    "light briefly, like a logbook entry.",
    "You are a librarian in a small town who recommends exactly one book in every answer, "
    "with its author, and nothing else.",
    "You are a patient mathematics tutor. Explain each step of arithmetic on its own line "
    "and never skip a carry or a borrow.",
]


# ---- the routing policy (no Ray) ----------------------------------------------------------
def _chat_keys(messages):
    return prefix_keys(routing_text("/v1/chat/completions",
                                    json.dumps({"messages": messages}).encode()))


def test_keys_shared_by_a_common_system_prompt_and_a_next_turn():
    system = {"role": "system", "content": SYSTEMS[0]}
    a = _chat_keys([system, {"role": "user", "content": "What is for dinner tonight?"}])
    b = _chat_keys([system, {"role": "user", "content": "Is the soup ready yet, cook?"}])
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common >= 1  # the system prompt's whole blocks
    assert a[:common] == b[:common] and a[common:] != b[common:]
    # the next turn of conversation a extends a's text, so it keeps all a's keys
    turn2 = _chat_keys([system, {"role": "user", "content": "What is for dinner tonight?"},
                        {"role": "assistant", "content": "Fish stew, fresh from the sea."},
                        {"role": "user", "content": "And for dessert?"}])
    assert turn2[:len(a)] == a and len(turn2) > len(a)
    # another system prompt shares no whole block with this one
    other = _chat_keys([{"role": "system", "content": SYSTEMS[1]}])
    assert not set(other) & set(a[1:])


def test_only_whole_blocks_are_keyed_and_at_most_max_blocks():
    assert prefix_keys("x" * 63, block_chars=64) == []
    assert len(prefix_keys("x" * 64 + "y" * 63, block_chars=64)) == 1
    assert len(prefix_keys("é" * 1000, block_chars=64, max_blocks=5)) == 5
    # keys are chained: the same block after different prefixes gets different keys
    k1 = prefix_keys("a" * 64 + "c" * 64, block_chars=64)
    k2 = prefix_keys("b" * 64 + "c" * 64, block_chars=64)
    assert k1[1] != k2[1]


def test_routing_text_of_completions_and_of_what_is_not_a_generation():
    assert routing_text("/v1/completions", b'{"prompt": "Once upon"}') == "Once upon"
    assert routing_text("/v1/completions", b'{"prompt": [1, 2, 3]}') == "[1,2,3"
    assert routing_text("/v1/models", b"") is None
    assert routing_text("/v1/chat/completions", b"not json") is None
    assert routing_text("/v1/chat/completions", b"[1]") is None


def test_prefix_table_keeps_a_prefix_home_counts_homes_and_forgets():
    t = PrefixTable(capacity=4)
    t.record([b"k1", b"k2"], "A")
    t.record([b"k1", b"k2", b"k3"], "B")  # B ran a longer prompt with the same start
    assert t.lookup([b"k1", b"k2", b"k3"], {"A", "B"}) == (["B"], 3)
    # k1, k2 stay home on A, the replica that ran them first; B is a second holder
    assert t.lookup([b"k1", b"k2", b"k9"], {"A", "B"}) == (["A", "B"], 2)
    assert t.lookup([b"k1", b"k2", b"k3"], {"A"}) == (["A"], 2)  # B is gone
    assert t.lookup([b"zz"], {"A", "B"}) == ([], 0)
    assert t.homed == {"A": 2, "B": 1}
    t.record([b"k4", b"k5"], "A")  # 5 keys > capacity 4: the least recently used goes
    assert len(t) == 4 and t.lookup([b"k1"], {"A", "B"}) == ([], 0)
    assert t.homed == {"A": 3, "B": 1}
    t.forget("A")  # k2 moves home to B; k4, k5 held by A alone are dropped
    assert t.lookup([b"k1", b"k2"], {"A", "B"}) == (["B"], 2)
    assert len(t) == 2 and t.homed == {"B": 2}


def test_rank_prefers_the_home_until_it_is_too_busy_and_places_new_prefixes_evenly():
    ids = ["A", "B", "C"]
    assert rank(ids, {"A": 5, "B": 1, "C": 1}, ["A"], max_imbalance=4) == ["A", "B", "C"]
    # too busy: past max_imbalance beyond the least loaded, and past twice it
    assert rank(ids, {"A": 6, "B": 1, "C": 0}, ["A"], max_imbalance=6) == ["A", "C", "B"]
    assert rank(ids, {"A": 6, "B": 1, "C": 0}, ["A"], max_imbalance=4) == ["C", "B", "A"]
    assert rank(ids, {"A": 19, "B": 10, "C": 12}, ["A"], max_imbalance=4) == ["A", "B", "C"]
    assert rank(ids, {"A": 21, "B": 10, "C": 12}, ["A"], max_imbalance=4) == ["B", "C", "A"]
    # past a busy home, the next holder, not just the least loaded
    assert rank(ids, {"A": 9, "B": 1, "C": 0}, ["A", "B"], max_imbalance=4) == ["B", "C", "A"]
    # a new prefix: the replica home to the fewest prefix blocks, unless it is too busy
    homed = {"A": 30, "B": 3, "C": 10}
    assert rank(ids, {"A": 0, "B": 2, "C": 1}, [], 4, homed) == ["B", "A", "C"]
    assert rank(ids, {"A": 0, "B": 5, "C": 1}, [], 4, homed) == ["C", "A", "B"]
    # a request without a prefix: the least loaded
    assert rank(ids, {"A": 1, "B": 0, "C": 2}, [], 4, None) == ["B", "A", "C"]
    assert rank(ids, {}, ["gone"], max_imbalance=0) == ids
    rr = RoundRobin()
    assert [rr.rank([], ["A", "B"], {})[0] for _ in range(4)] == ["A", "B", "A", "B"]


def _system_keys(s: int, user: int) -> list[bytes]:
    return _chat_keys([{"role": "system", "content": f"{s}: " + SYSTEMS[s % 4] * 3},
                       {"role": "user", "content": f"User {user} asks a question."}])


def test_policy_spreads_new_prefixes_evenly_and_one_overflow_does_not_move_a_home():
    policy, ids = PrefixPolicy(max_imbalance=4), ["A", "B"]
    # 8 system prompts arrive at once, with the first replica already busier: the homes
    # still split 4 and 4 (placing each new prefix on the least-loaded replica did not)
    load = {"A": 3, "B": 0}
    homes = {}
    for s in range(8):
        first = policy.rank(_system_keys(s, 0), ids, load)[0]
        policy.routed(_system_keys(s, 0), first)
        homes[s] = first
        load[first] += 1
    assert sorted(homes.values()) == ["A"] * 4 + ["B"] * 4
    # a burst: requests ranked before any of them is routed still share a new prefix's home
    burst = [policy.rank(_system_keys(8, u), ids, {"A": 0, "B": 0})[0] for u in range(4)]
    assert len(set(burst)) == 1
    # system prompt 0's home is too busy: one request goes elsewhere, the next ones go home
    home, other = homes[0], "B" if homes[0] == "A" else "A"
    busy = {home: 6, other: 1}
    assert policy.rank(_system_keys(0, 1), ids, busy)[0] == other
    policy.routed(_system_keys(0, 1), other)
    assert [policy.rank(_system_keys(0, u), ids, {"A": 2, "B": 2})[0]
            for u in range(2, 6)] == [home] * 4
    # a short common start (under min_match of the request) is not a reason to stick
    long_user = [{"role": "system", "content": SYSTEMS[0] * 3},
                 {"role": "user", "content": "a long document " * 300}]
    policy.routed(_chat_keys(long_user[:1]), home)
    assert policy.rank(_chat_keys(long_user), ids, {home: 3, other: 0})[0] == other


def test_policy_shares_out_the_caches_where_round_robin_thrashes_them():
    """A replay of the benchmark's workload (8 system prompts x 16 users, 2 replicas, 8 in
    flight, in a seeded random order) against caches that hold 4 system prompts each (LRU),
    with requests ending in a seeded random order: prefix routing keeps each prompt on one
    replica and hits about twice as often as round-robin."""
    import random
    from collections import OrderedDict

    def replay(policy, seed: int) -> tuple[float, float]:
        rng = random.Random(seed)
        requests = [(s, u) for u in range(16) for s in range(8)]
        rng.shuffle(requests)
        ids = ["A", "B"]
        caches = {r: OrderedDict() for r in ids}
        load, running, hits, where = {r: 0 for r in ids}, [], 0, {}
        for s, u in requests:
            if len(running) == 8:
                load[running.pop(rng.randrange(8))] -= 1
            keys = _system_keys(s, u)
            r = policy.rank(keys, ids, load)[0]
            policy.routed(keys, r)
            load[r] += 1
            running.append(r)
            hits += s in caches[r]
            caches[r][s] = None
            caches[r].move_to_end(s)
            if len(caches[r]) > 4:
                caches[r].popitem(last=False)
            where.setdefault(s, []).append(r)
        sticky = sum(max(w.count(r) for r in ids) for w in where.values()) / len(requests)
        return hits / len(requests), sticky

    for seed in range(4):
        prefix, sticky = replay(PrefixPolicy(), seed)
        rr, _ = replay(RoundRobin(), seed)
        assert sticky >= 0.9 and prefix >= 0.75, (seed, prefix, sticky)
        assert rr <= 0.55, (seed, rr)


# ---- the command line ---------------------------------------------------------------------
def _qserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qserve", *args], capture_output=True,
                          text=True, timeout=120)


def test_serve_without_replicas_never_imports_ray():
    code = ("import sys\n"
            "from qserve import cli\n"
            "from qserve.server import api, router\n"
            "assert not any(m == 'ray' or m.startswith('ray.') for m in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-1500:]
    r = _qserve("serve", "--ray-address", "auto")
    assert r.returncode == 2 and r.stderr.startswith("error: --ray-address"), r.stderr


def test_single_process_serve_builds_its_server_without_ray(default_model_path):
    """`qserve serve` without --replicas, through the CLI up to the uvicorn server with the
    default model's engine and app built (not run): Ray is still not imported."""
    code = ("import sys\n"
            "from qserve import cli\n"
            "from qserve.server import api\n"
            "built = []\n"
            "api.serve = lambda *a, sock: built.append((api.make_server(*a),\n"
            "                                           sock.getsockname()[1]))\n"
            "try:\n"
            "    cli.main(['serve', '--port', '0', '--kv-cache-memory', '16MiB',\n"
            "              '--max-model-len', '256'])\n"
            "except SystemExit as e:  # the CLI always exits\n"
            "    assert e.code == 0, e.code\n"
            "assert len(built) == 1 and built[0][0].config.app is not None\n"
            "assert built[0][1] > 0  # bound before the load: port 0 became a free port\n"
            "ray = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
            "assert not ray, ray[:5]\n"
            "print('checked')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout == "checked\n", r.stderr[-1500:]


def test_cluster_flags_are_checked_before_anything_starts():
    _ray()
    from qserve.errors import ConfigError
    from qserve.server.cluster import ClusterConfig

    for bad, says in [(dict(replicas=0), "--replicas=0"),
                      (dict(replicas=2, min_replicas=1), "together"),
                      (dict(replicas=5, min_replicas=1, max_replicas=4), "<= --max-replicas"),
                      (dict(replicas=2, target_ongoing_requests=4), "needs --min-replicas"),
                      (dict(replicas=2, routing="random"), "--routing"),
                      # (10**20 had been a ValueError traceback from Serve's protobuf; a NaN
                      # CPU count had reached Ray)
                      (dict(replicas=10**20), "--replicas=100000000000000000000 is more than "
                                              "Ray Serve takes (2,147,483,647)"),
                      (dict(replicas=2, replica_cpus=float("nan")),
                       "--replica-cpus=nan and --replica-gpus=0.0 must be finite and >= 0")]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            ClusterConfig(**bad)
    auto = ClusterConfig(replicas=2, min_replicas=1, max_replicas=4, target_ongoing_requests=8)
    assert auto.scaling_options() == {"autoscaling_config": {
        "min_replicas": 1, "max_replicas": 4, "initial_replicas": 2,
        "target_ongoing_requests": 8}}
    assert ClusterConfig(replicas=3).scaling_options() == {"num_replicas": 3}
    assert ClusterConfig(replica_gpus=1).device("auto") == "cuda"
    assert ClusterConfig().device("auto") == "cpu"
    r = _qserve("serve", "--replicas", "2", "--min-replicas", "3", "--max-replicas", "4")
    assert r.returncode == 2 and r.stderr.startswith("error: autoscaling needs"), r.stderr


def test_replicas_that_cannot_fit_this_machine_are_refused():
    """A local Ray cluster is this machine: replicas it cannot place would have kept Serve
    waiting forever (a warning every 30 s); a joined cluster (--ray-address) may grow."""
    _ray()
    from qserve.errors import ConfigError
    from qserve.server.cluster import ClusterConfig, _check_local_resources

    have = {"CPU": 2.0, "memory": 1e10}
    _check_local_resources(ClusterConfig(replicas=2, replica_cpus=1), have)
    with pytest.raises(ConfigError, match=r"^--replicas 5 x --replica-cpus 1 needs 5 CPUs; this "
                                          r"machine's Ray cluster has 2\. Ask for fewer"):
        _check_local_resources(ClusterConfig(replicas=5, replica_cpus=1), have)
    with pytest.raises(ConfigError, match=r"--replica-gpus 0\.5 needs 1 GPUs; this machine's "
                                          r"Ray cluster has 0\."):
        _check_local_resources(ClusterConfig(replicas=2, replica_gpus=0.5), have)


def test_cli_flags_become_the_replicas_ray_placement_and_autoscaling(monkeypatch):
    """serve --replicas' flags, through the CLI, reach the Serve deployment's options: Ray's
    num_cpus / num_gpus per replica, the autoscaling bounds and target, and --max-num-seqs
    as the replica's max_ongoing_requests (nothing is deployed)."""
    _ray()
    from click.testing import CliRunner

    from qserve import cli
    from qserve.server import cluster as C

    built = []
    monkeypatch.setattr(C, "run", lambda *a: built.append(C.build(*a)))
    r = CliRunner().invoke(cli.main, [
        "serve", "--replicas", "2", "--replica-cpus", "3", "--replica-gpus", "0.5",
        "--min-replicas", "1", "--max-replicas", "4", "--target-ongoing-requests", "6",
        "--max-num-seqs", "12"])
    assert r.exit_code == 0 and len(built) == 1, r.output
    ingress = built[0]._bound_deployment  # Ray's Application keeps its deployment privately
    replica = ingress.init_args[0]._bound_deployment
    assert ingress.ray_actor_options == {"num_cpus": 0} and ingress.num_replicas == 1
    assert replica.ray_actor_options == {"num_cpus": 3, "num_gpus": 0.5}
    assert replica.max_ongoing_requests == 12
    auto = replica._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.initial_replicas, auto.max_replicas,
            auto.target_ongoing_requests) == (1, 2, 4, 6)
    assert replica.init_args[1]["device"] == "cuda"  # --device auto with a GPU of its own


def test_metrics_aggregate_per_replica_and_summed():
    _ray()
    from qserve.server.cluster import aggregate_metrics

    def text(blocks: int, rate: float) -> str:
        return (f"# HELP qserve_kv_blocks_total KV blocks.\n# TYPE qserve_kv_blocks_total gauge\n"
                f"qserve_kv_blocks_total {blocks}\n"
                f"# HELP qserve_spec_acceptance_rate r.\n"
                f"# TYPE qserve_spec_acceptance_rate gauge\nqserve_spec_acceptance_rate {rate}\n")
    out = aggregate_metrics({"a": text(10, 0.5), "b": text(32, 0.25)}).decode()
    blocks = _samples(out, "qserve_kv_blocks_total")
    assert blocks == {'replica="a"': 10, 'replica="b"': 32, "": 42}
    assert set(_samples(out, "qserve_spec_acceptance_rate")) == {'replica="a"', 'replica="b"'}


# ---- a local Ray cluster ------------------------------------------------------------------
def _ray():
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'qserve[cluster]')")
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install "
                                            "'qserve[cluster]')")
    import ray
    from ray import serve

    return ray, serve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(default_model_path):
    ray, serve = _ray()
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    from qserve.server import cluster as C
    from qserve.server.config import ServerConfig

    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    port = _free_port()
    try:
        engine = dict(kv_cache_memory="128MiB", max_model_len=512, max_num_seqs=8,
                      device="cpu")
        C.deploy(C.ClusterConfig(replicas=2, replica_cpus=1, max_ongoing_requests=16),
                 None, engine, MODEL, ServerConfig(port=port))
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(httpx, url, 2, deadline_s=240)
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                 timeout=120), httpx
    finally:
        serve.shutdown()
        ray.shutdown()


def _wait_healthy(httpx, url: str, n: int, deadline_s: float, not_ids=()) -> dict:
    deadline = time.monotonic() + deadline_s
    body = None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/health", timeout=15)
            body = r.json()
            if (body.get("healthy_replicas") == n
                    and not set(body["replicas"]) & set(not_ids)):
                return body
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    pytest.fail(f"the deployment did not reach {n} healthy replicas: {body}")


def _chat(client, system: str, user: str, max_tokens: int, **extra):
    """Stream one chat completion; (replica id, text, finish reason)."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, stream=True, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        **extra)
    replica = raw.headers["x-qserve-replica"]
    text, reason = [], None
    for chunk in raw.parse():
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            reason = choice.finish_reason or reason
    return replica, "".join(text), reason


@pytest.mark.slow
def test_openai_client_streams_and_16_concurrent_clients(cluster):
    url, client, httpx = cluster
    # one prompt per system prompt first, so each has a replica; the same prefix then
    # sticks to it while that replica is not overloaded
    owner = {s: _chat(client, s, "Hello!", 4)[0] for s in SYSTEMS}
    assert len(set(owner.values())) == 2, owner  # new prefixes spread over idle replicas
    assert {s: _chat(client, s, "Hello again!", 4)[0] for s in SYSTEMS} == owner

    results, errors = [None] * 16, []

    def run(i: int) -> None:
        try:
            results[i] = _chat(client, SYSTEMS[i % 4], f"Question number {i}: why?", 8)
        except Exception as e:  # reported below with its index
            errors.append((i, repr(e)))
    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert all(r is not None and r[1] and r[2] in ("length", "stop") for r in results), results
    assert {r[0] for r in results} == set(owner.values())

    metrics = httpx.get(url + "/metrics", timeout=30).text
    hits = _samples(metrics, "qserve_prefix_cache_hit_blocks_total")
    assert hits[""] == sum(v for k, v in hits.items() if k) and hits[""] > 0, hits
    finished = _samples(metrics, "qserve_requests_finished_total")
    assert sum(v for k, v in finished.items() if "replica" not in k) >= 24


def _samples(text: str, name: str) -> dict[str, float]:
    """Sample labels (as written) -> value, for one metric name."""
    return {m[1] or "": float(m[2]) for m in re.finditer(
        rf"^{name}(?:\{{(.*)\}})? ([\d.e+-]+)$", text, re.M)}


@pytest.mark.slow
def test_per_replica_health_and_metrics(cluster):
    url, _, httpx = cluster
    replicas = httpx.get(url + "/replicas", timeout=30).json()["replicas"]
    assert len(replicas) == 2 and all(r["status"] == "ok" and r["pid"] > 0 for r in replicas)
    for r in replicas:
        assert httpx.get(f"{url}/replicas/{r['replica']}/health", timeout=30).json() == {
            "status": "ok"}
        own = httpx.get(f"{url}/replicas/{r['replica']}/metrics", timeout=30)
        assert own.status_code == 200 and "qserve_kv_blocks_total " in own.text
    gone = httpx.get(url + "/replicas/nosuchid/health", timeout=30)
    assert gone.status_code == 404 and "nosuchid" in gone.json()["error"]["message"]
    blocks = _samples(httpx.get(url + "/metrics", timeout=30).text, "qserve_kv_blocks_total")
    per_replica = [v for k, v in blocks.items() if k]
    assert len(per_replica) == 2 and blocks[""] == sum(per_replica)


@pytest.mark.slow
def test_a_killed_replica_loses_only_its_own_requests_and_is_replaced(cluster):
    url, client, httpx = cluster
    import openai

    before = _wait_healthy(httpx, url, 2, deadline_s=60)
    pids = {r["replica"]: r["pid"]
            for r in httpx.get(url + "/replicas", timeout=30).json()["replicas"]}
    victim = sorted(pids)[0]

    outcomes: list = [None] * 16
    started = threading.Event()  # a stream on the victim has its first chunk

    def run(i: int) -> None:
        # the last 4 (one per system prompt, so some on the victim) do not stream: the
        # victim dies before they answer anything, and they are sent to the other replica
        stream = i < 12
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, stream=stream, max_tokens=48, temperature=0,
                extra_body={"ignore_eos": True},
                messages=[{"role": "system", "content": SYSTEMS[i % 4]},
                          {"role": "user", "content": f"Tell me a long story, {i}."}])
            replica = raw.headers["x-qserve-replica"]
            reason = None
            for chunk in raw.parse() if stream else [raw.parse()]:
                if stream and replica == victim:
                    started.set()
                reason = next((c.finish_reason for c in chunk.choices if c.finish_reason),
                              reason)
            outcomes[i] = ("ok", replica, reason)
        except openai.APIStatusError as e:  # failed before the stream started
            outcomes[i] = ("error", e.response.headers.get("x-qserve-replica"),
                           e.status_code, e.message)
        except openai.APIError as e:  # an error event inside the stream
            outcomes[i] = ("error", replica, 503 if "replica_unavailable" in str(e.body)
                           else None, e.message)
        except Exception as e:  # anything else is a bug; reported by the asserts
            outcomes[i] = ("crash", None, None, repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    assert started.wait(180), "no stream on the victim replica started"
    os.kill(pids[victim], signal.SIGKILL)
    for t in threads:
        t.join(timeout=300)
    assert all(o is not None for o in outcomes), outcomes
    assert not [o for o in outcomes if o[0] == "crash"], outcomes
    # every request that went to the surviving replica finished all its tokens
    survivors = [o for o in outcomes if o[1] != victim]
    assert survivors and all(o[0] == "ok" and o[2] == "length" for o in survivors), outcomes
    # the victim's streams in flight ended with a clean 503, naming it
    lost = [o for o in outcomes if o[0] == "error"]
    assert lost and all(o[1] == victim and o[2] == 503 for o in lost), outcomes
    # the ones not streaming had answered nothing when the victim died: each is sent once
    # more, to the other replica, and finishes
    assert all(o[0] == "ok" and o[1] != victim and o[2] == "length"
               for o in outcomes[12:]), outcomes

    # Ray replaces it; the deployment serves on two replicas again
    after = _wait_healthy(httpx, url, 2, deadline_s=240, not_ids=[victim])
    assert victim in before["replicas"] and victim not in after["replicas"]
    assert {_chat(client, s, "Back again?", 4)[0] for s in SYSTEMS} <= set(after["replicas"])
