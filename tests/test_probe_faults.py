"""Regression tests for the faults a probe of qserve found (issue 17, "Why", items 2-12), one
or a few per fault, each failing on the code before its fix.

The server tests run the real app under uvicorn, in this process, over a FakeEngine: the
LLMEngine surface the AsyncEngine drives, generating one fixed token per step. They test what
happens around generation (admission, parsing, errors, shutdown, metrics), so they need no model
weights and take seconds; tests/test_server.py runs the real model behind a real process.
"""
from __future__ import annotations

import asyncio
import errno
import gc
import io
import json
import logging
import os
import signal
import socket
import threading
import time

import pytest

from qserve.errors import ConfigError, QServeError
from qserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

MODEL = "fake"


@pytest.fixture(scope="module")
def tokenizer():
    from qserve.loader import load_tokenizer

    return load_tokenizer(None)


class FakeEngine:
    """Each step, every request gains the token " the"; it finishes at max_tokens. Outputs
    hold that token alone where the request asks for deltas (as the server's do), else all."""

    def __init__(self, tokenizer, max_model_len: int = 4096):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.detokenize = True
        self.token = tokenizer.encode(" the", add_special_tokens=False)[0]
        self.requests: dict[str, tuple[list[int], object, list[int], float]] = {}

    def stats(self) -> dict:
        return {"running": len(self.requests), "kv_blocks_used": len(self.requests),
                "kv_blocks_total": 64}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, rid, prompt, params, prompt_token_ids):
        if any(not 0 <= t < 49152 for t in prompt_token_ids):
            raise QServeError("prompt token id outside the vocabulary")
        self.requests[rid] = (prompt_token_ids, params, [], time.monotonic())

    def abort(self, rid):
        self.requests.pop(rid, None)

    def finish_sample(self, rid, index):
        self.requests.pop(rid, None)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.005)
        outputs = []
        for rid, (ids, params, generated, arrival) in list(self.requests.items()):
            generated.append(self.token)
            done = len(generated) >= params.max_tokens
            new = generated[-1:] if params.output_kind == "delta" else generated
            outputs.append(RequestOutput(
                rid, None, ids, [CompletionOutput(i, "", list(new), "length" if done else None,
                                                  num_tokens=len(generated))
                                 for i in range(params.n)],
                done, RequestMetrics(arrival, first_token_time=arrival)))
            if done:
                del self.requests[rid]
        return outputs


class LiveServer:
    """qserve's server (make_server) on a free loopback port, run on a thread."""

    def __init__(self, tokenizer, **config):
        from qserve.server.api import make_server
        from qserve.server.config import ServerConfig

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.engine = FakeEngine(tokenizer)
        self.server = make_server(self.engine, MODEL, ServerConfig(
            port=port, log_level="warning", **config))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()

    def post(self, path: str, body, headers: dict | None = None) -> httpx.Response:
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return httpx.post(self.url + path, content=data, timeout=30,
                          headers={"Content-Type": "application/json", **(headers or {})})


@pytest.fixture(scope="module")
def server(tokenizer):
    srv = LiveServer(tokenizer)
    yield srv
    srv.stop()


def assert_openai_error(r: httpx.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code), error
    return error


def raw_exchange(port: int, requests: list[bytes]) -> list[bytes]:
    """Send HTTP/1.1 requests one after another on ONE connection; each response's head and
    body. A connection the server closed raises (the next send or read fails)."""
    replies = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        f = sock.makefile("rb")
        for req in requests:
            sock.sendall(req)
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                line = f.readline()
                assert line, "the server closed the connection"
                head += line
            length = int(next(h.split(b":")[1] for h in head.split(b"\r\n")
                              if h.lower().startswith(b"content-length:")))
            replies.append(head + f.read(length))
    return replies


def http_post(path: str, body: bytes, host: str = "127.0.0.1") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


# ---- 3: CSRF / DNS rebinding without a key; the key covers /metrics; no empty key ---------
@pytest.mark.parametrize("headers, code", [
    ({"Host": "evil.example"}, "host_not_allowed"),
    ({"Host": "rebound.attacker.test:8000"}, "host_not_allowed"),
    ({"Origin": "https://evil.example", "Content-Type": "text/plain"}, "origin_not_allowed"),
    ({"Origin": "null"}, "origin_not_allowed"),
])
def test_foreign_host_or_origin_is_refused_without_a_key(server, headers, code):
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1},
                    headers)
    assert_openai_error(r, 403, code=code)
    assert server.engine.requests == {}


