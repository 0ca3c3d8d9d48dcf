"""`qserve serve --replicas N`: the same OpenAI-compatible app as N Ray Serve replicas.

Imported only with --replicas: Ray is the optional extra `pip install 'qserve[cluster]'`.

    client ──HTTP──> Serve proxy ──> QServeIngress (1 replica, 0 CPUs)
                                       │ reads the body, keys it by its prompt prefix
                                       │ (router.py), forwards it through a handle
                                       v
                     QServeRouter (Ray Serve request router, inside the ingress process)
                                       │ the home replica of the longest known prefix,
                                       │ unless it is too busy (router.py)
                        ┌──────────────┴──────────────┐
                        v                             v
                 QServeReplica 0                QServeReplica 1 ...    (--replica-cpus/-gpus)
                 one LLMEngine, its own KV pool and device, running the single-process
                 app (api.py) behind a small in-process ASGI bridge

A replica runs the same ASGI app as `qserve serve` without --replicas (RequestGuard, auth,
validation, SSE), so answers are byte for byte what one process would send; the ingress copies
the status, headers and body chunks back and adds `x-qserve-replica: <id>`.

Routing: see router.py for the policy. The router counts the requests it has in flight per
replica (its "load"); a replica chosen first but at its `max_ongoing_requests` is skipped for
the next in the ranking. With one ingress replica (the default) those counts are exact.

Health and metrics:
    GET /health                      ok while at least one replica is healthy; lists them
    GET /metrics                     every replica's series labelled replica="<id>", and their
                                     sum (unlabelled) for the additive ones
    GET /replicas                    id, pid, node and engine stats of each replica
    GET /replicas/<id>/health        one replica's own /health
    GET /replicas/<id>/metrics       one replica's own /metrics
Ray Serve calls each replica's `check_health`; a replica whose engine thread died, or whose
process died, is replaced. Requests in flight on a dead replica end with a 503
(`replica_unavailable`): a JSON error before the response started, an SSE error event after.
A request whose replica died before it answered anything is sent once more to another one.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass, field

import ray
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from qserve.errors import ConfigError, QServeError
from qserve.server import protocol as P
from qserve.server.config import ServerConfig
from qserve.server.guard import RequestGuard
from qserve.server.metrics import CONTENT_TYPE
from qserve.server.router import PrefixPolicy, RoundRobin, prefix_keys, routing_text

log = logging.getLogger("qserve.server")

APP_NAME = "qserve"
REPLICA_DEPLOYMENT = "QServeReplica"
REPLICA_HEADER = "x-qserve-replica"
ROUTING = ("prefix", "round-robin")
MAX_REPLICAS = 2**31 - 1  # Ray Serve keeps replica counts as int32
_DEAD = (RayActorError, ActorUnavailableError)
ASK_TIMEOUT_S = 10.0  # a replica that does not answer /health or /metrics in this is unavailable


@dataclass
class ClusterConfig:
    """How `qserve serve --replicas` places and scales its replicas (CLI flags map 1:1)."""
    replicas: int = 2
    ray_address: str | None = None  # None: start a local Ray cluster
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    min_replicas: int | None = None  # with max_replicas: Serve autoscales between them
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None  # autoscaling target per replica
    routing: str = "prefix"
    max_imbalance: int = 8  # see router.rank
    max_ongoing_requests: int = 256  # per replica; beyond it the router tries the next one

    def __post_init__(self):
        for flag, n in (("--replicas", self.replicas), ("--max-replicas", self.max_replicas)):
            if n is not None and n > MAX_REPLICAS:  # Serve's config holds an int32
                raise ConfigError(f"{flag}={n} is more than Ray Serve takes ({MAX_REPLICAS:,})")
        if self.replicas < 1:
            raise ConfigError(f"--replicas={self.replicas} must be at least 1")
        if not (0 <= self.replica_cpus < math.inf and 0 <= self.replica_gpus < math.inf):
            raise ConfigError(f"--replica-cpus={self.replica_cpus} and --replica-gpus="
                              f"{self.replica_gpus} must be finite and >= 0")
        if self.routing not in ROUTING:
            raise ConfigError(f"--routing={self.routing!r}: give one of {', '.join(ROUTING)}")
        scaling = (self.min_replicas, self.max_replicas)
        if (None in scaling) != (scaling == (None, None)):
            raise ConfigError("give --min-replicas and --max-replicas together (autoscaling), "
                              "or neither")
        if self.min_replicas is not None:
            if not 0 <= self.min_replicas <= self.replicas <= self.max_replicas:
                raise ConfigError(f"autoscaling needs 0 <= --min-replicas ({self.min_replicas})"
                                  f" <= --replicas ({self.replicas}) <= --max-replicas "
                                  f"({self.max_replicas})")
        elif self.target_ongoing_requests is not None:
            raise ConfigError("--target-ongoing-requests needs --min-replicas and "
                              "--max-replicas (it is an autoscaling target)")
        if self.target_ongoing_requests is not None and not self.target_ongoing_requests > 0:
            raise ConfigError(f"--target-ongoing-requests={self.target_ongoing_requests} must "
                              f"be > 0")

    def scaling_options(self) -> dict:
        """Serve deployment options: a fixed replica count, or autoscaling from `replicas`."""
        if self.min_replicas is None:
            return {"num_replicas": self.replicas}
        auto = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": self.replicas}
        if self.target_ongoing_requests is not None:
            auto["target_ongoing_requests"] = self.target_ongoing_requests
        return {"autoscaling_config": auto}

    def device(self, engine_device: str) -> str:
        """--device auto means the replica's own GPU when it has one, else the CPU."""
        if engine_device != "auto":
            return engine_device
        return "cuda" if self.replica_gpus > 0 else "cpu"