@pytest.mark.parametrize("headers", [
    {}, {"Host": "localhost:1234"}, {"Host": "[::1]:8000"}, {"Host": "10.1.2.3:8000"},
    {"Origin": "http://localhost:3000"}, {"Origin": "http://127.0.0.1:8000"}])
def test_loopback_hosts_and_origins_are_served(server, headers):
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2},
                    headers)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_allowed_origins_get_cors(tokenizer):
    srv = LiveServer(tokenizer, allowed_origins=("https://app.example",))
    try:
        ok = srv.post("/v1/models", {}, {"Origin": "https://app.example"})
        r = httpx.get(srv.url + "/v1/models", headers={"Origin": "https://app.example"})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert ok.status_code == 405  # admitted: the route, not the guard, answers
        other = httpx.get(srv.url + "/v1/models", headers={"Origin": "https://evil.example"})
        assert_openai_error(other, 403, code="origin_not_allowed")
    finally:
        srv.stop()


def test_api_key_guards_metrics_and_must_not_be_empty(tokenizer):
    from qserve.server.config import ServerConfig

    for empty in ("", "  "):
        with pytest.raises(ConfigError, match="--api-key is empty"):
            ServerConfig(api_key=empty)
    srv = LiveServer(tokenizer, api_key="k")
    try:
        assert_openai_error(httpx.get(srv.url + "/metrics"), 401, code="invalid_api_key")
        bearer_empty = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer"})
        assert_openai_error(bearer_empty, 401, code="invalid_api_key")
        r = httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and "qserve_requests_running" in r.text
        # with a key, a foreign Host is fine: the key is what guards the server
        r = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer k",
                                                        "Host": "my.server.lan"})
        assert r.status_code == 200
    finally:
        srv.stop()


def test_empty_api_key_flag_is_a_one_line_error():
    from click.testing import CliRunner

    from qserve import cli

    result = CliRunner().invoke(cli.main, ["serve", "--api-key", ""])
    assert result.exit_code == 2
    assert result.output.strip().startswith("error: --api-key is empty")
    assert len(result.output.strip().splitlines()) == 1


# ---- 4: a body-size limit before parsing; tokenizing does not stall the event loop --------
def test_oversized_body_is_413_before_it_is_read(tokenizer):
    srv = LiveServer(tokenizer, max_request_bytes=64 << 10)
    try:
        body = json.dumps({"model": MODEL, "prompt": "x" * (100 << 10)}).encode()
        assert_openai_error(srv.post("/v1/completions", body), 413, code="request_too_large")

        def chunks():  # no Content-Length: counted as it arrives
            for i in range(0, len(body), 8192):
                yield body[i:i + 8192]
        r = httpx.post(srv.url + "/v1/completions", content=chunks(), timeout=30,
                       headers={"Content-Type": "application/json"})
        assert_openai_error(r, 413, code="request_too_large")
        small = srv.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert small.status_code == 200, small.text
    finally:
        srv.stop()


def test_a_huge_prompt_does_not_stall_health(server):
    """~2 MB of text takes the tokenizer about a second on this box; the event loop must keep
    answering meanwhile (the tokenizer holds the GIL in encode, not in encode_batch)."""
    prompt = "word " * 400_000
    result = {}

    def big():
        start = time.monotonic()
        result["r"] = server.post("/v1/completions", {"model": MODEL, "prompt": prompt})
        result["s"] = time.monotonic() - start
    # The server runs in this process: late in a full run, a full collection of the suite's
    # own live objects holds the GIL ~0.45 s on a 2-core box (6M objects: 0.45 s), which is
    # what /health took in the runs that failed. Frozen out of the collector for the window,
    # they leave the tokenizer, which this test is about.
    gc.collect()
    gc.freeze()
    try:
        thread = threading.Thread(target=big)
        thread.start()
        time.sleep(0.1)  # the body is sent and parsed; tokenizing now
        worst = 0.0
        while thread.is_alive():
            start = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            worst = max(worst, time.monotonic() - start)
            time.sleep(0.02)
        thread.join()
    finally:
        gc.unfreeze()
    assert_openai_error(result["r"], 400, "prompt", "context_length_exceeded")
    assert result["s"] > 0.5, "the prompt tokenized too fast to tell anything"
    assert worst < min(0.25, result["s"] / 3), (worst, result["s"])


# ---- 5: what used to be a 500 with a plain-text body is a 400, and the connection lives ----
@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"model": "fake", "prompt": "hi", "max_tokens": 2, "min_tokens": 5}',
     "min_tokens"),
    ("/v1/completions", b'{"model": "fake", "prompt": "hi", "min_tokens": 5000}', "min_tokens"),
    ("/v1/completions", b'{"model": "fake", "prompt": "a\\ud800b"}', None),
    ("/v1/chat/completions",
     b'{"model": "fake", "messages": [{"role": "user", "content": "\\udfff"}]}', None),
    ("/v1/completions", b'{"a": ' + b"[" * 2000 + b"]" * 2000 + b"}", None),
])
def test_former_500s_are_400s_on_a_live_connection(server, path, body, param):
    ok = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    bad, good = raw_exchange(server.port, [http_post(path, body),
                                           http_post("/v1/completions", ok)])
    head, _, payload = bad.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), bad
    error = json.loads(payload)["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert good.startswith(b"HTTP/1.1 200 "), good


def test_paired_surrogates_are_text(server):
    r = server.post("/v1/completions", b'{"model": "fake", "prompt": "\\ud83d\\ude00",'
                                       b' "max_tokens": 1, "echo": true}')
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("\U0001F600")


def test_unexpected_errors_are_500s_in_openai_shape_on_a_live_connection(server, monkeypatch):
    def broken(*args):
        raise RuntimeError("a bug")
    monkeypatch.setattr("qserve.server.protocol.fit_to_context", broken)
    ok = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    bad, good = raw_exchange(server.port, [http_post("/v1/completions", ok)] * 2)
    head, _, payload = bad.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 500 ") and json.loads(payload)["error"]["type"] == (
        "server_error")
    assert good.startswith(b"HTTP/1.1 500 ")  # answered on the same connection


# ---- 9: wrong or misleading results --------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("temperature", 1e-300), ("repetition_penalty", 1e-308), ("repetition_penalty", 1e308)])
def test_extreme_sampling_values_cannot_overflow(field, value):
    import torch

    from qserve.engine.sampler import Sampler, SamplingRow
    from qserve.sampling_params import SamplingParams

    try:
        params = SamplingParams(**{field: value})
    except QServeError as e:
        assert e.param == field and "\n" not in str(e)
        return
    logits = torch.tensor([[1.0, -2.0, 5.0, 3.0]])  # nan probabilities would pick id 0
    row = SamplingRow(params, [1, 3], [])
    assert Sampler()(logits, [row]).token_ids == [2]


def test_extreme_sampling_values_over_http(server):
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                        "temperature": 1e-300})
    assert r.status_code == 200, r.text
    for value in (1e-308, 1e308, "NaN"):
        body = '{"model": "fake", "prompt": "hi", "repetition_penalty": %s}' % value
        assert_openai_error(server.post("/v1/completions", body), 400, "repetition_penalty")


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty",
                                   "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", ["1" + "0" * 400, "NaN", "-Infinity", "1e400"])
def test_huge_or_non_finite_numbers_are_400s(server, field, value):
    body = '{"model": "fake", "prompt": "hi", "%s": %s}' % (field, value)
    assert_openai_error(server.post("/v1/completions", body), 400, field)


@pytest.mark.parametrize("value", [[-1], ["7"], [True], [1.5]])
def test_stop_token_ids_error_names_its_param(server, value):
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "stop_token_ids": value})
    assert_openai_error(r, 400, "stop_token_ids")