@dataclass
class Forwarded:
    """One HTTP request, as the ingress hands it to a replica."""
    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    keys: list[bytes] = field(default_factory=list)  # prefix keys (router.prefix_keys)
    target: str | None = None  # a replica id: only that replica (per-replica routes)
    # set by the router in the ingress process, not sent: where this request went
    routed_to: str | None = field(default=None, compare=False)

    def __getstate__(self):
        return {**self.__dict__, "routed_to": None, "keys": []}


# ---- routing -------------------------------------------------------------------------------
# The routers of this process, by deployment name: the ingress asks its router which replicas
# exist (for /health, /metrics, /replicas).
_ROUTERS: dict[str, "QServeRouter"] = {}


class QServeRouter(RequestRouter):
    """Ray Serve request router for QServeReplica: router.py's policy over Serve's replicas.

    `choose_replicas` returns one replica per rank, in the order to try them; Serve takes the
    first whose queue is not full. `on_request_routed` records where each request went.
    """

    def initialize_state(self, routing: str = "prefix", max_imbalance: int = 8,
                         min_match: float = 0.5, table_capacity: int = 1 << 16, **_):
        self.policy = (PrefixPolicy(max_imbalance, min_match, table_capacity)
                       if routing == "prefix" else RoundRobin())
        self.ongoing: dict[str, int] = {}  # replica id -> requests this router has in flight
        _registry()[self._deployment_id.name] = self

    def replica_ids(self) -> list[str]:
        return sorted(r.unique_id for r in self.curr_replicas)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # no busy loop when all full
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        fwd = _forwarded(pending_request)
        if fwd is None:
            return [candidate_replicas]
        if fwd.target is not None:
            # gone: any replica answers, and the ingress sees it is not the one asked for
            return [[by_id[fwd.target]]] if fwd.target in by_id else [candidate_replicas]
        order = self.policy.rank(fwd.keys, sorted(by_id), self.ongoing)
        return [[by_id[i]] for i in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        rid = replica_id.unique_id
        self.ongoing[rid] = self.ongoing.get(rid, 0) + 1
        fwd = _forwarded(pending_request)
        if fwd is not None:
            fwd.routed_to = rid
            if fwd.target is None:
                self.policy.routed(fwd.keys, rid)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = replica_id.unique_id
        if self.ongoing.get(rid, 0) > 0:
            self.ongoing[rid] -= 1

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {r.replica_id.unique_id for r in replicas}
        for rid in [r for r in self.ongoing if r not in alive]:
            del self.ongoing[rid]
            self.policy.forget(rid)


def _registry() -> dict[str, "QServeRouter"]:
    """_ROUTERS of the imported module: Serve may pickle the router and ingress classes by
    value, each with its own copy of this module's globals."""
    import qserve.server.cluster as module

    return module._ROUTERS


def _forwarded(pending_request: PendingRequest | None) -> Forwarded | None:
    if pending_request is None or not pending_request.args:
        return None
    arg = pending_request.args[0]
    # by name, not isinstance: the ingress may hold a by-value copy of the class (_registry)
    return arg if type(arg).__name__ == "Forwarded" else None


# ---- a replica -----------------------------------------------------------------------------
class QServeReplica:
    """One qserve engine and its app; `handle` runs one forwarded request through the app and
    yields ("start", status, headers), then the body's chunks."""

    def __init__(self, model: str | None, engine: dict, model_name: str,
                 server: ServerConfig):
        from qserve.config import engine_config
        from qserve.llm import make_engine
        from qserve.server.api import build_app
        from qserve.server.async_engine import AsyncEngine, EngineThread
        from qserve.server.metrics import Metrics

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        metrics = Metrics()
        thread = EngineThread()  # loads the engine and steps it: one OpenMP thread pool
        config = engine_config(model, **engine)
        self.engine = AsyncEngine(thread.call(lambda: make_engine(config)),
                                  on_finished=metrics.observe, on_aborted=metrics.observe_abort,
                                  thread=thread)
        metrics.watch(self.engine)
        self.app = build_app(self.engine, model_name, metrics, server)
        self.engine.start()  # the app's lifespan is not run here: the replica owns the engine

    def check_health(self) -> None:
        """Serve replaces the replica when this raises."""
        if not self.engine.alive:
            raise RuntimeError(f"replica {self.replica_id}: the engine thread stopped")

    def info(self) -> dict:
        return {"replica": self.replica_id, "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id(),
                "status": "ok" if self.engine.alive else "engine stopped",
                "stats": self.engine.stats}

    async def handle(self, fwd: Forwarded):
        if fwd.path == "/_replica":  # the ingress's /replicas
            body = json.dumps(self.info()).encode()
            yield ("start", 200, [(b"content-type", b"application/json"),
                                  (REPLICA_HEADER.encode(), self.replica_id.encode())])
            yield body
            return
        async for item in _run_asgi(self.app, fwd, self.replica_id):
            yield item

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


async def _run_asgi(app, fwd: Forwarded, replica_id: str):
    """Drive the ASGI `app` with one request. When the caller stops iterating (its client went
    away), the app's receive() says http.disconnect, so a stream is aborted as in one process."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": fwd.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        messages.put_nowait(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": fwd.method, "scheme": "http", "path": fwd.path,
             "raw_path": fwd.path.encode(), "root_path": "", "query_string": fwd.query,
             "headers": fwd.headers, "client": ("127.0.0.1", 0), "server": None}
    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
                yield ("start", message["status"],
                       headers + [(REPLICA_HEADER.encode(), replica_id.encode())])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
    finally:
        gone.set()
        await asyncio.wait({task}, timeout=10)


# ---- the ingress ---------------------------------------------------------------------------
class QServeIngress:
    """The HTTP entry point: forwards /v1 to a replica chosen by QServeRouter; answers /health,
    /metrics and /replicas itself from every replica's."""

    def __init__(self, replicas, server: ServerConfig):
        self.replicas = replicas.options(stream=True, method_name="handle")
        self.server = server

    def __serve_build_asgi_app__(self):
        async def api_error(request, e: P.APIError):
            return JSONResponse(e.body(), status_code=e.status)

        app = Starlette(exception_handlers={P.APIError: api_error}, routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/replicas", self.list_replicas, methods=["GET"]),
            Route("/replicas/{rid}/{what:path}", self.one_replica, methods=["GET"]),
            Route("/{path:path}", self.forward,
                  methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]),
        ])
        return RequestGuard(app, self.server)

    # ---- forwarding ----------------------------------------------------------------------
    async def forward(self, request: Request) -> Response:
        body = await request.body()
        text = routing_text(request.url.path, body)
        fwd = Forwarded(request.method, request.url.path, request.scope.get("query_string", b""),
                        list(request.scope["headers"]), body,
                        prefix_keys(text) if text else [])
        return await self._send(fwd)

    async def _send(self, fwd: Forwarded, retry: bool = True) -> Response:
        gen = self.replicas.remote(fwd)
        try:
            _, status, headers = await gen.__anext__()
        except _DEAD as e:
            gen.cancel()
            if retry:  # it died before answering: no output was lost, try another replica
                log.warning("replica %s died before answering; retrying: %s", fwd.routed_to, e)
                fwd.routed_to = None
                return await self._send(fwd, retry=False)
            return _unavailable(fwd.routed_to)
        stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                     for k, v in headers)
        response = StreamingResponse(_relay(gen, fwd, stream), status_code=status)
        response.raw_headers = [(k, v) for k, v in headers]
        return response

    async def _ask(self, rid: str | None, path: str, request: Request) -> tuple[int, bytes, str]:
        """GET `path` on replica `rid`; (status, body, the id that answered)."""
        fwd = Forwarded("GET", path, b"", list(request.scope["headers"]), b"", target=rid)
        gen = self.replicas.remote(fwd)

        async def read() -> tuple[int, bytes]:
            _, status, _ = await gen.__anext__()
            return status, b"".join([chunk async for chunk in gen])
        try:
            status, body = await asyncio.wait_for(read(), ASK_TIMEOUT_S)
        except (*_DEAD, asyncio.TimeoutError):
            gen.cancel()
            return 503, b"", rid or ""
        return status, body, fwd.routed_to or ""

    async def _ask_each(self, ids: list[str], path: str, request: Request) -> list[tuple]:
        # one after another: Serve's router pairs a routed replica with its pending request by
        # the HTTP request's id, which concurrent handle calls from one request share
        return [await self._ask(rid, path, request) for rid in ids]

    async def _replica_ids(self, request: Request) -> list[str]:
        routers = _registry()
        router = routers.get(REPLICA_DEPLOYMENT)
        if router is None:  # the handle makes its router at its first request
            await self._ask(None, "/_replica", request)
            router = routers.get(REPLICA_DEPLOYMENT)
            for _ in range(40):  # and learns the replicas a moment later
                if router is None or router.replica_ids():
                    break
                await asyncio.sleep(0.05)
        return router.replica_ids() if router is not None else []

    # ---- health and metrics --------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        ids = await self._replica_ids(request)
        answers = await self._ask_each(ids, "/health", request)
        replicas = {rid: ("ok" if status == 200 else f"unavailable ({status})")
                    for rid, (status, _, _) in zip(ids, answers)}
        healthy = sum(v == "ok" for v in replicas.values())
        return JSONResponse({"status": "ok" if healthy else "no healthy replica",
                             "healthy_replicas": healthy, "replicas": replicas},
                            status_code=200 if healthy else 503)

    async def list_replicas(self, request: Request) -> Response:
        self._require_key(request)
        ids = await self._replica_ids(request)
        answers = await self._ask_each(ids, "/_replica", request)
        return JSONResponse({"replicas": [json.loads(body) if status == 200 else
                                          {"replica": rid, "status": "unavailable"}
                                          for rid, (status, body, _) in zip(ids, answers)]})

    async def one_replica(self, request: Request) -> Response:
        rid, what = request.path_params["rid"], request.path_params["what"]
        if what not in ("health", "metrics"):
            raise P.APIError(404, f"no route GET {request.url.path}; per replica there are "
                                  f"/replicas/<id>/health and /replicas/<id>/metrics",
                             code="not_found")
        status, body, answered = await self._ask(rid, "/" + what, request)
        if answered != rid:
            return JSONResponse(P.APIError(404, f"there is no replica {rid!r} (see /replicas)",
                                           code="not_found").body(), status_code=404)
        media = CONTENT_TYPE if what == "metrics" and status == 200 else "application/json"
        return Response(body, status_code=status, media_type=media)

    async def metrics(self, request: Request) -> Response:
        self._require_key(request)
        ids = await self._replica_ids(request)
        answers = await self._ask_each(ids, "/metrics", request)
        texts = {rid: body.decode() for rid, (status, body, _) in zip(ids, answers)
                 if status == 200}
        return Response(aggregate_metrics(texts), media_type=CONTENT_TYPE)

    def _require_key(self, request: Request) -> None:
        key = self.server.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
            raise P.APIError(401, "the request carries no or a wrong API key (Authorization: "
                                  "Bearer KEY)", code="invalid_api_key")