def test_prompt_as_token_id_lists(server, tokenizer):
    ids = [tokenizer.encode("Hello"), tokenizer.encode("Once upon a time")]
    r = server.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 2,
                                        "echo": True})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[1]["text"].startswith("Once upon a time")
    assert r.json()["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
    for bad in ([[1, 2], []], [[1, "a"]], [[-1]]):
        r = server.post("/v1/completions", {"model": MODEL, "prompt": bad, "echo": True})
        assert_openai_error(r, 400, "prompt")


# ---- 6: the shutdown timeout ends streams with an error event ------------------------------
def test_shutdown_timeout_ends_streams_with_an_error_event(tokenizer, caplog):
    uvicorn_log = logging.getLogger("uvicorn")  # does not propagate to caplog's root handler
    uvicorn_log.addHandler(caplog.handler)
    try:
        _shutdown_with_a_stream_running(tokenizer)
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert "Traceback" not in caplog.text and "Cancel" not in caplog.text, caplog.text
    assert "shutdown timeout (0.5s) reached" in caplog.text


def _shutdown_with_a_stream_running(tokenizer):
    srv = LiveServer(tokenizer, shutdown_timeout_s=0.5)
    events = []

    def stream():
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": "hi", "max_tokens": 4000, "stream": True}) as r:
            events.extend(line for line in r.iter_lines() if line)
    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 10
    while len(events) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    start = time.monotonic()
    srv.stop()  # as SIGTERM does
    reader.join(10)
    assert time.monotonic() - start < 5
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["code"] == "shutting_down" and error["type"] == "server_error"
    assert all(json.loads(e.removeprefix("data: "))["choices"] for e in events[:-1])


# ---- 12: client-aborted requests are counted ----------------------------------------------
def test_aborted_requests_are_counted(server):
    def aborts() -> float:
        text = httpx.get(server.url + "/metrics").text
        line = [x for x in text.splitlines()
                if x.startswith('qserve_requests_finished_total{finish_reason="abort"}')]
        return float(line[0].split()[-1]) if line else 0.0

    before = aborts()
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": "hi", "max_tokens": 4000, "stream": True}) as r:
        assert next(r.iter_lines()).startswith("data: ")
    deadline = time.monotonic() + 10
    while aborts() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborts() == before + 1
    assert server.engine.requests == {}


def test_finished_requests_are_not_counted_as_aborts(tokenizer):
    from qserve.sampling_params import SamplingParams
    from qserve.server.async_engine import AsyncEngine

    counts = {"finished": 0, "aborted": 0}
    engine = AsyncEngine(FakeEngine(tokenizer),
                         on_finished=lambda out: counts.__setitem__("finished", 1 + counts[
                             "finished"]),
                         on_aborted=lambda: counts.__setitem__("aborted", 1 + counts["aborted"]))

    async def run():
        engine.start()
        queue = asyncio.Queue()
        await engine.submit("r", [1, 2], SamplingParams(max_tokens=3), queue)
        while not (await queue.get()).finished:
            pass
        engine.abort("r")  # too late: a no-op
        await asyncio.sleep(0.2)
        engine.shutdown()
    asyncio.run(run())
    assert counts == {"finished": 1, "aborted": 0}


# ---- 8, 9: a bad HF config.json is a one-line error -----------------------------------------
GOOD_CONFIG = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
               "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2}


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": -1}, "num_hidden_layers is -1; it must be a positive integer"),
    ({"num_attention_heads": "nine"}, "num_attention_heads is 'nine'; it must be a positive"),
    ({"num_key_value_heads": 0}, "num_key_value_heads is 0; it must be a positive integer"),
    ({"vocab_size": 1.5}, "vocab_size is 1.5"),
    ({"hidden_size": True}, "hidden_size is True"),
    ({"hidden_size": 30}, "hidden_size 30 is not a multiple of num_attention_heads 4"),
    ({"head_dim": -8}, "head_dim is -8"),
    ({"rms_norm_eps": "tiny"}, "rms_norm_eps is 'tiny'; it must be a positive number"),
    ({"rope_theta": 0}, "rope_theta is 0"),
    ({"rope_scaling": [1, 2]}, "rope_scaling is [1, 2]; it must be an object"),
    ({"max_position_embeddings": 0}, "max_position_embeddings is 0"),
    ([GOOD_CONFIG], "must hold a JSON object, not a list"),
])
def test_bad_hf_config_values_are_one_line_errors(tmp_path, change, message):
    from qserve.errors import ModelLoadError
    from qserve.loader.hf_loader import read_config

    cfg = {**GOOD_CONFIG, **change} if isinstance(change, dict) else change
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        read_config(tmp_path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_good_hf_config_still_reads(tmp_path):
    from qserve.loader.hf_loader import read_config

    (tmp_path / "config.json").write_text(json.dumps({**GOOD_CONFIG, "rope_theta": 5e5}))
    arch = read_config(tmp_path)
    assert (arch.num_layers, arch.num_kv_heads, arch.head_dim, arch.rope_theta) == (2, 2, 8, 5e5)


# ---- 2, 8, 10: quantize --force, a full or read-only disk, runs that were killed ------------
def _checkpoint_dir(path):
    from qserve.loader.checkpoint import QUANT_METHOD

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "quantization_config": {"quant_method": QUANT_METHOD}}))
    (path / "model.safetensors").write_bytes(b"old weights")
    return path