async def _relay(gen, fwd: Forwarded, stream: bool):
    try:
        async for chunk in gen:
            yield chunk
    except _DEAD:
        if stream:
            error = _unavailable(fwd.routed_to).body
            yield b"data: " + error + b"\n\n"


def _unavailable(rid: str | None) -> JSONResponse:
    e = P.APIError(503, f"replica {rid} stopped while running this request; Ray Serve "
                        f"replaces it, so retry", "server_error", code="replica_unavailable")
    return JSONResponse(e.body(), status_code=503,
                        headers={REPLICA_HEADER: rid} if rid else None)


_NOT_ADDITIVE = ("qserve_spec_acceptance_rate", "qserve_spec_mean_accepted_tokens")


def aggregate_metrics(texts: dict[str, str]) -> bytes:
    """Prometheus text for replica id -> that replica's /metrics: each series once per replica
    with replica="<id>", then the sum over replicas without the label (not for ratios)."""
    families: dict[str, Metric] = {}
    sums: dict[str, dict[tuple, float]] = {}
    for rid, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            if fam.name.endswith("_created"):
                continue  # creation timestamps: neither per-replica news nor summable
            merged = families.setdefault(fam.name, Metric(fam.name, fam.documentation,
                                                          fam.type))
            total = sums.setdefault(fam.name, {})
            for s in fam.samples:
                merged.add_sample(s.name, {**s.labels, "replica": rid}, s.value)
                key = (s.name, tuple(sorted(s.labels.items())))
                total[key] = total.get(key, 0.0) + s.value
    for name, fam in families.items():
        if name not in _NOT_ADDITIVE:
            for (sample, labels), value in sums[name].items():
                fam.add_sample(sample, dict(labels), value)

    class _Collector:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry)