def _files(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_force_never_deletes_what_quantize_did_not_write(tmp_path, monkeypatch):
    from qserve.quant.quantize import quantize

    home = tmp_path / "home"
    (home / "models" / "m").mkdir(parents=True)
    (home / "models" / "m" / "m.gguf").write_bytes(b"cached model")
    monkeypatch.setenv("QSERVE_HOME", str(home))
    models = tmp_path / "models"
    models.mkdir()
    src = models / "src.gguf"
    src.write_bytes(b"the source model")
    (models / "other.gguf").write_bytes(b"another model")
    keep = _checkpoint_dir(tmp_path / "ckpt-with-notes")
    (keep / "notes.txt").write_text("mine")
    (tmp_path / "a-file").write_text("not a directory")
    before = _files(tmp_path)
    for out, message in [
        (models, "holds the source model"),
        (tmp_path, "holds the source model"),
        (home, "holds the model cache"),
        (home / "models", "is not a qserve checkpoint"),
        (keep, "holds notes.txt besides the checkpoint"),
        (tmp_path / "a-file", "is not a qserve checkpoint"),
    ]:
        with pytest.raises(QServeError, match=message) as e:
            quantize(str(src), out, force=True)
        assert "\n" not in str(e.value)
    assert _files(tmp_path) == before


def test_force_on_the_cache_is_a_one_line_cli_error(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from qserve import cli

    (tmp_path / "models").mkdir()
    src = tmp_path / "models" / "src.gguf"
    src.write_bytes(b"the source model")
    monkeypatch.setenv("QSERVE_HOME", str(tmp_path))
    result = CliRunner().invoke(cli.main, ["quantize", str(src), "-o", str(tmp_path), "--force"])
    assert result.exit_code == 2 and result.output.startswith("error: ")
    assert len(result.output.strip().splitlines()) == 1
    assert src.read_bytes() == b"the source model"


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_killed_runs_leave_nothing_behind_the_next(tmp_path):
    from qserve.quant.quantize import _write_atomically

    out = tmp_path / "ckpt"
    dead = _dead_pid()
    stale = tmp_path / f".ckpt.tmp-{dead}"
    (stale / "half").mkdir(parents=True)
    (stale / "half" / "model.safetensors").write_bytes(b"x" * 1000)
    running = tmp_path / f".ckpt.tmp-{os.getppid()}"  # a live process: maybe still writing
    running.mkdir()
    unrelated = tmp_path / f".other.tmp-{dead}"
    unrelated.mkdir()
    _write_atomically(out, lambda tmp: _checkpoint_dir(tmp))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["ckpt", running.name, unrelated.name])


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    OSError(errno.EROFS, "Read-only file system"),
    "safetensors",
])
def test_full_or_read_only_disk_is_a_one_line_error(tmp_path, error):
    from safetensors import SafetensorError

    from qserve.quant.quantize import _write_atomically

    if error == "safetensors":  # what save_file raises on ENOSPC
        error = SafetensorError("Error while serializing: I/O error: No space left on device "
                                "(os error 28)")
    out = _checkpoint_dir(tmp_path / "ckpt")
    before = _files(tmp_path)

    def write(tmp):
        _checkpoint_dir(tmp)
        (tmp / "tokenizer.json").write_text("{}")
        raise error
    with pytest.raises(QServeError) as e:
        _write_atomically(out, write)
    assert str(e.value).startswith(f"cannot write the checkpoint {out}: ")
    assert ("No space left" in str(e.value) or "Read-only" in str(e.value))
    assert "\n" not in str(e.value)
    assert _files(tmp_path) == before  # no half-written directory, the old checkpoint intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# ---- 7, 8: piped `qserve chat`: Ctrl-C ends the run; binary stdin is a one-line error ------
class InterruptingEngine(FakeEngine):
    """Sends this process SIGINT, as Ctrl-C does, at the third step of each reply."""

    def step(self):
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps % 3 == 0:
            os.kill(os.getpid(), signal.SIGINT)
        return super().step()


def test_piped_chat_stops_at_ctrl_c(tokenizer):
    from qserve.chat import ChatSession, run
    from qserve.sampling_params import SamplingParams

    engine = InterruptingEngine(tokenizer)
    added = []
    engine.add_request = lambda rid, *a, **k: (added.append(rid),
                                               FakeEngine.add_request(engine, rid, *a, **k))
    out, err = io.StringIO(), io.StringIO()
    session = ChatSession(engine, SamplingParams(max_tokens=100), out=out, err=err)
    with pytest.raises(KeyboardInterrupt):
        run(session, stdin=io.StringIO("first\nsecond\nthird\n"))
    assert added == ["chat-0"] and engine.requests == {}
    assert "(interrupted)" in err.getvalue()


def test_piped_chat_with_binary_stdin_is_a_one_line_error(tokenizer):
    from qserve.chat import ChatSession, run
    from qserve.sampling_params import SamplingParams

    session = ChatSession(FakeEngine(tokenizer), SamplingParams(max_tokens=2),
                          out=io.StringIO(), err=io.StringIO())
    stdin = io.TextIOWrapper(io.BytesIO(bytes(range(128, 256)) * 64), encoding="utf-8")
    with pytest.raises(QServeError, match="stdin is not UTF-8 text") as e:
        run(session, stdin=stdin)
    assert "\n" not in str(e.value)


# ---- 11: checksums: the pinned hash wins; the cached file by path is checked too -----------
@pytest.fixture
def pinned_tiny(monkeypatch, tmp_path):
    """A cached 'tiny' alias pinned to the sha256 of its good contents; returns its path."""
    import hashlib

    from qserve.loader import registry

    good = b"GGUF good contents " * 1000
    monkeypatch.setenv("QSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(registry.ALIASES, "tiny", registry.ModelSource(
        "tiny-pkg", "tiny_pkg/tiny.gguf", hashlib.sha256(good).hexdigest()))
    path = registry.cached_path("tiny")
    path.parent.mkdir(parents=True)
    path.write_bytes(good)
    path.with_name("tiny.gguf.sha256").write_text(f"{hashlib.sha256(good).hexdigest()}  x\n")
    return path


def _corrupt(path) -> None:
    import hashlib

    bad = path.read_bytes().replace(b"good", b"evil")
    path.write_bytes(bad)
    path.with_name("tiny.gguf.sha256").write_text(f"{hashlib.sha256(bad).hexdigest()}  x\n")


def test_pinned_hash_wins_over_a_rewritten_record(pinned_tiny):
    from qserve.errors import ModelLoadError
    from qserve.loader.registry import resolve_model

    assert resolve_model("tiny") == pinned_tiny
    _corrupt(pinned_tiny)  # the record now vouches for the changed file
    for spec in ("tiny", str(pinned_tiny)):
        with pytest.raises(ModelLoadError, match=r"tiny.gguf is corrupt \(sha256 does not match "
                                                 r"the sha256 pinned for tiny\); re-run "
                                                 r"`qserve pull tiny`"):
            resolve_model(spec, download=False)


def test_model_path_to_the_cached_file_is_checked(pinned_tiny, tmp_path):
    from qserve.errors import ModelLoadError
    from qserve.loader.registry import resolve_model

    link = tmp_path / "link.gguf"
    link.symlink_to(pinned_tiny)
    assert resolve_model(str(link)) == link
    pinned_tiny.write_bytes(pinned_tiny.read_bytes()[:-10])  # truncated in place
    for path in (pinned_tiny, link):
        with pytest.raises(ModelLoadError, match="is corrupt"):
            resolve_model(str(path))


def test_unchanged_cached_file_is_hashed_once(pinned_tiny, monkeypatch):
    from qserve.errors import ModelLoadError
    from qserve.loader import registry

    hashed = []
    real = registry.sha256_file
    monkeypatch.setattr(registry, "sha256_file", lambda p: hashed.append(p) or real(p))
    for _ in range(3):
        registry.resolve_model("tiny")
        registry.resolve_model(str(pinned_tiny))
    assert len(hashed) == 1
    st = pinned_tiny.stat()
    _corrupt(pinned_tiny)
    os.utime(pinned_tiny, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # same size, new mtime
    with pytest.raises(ModelLoadError, match="is corrupt"):
        registry.resolve_model("tiny")
    assert len(hashed) == 2


# ---- 8: sizes that are not numbers ----------------------------------------------------------
@pytest.mark.parametrize("size", ["nan", "inf", "1e400", "-inf", "infGiB", "1e308TiB"])
def test_kv_cache_memory_that_is_not_a_size_is_a_one_line_error(size):
    from click.testing import CliRunner

    from qserve import cli

    result = CliRunner().invoke(cli.main, ["info", "--kv-cache-memory", size])
    assert result.exit_code == 2, result.output
    assert result.output == f"error: --kv-cache-memory={size!r} is not a size; use e.g. " \
                            f"512MiB or 2GiB\n"