# ---- deploying -----------------------------------------------------------------------------
def build(cluster: ClusterConfig, model: str | None, engine: dict, model_name: str,
          server: ServerConfig):
    """The Serve application: the ingress bound to `cluster.replicas` QServeReplicas."""
    engine = {**engine, "device": cluster.device(engine.get("device", "auto"))}
    replica = serve.deployment(QServeReplica, name=REPLICA_DEPLOYMENT).options(
        ray_actor_options={"num_cpus": cluster.replica_cpus, "num_gpus": cluster.replica_gpus},
        max_ongoing_requests=cluster.max_ongoing_requests,
        health_check_period_s=5, health_check_timeout_s=30,
        request_router_config=RequestRouterConfig(
            request_router_class=QServeRouter,
            request_router_kwargs={"routing": cluster.routing,
                                   "max_imbalance": cluster.max_imbalance}),
        **cluster.scaling_options())
    ingress = serve.deployment(serve.ingress()(QServeIngress), name="QServeIngress").options(
        num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=4 * cluster.max_ongoing_requests * max(cluster.replicas,
                                                                     cluster.max_replicas or 0))
    return ingress.bind(replica.bind(model, engine, model_name, server), server)


def deploy(cluster: ClusterConfig, model: str | None, engine: dict, model_name: str,
           server: ServerConfig) -> None:
    """Start Serve's HTTP proxy on server.host:port and deploy (Ray must be initialized)."""
    serve.start(http_options={"host": server.host, "port": server.port})
    try:
        serve.run(build(cluster, model, engine, model_name, server), name=APP_NAME,
                  route_prefix="/")
    except RuntimeError as e:  # a replica's constructor failed: say why in one line
        raise QServeError(f"the replicas did not start: {_replica_error() or e}") from None


def _replica_error() -> str | None:
    """The qserve error a replica failed with, from Serve's status of the deployment."""
    try:
        status = serve.status().applications[APP_NAME].deployments[REPLICA_DEPLOYMENT]
    except (KeyError, AttributeError):
        return None
    found = re.findall(r"qserve\.errors\.\w+: (.+)", status.message or "")
    return found[-1].strip() if found else None


def _check_local_resources(cluster: ClusterConfig, have: dict) -> None:
    """The first replicas must fit the local Ray cluster this run started (this machine):
    Serve would otherwise wait for them forever, warning every 30 s."""
    for flag, each, kind in (("--replica-cpus", cluster.replica_cpus, "CPU"),
                             ("--replica-gpus", cluster.replica_gpus, "GPU")):
        need, free = cluster.replicas * each, have.get(kind, 0)
        if need > free:
            raise ConfigError(f"--replicas {cluster.replicas} x {flag} {each:g} needs "
                              f"{need:g} {kind}s; this machine's Ray cluster has {free:g}. "
                              f"Ask for fewer, or join a larger cluster with --ray-address")


def run(cluster: ClusterConfig, model: str | None, engine: dict, model_name: str,
        server: ServerConfig) -> None:
    """`qserve serve --replicas`: deploy, then serve until SIGINT or SIGTERM."""
    ray.init(address=cluster.ray_address)
    if cluster.ray_address is None:  # a cluster that may grow is left to schedule them
        try:
            _check_local_resources(cluster, ray.cluster_resources())
        except ConfigError:
            ray.shutdown()
            raise
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which sets its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        deploy(cluster, model, engine, model_name, server)
        print(f"qserve: {cluster.replicas} replica(s) of {model_name} on Ray Serve at "
              f"http://{server.host}:{server.port} (routing: {cluster.routing})",
              file=sys.stderr, flush=True)
        while not stop.wait(1.0):  # a timed wait, so the signal handler gets to run
            pass
    finally:
        serve.delete(APP_NAME)
        if cluster.ray_address is None:
            serve.shutdown()
        ray.shutdown()
