"""`qserve serve` as users meet it: a real server process on a free loopback port, driven by the
unmodified `openai` client (and raw HTTP for what the client would refuse to send).

One server (with an API key) serves the module; a second, with one sequence and a one-request
waiting queue, checks back-pressure (503) and a clean exit on SIGTERM. Generations are a few
tokens each, so the module stays quick on a slow CPU.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

pytestmark = pytest.mark.slow

KEY = "test-key"
MODEL = "smollm2-135m-instruct"
SERVER_FLAGS = ["--max-model-len", "1024", "--kv-cache-memory", "512MiB"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `python -m qserve serve` process; its stdout and stderr go to `log`. It is launched
    at once and waited for in `ready()`, so two servers can load their models side by side."""

    def __init__(self, log_path, *flags: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qserve", "serve", "--port", str(self.port), *SERVER_FLAGS,
             *flags], stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})})

    def ready(self) -> "Server":
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        pytest.fail("the server did not come up:\n" + self.log())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10,
                         headers={"Authorization": f"Bearer {KEY}"}).text  # ignored without a key
        return {m[1]: float(m[2]) for m in re.finditer(r"^(\w+) ([\d.e+-]+)$", text, re.M)}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The module's server (with an API key), and a small one for back-pressure: one running
    sequence, one waiting request."""
    logs = tmp_path_factory.mktemp("serve")
    # With int8 activations (the CPU default) a matmul's path depends on its row count (row
    # kernels, the int8 GEMM from 8-32 rows on), and rounding the activations to int8 turns
    # those paths' last-bit differences into different roundings a few layers on: a greedy
    # near-tie can flip with the batch, as in vLLM and llama.cpp. The main server keeps fp32
    # activations, whose paths differ only in the last bits, so a stream's text must equal
    # the same prompt's alone: the concurrency tests check that streams never mix.
    main = Server(logs / "server.log", "--api-key", KEY, env={"QSERVE_CPU_ACTIVATIONS": "fp32"})
    small = Server(logs / "small.log", "--max-num-seqs", "1", "--max-waiting", "1")
    yield main, small
    for srv in (small, main):
        assert srv.stop() == 0, srv.log()
        log = srv.log()
        assert "Traceback" not in log and " 500 " not in log, log


@pytest.fixture(scope="module")
def server(servers):
    return servers[0].ready()


@pytest.fixture(scope="module")
def small_server(servers):
    return servers[1].ready()


@pytest.fixture(scope="module")
def tokenizer():
    from qserve.loader import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, path: str, body, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, timeout=120,
                      headers={**headers, "Content-Type": "application/json"})


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


PROMPT = "The capital of France is"
HELLO = [{"role": "system", "content": "You are brief."},
         {"role": "user", "content": "Say hello."}]


# ---- the happy paths ---------------------------------------------------------------------
def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_and_usage(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id and r.created
    (c,) = r.choices
    assert c.text and c.finish_reason == "length"
    n_prompt = len(tokenizer.encode(PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 6)
    assert r.usage.total_tokens == n_prompt + 6
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + c.text


def test_chat_uses_the_template(client, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8,
                                       temperature=0)
    assert r.object == "chat.completion"
    (c,) = r.choices
    assert c.message.role == "assistant" and c.message.content
    assert c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(chat_ids(tokenizer, HELLO))


def test_stream_equals_whole_at_temperature_0(client):
    whole = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=10,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert reasons[-1] == whole.choices[0].finish_reason and not any(reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens

    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                         temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == plain.choices[0].text


def test_n_and_prompt_lists(client):
    r = client.completions.create(model=MODEL, prompt=[PROMPT, "Once upon a time"], n=2,
                                  max_tokens=4, temperature=1.0, seed=1)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 4 * 4
    chat = client.chat.completions.create(model=MODEL, messages=HELLO, n=2, max_tokens=4,
                                          temperature=1.0, seed=3)
    assert [c.index for c in chat.choices] == [0, 1]


def test_stop(client):
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                     temperature=0).choices[0].text
    stop = text.strip()[1:3]  # cut the greedy text short where `stop` first appears
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                  stop=[stop])
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the likeliest
    chat = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


def test_streamed_logprobs_join_to_the_whole_ones(client):
    """Each chunk carries the logprobs of its own new tokens only (the engine reports
    deltas): joined, they are the whole response's, offsets included."""
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                      logprobs=2).choices[0].logprobs
    tokens, offsets, tops = [], [], []
    for ch in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                        temperature=0, logprobs=2, stream=True):
        lp = ch.choices[0].logprobs
        if lp is not None:
            tokens += lp.tokens
            offsets += lp.text_offset
            tops += [sorted(t) for t in lp.top_logprobs]
    assert tokens == whole.tokens and offsets == whole.text_offset
    assert tops == [sorted(t) for t in whole.top_logprobs]
    chat = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2)
    streamed = [t.token for ch in client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2, stream=True) if ch.choices and ch.choices[0].logprobs
        for t in ch.choices[0].logprobs.content]
    assert streamed == [t.token for t in chat.choices[0].logprobs.content]


def test_echo_with_logprobs_scores_the_prompt(client, server, tokenizer):
    """echo + logprobs reports the prompt's tokens first (the first with null logprobs), as
    OpenAI's legacy completions did and lm-evaluation-harness scores continuations with; the
    generated tokens follow as without echo."""
    ids = tokenizer.encode(PROMPT)
    gen = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0,
                                    logprobs=2)
    made = gen.choices[0].logprobs
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0,
                                  logprobs=2, echo=True)
    lp, text = r.choices[0].logprobs, r.choices[0].text
    n = len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == text and text.startswith(tokenizer.decode(ids))
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(n + 2)]
    assert lp.tokens[n:] == made.tokens
    assert lp.token_logprobs[n:] == pytest.approx(made.token_logprobs, abs=1e-4)


def test_echo_with_max_tokens_0_returns_the_prompt_alone(client, server, tokenizer):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, logprobs=1,
                                  echo=True)
    c = r.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == r.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == 0 and r.usage.total_tokens == r.usage.prompt_tokens
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=1,
                                      echo=True, temperature=0).choices[0].logprobs
    assert c.logprobs.token_logprobs[1:] == pytest.approx(
        whole.token_logprobs[1:len(c.logprobs.tokens)], abs=1e-4)
    chunks = [ch for ch in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, logprobs=1, echo=True, stream=True,
        stream_options={"include_usage": True})]
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert texts == [PROMPT] and chunks[-1].usage.completion_tokens == 0
    streamed = next(ch.choices[0].logprobs for ch in chunks if ch.choices)
    assert streamed.tokens == c.logprobs.tokens
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]


def test_streamed_echo_logprobs_join_to_the_whole_ones(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                      logprobs=2, echo=True).choices[0].logprobs
    tokens, offsets, values = [], [], []
    for ch in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                        temperature=0, logprobs=2, echo=True, stream=True):
        lp = ch.choices[0].logprobs
        if lp is not None:
            tokens += lp.tokens
            offsets += lp.text_offset
            values += lp.token_logprobs
    assert tokens == whole.tokens and offsets == whole.text_offset
    assert values[0] is None and values[1:] == pytest.approx(whole.token_logprobs[1:], abs=1e-4)


def test_tokenize_and_detokenize(client, server, tokenizer):
    """POST /tokenize and /detokenize in vLLM's shape and llama.cpp's: the ids a completion
    or a chat request would run, and back to the text."""
    r = post(server, "/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert r.status_code == 200, r.text
    body = r.json()
    used = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).usage
    assert body["tokens"] == tokenizer.encode(PROMPT) and body["count"] == used.prompt_tokens
    assert body["max_model_len"] == client.models.list().data[0].max_model_len
    bare = post(server, "/tokenize", {"content": PROMPT}).json()  # llama.cpp: no specials
    assert bare["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
    chat = post(server, "/tokenize", {"model": MODEL, "messages": HELLO}).json()
    used = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1).usage
    assert chat["count"] == len(chat["tokens"]) == used.prompt_tokens
    back = post(server, "/detokenize", {"model": MODEL, "tokens": chat["tokens"]}).json()
    assert back["prompt"] == back["content"] == tokenizer.decode(chat["tokens"],
                                                                 skip_special_tokens=False)
    assert post(server, "/detokenize", {"tokens": bare["tokens"]}).json()["prompt"] == PROMPT
    assert post(server, "/tokenize", {"content": ""}).json()["count"] == 0


@pytest.mark.parametrize("path, body, status, words", [
    ("/tokenize", {"model": MODEL}, 400, "'prompt'"),
    ("/tokenize", {"prompt": 5}, 400, "'prompt' must be a string"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "does not exist"),
    ("/tokenize", {"messages": []}, 400, "'messages'"),
    ("/detokenize", {"tokens": "1 2"}, 400, "list of token ids"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "holds -1"),
    ("/detokenize", {"tokens": [10 ** 12]}, 400, "not a token id of this model"),
])
def test_tokenize_refusals_are_one_line(server, path, body, status, words):
    r = post(server, path, body)
    assert r.status_code == status and words in r.json()["error"]["message"], r.text
    assert post(server, path, {"prompt": "x", "tokens": [1]}, key=None).status_code == 401


def test_embeddings_are_the_models_last_hidden_states(client, server, tokenizer, hf_model):
    """POST /v1/embeddings through the openai client (which asks for base64 and decodes it):
    each input's last-token hidden state, unit length, against transformers' on the same
    weights (the server runs the file's Q4_1 with fp32 activations: summation order apart,
    ~1e-6), in the inputs' order, with the tokens they took."""
    import torch

    texts = [PROMPT, "Once upon a time, there was a little", "def f(x):\n    return x"]
    r = client.embeddings.create(model=MODEL, input=texts)
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == MODEL
    ids = [tokenizer.encode(t) for t in texts]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    with torch.no_grad():
        for d, tokens in zip(r.data, ids):
            h = hf_model.model(input_ids=torch.tensor([tokens])).last_hidden_state[0, -1]
            want = torch.nn.functional.normalize(h.float(), dim=0)
            assert torch.allclose(torch.tensor(d.embedding), want, atol=1e-3, rtol=0)
    # floats as JSON, token ids as input, fewer dimensions
    plain = post(server, "/v1/embeddings", {"model": MODEL, "input": ids[0],
                                            "encoding_format": "float"}).json()
    assert plain["data"][0]["embedding"] == pytest.approx(r.data[0].embedding, abs=1e-6)
    short = post(server, "/v1/embeddings", {"input": [ids[0]], "dimensions": 64}).json()
    head = torch.nn.functional.normalize(torch.tensor(r.data[0].embedding[:64]), dim=0)
    assert short["data"][0]["embedding"] == pytest.approx(head.tolist(), abs=1e-5)


@pytest.mark.parametrize("body, status, param, words", [
    ({"input": ""}, 400, "input", "'input' is empty"),
    ({"input": [[]]}, 400, "input", "'input' must be a string"),
    ({"input": 7}, 400, "input", "'input' must be a string"),
    ({"input": "hello " * 1100}, 400, "input", "this model takes at most 1023"),
    ({"input": [10 ** 9]}, 400, "input", "outside the vocabulary"),
    ({"input": "x", "encoding_format": "hex"}, 400, "encoding_format", "float or base64"),
    ({"input": "x", "dimensions": 0}, 400, "dimensions", "from 1 to the model's 576"),
    ({"input": "x", "dimensions": 577}, 400, "dimensions", "from 1 to the model's 576"),
    ({"input": "x", "model": "text-embedding-3-small"}, 404, "model", "does not exist"),
])
def test_embedding_refusals_are_one_line(server, body, status, param, words):
    r = post(server, "/v1/embeddings", body)
    error = r.json()["error"]
    assert r.status_code == status and error["param"] == param, r.text
    assert words in error["message"] and "\n" not in error["message"], r.text
    assert post(server, "/v1/embeddings", {"input": "x"}, key=None).status_code == 401


# ---- Ollama's API, through the unmodified ollama client ---------------------------------------
@pytest.fixture(scope="module")
def ollama_client(server):
    ollama = pytest.importorskip("ollama")
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"},
                         timeout=120)


def test_ollama_chat_and_generate_are_the_openai_answers(ollama_client, client):
    """/api/chat and /api/generate (templated, and raw) give the text the OpenAI routes give
    the same request (greedy), whole and streamed, with Ollama's counts."""
    opts = {"temperature": 0, "num_predict": 8}
    want = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8,
                                          temperature=0)
    got = ollama_client.chat(model=MODEL, messages=HELLO, options=opts)
    assert got.message.role == "assistant"
    assert got.message.content == want.choices[0].message.content
    assert got.done and got.done_reason == want.choices[0].finish_reason
    assert (got.prompt_eval_count, got.eval_count) == (want.usage.prompt_tokens,
                                                       want.usage.completion_tokens)
    assert got.total_duration > 0 and got.eval_duration > 0
    parts = list(ollama_client.chat(model=MODEL + ":latest", messages=HELLO, options=opts,
                                    stream=True))
    assert "".join(p.message.content for p in parts) == got.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].eval_count == 8
    # /api/generate: the prompt through the chat template (with `system`), or raw
    gen = ollama_client.generate(model=MODEL, prompt="Say hello.", system="You are brief.",
                                 options=opts)
    assert gen.response == got.message.content
    raw = ollama_client.generate(model=MODEL, prompt=PROMPT, raw=True, options=opts)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert raw.response == plain.choices[0].text
    # an empty request loads the model (Ollama's preload): done at once
    assert ollama_client.generate(model=MODEL, prompt="").done_reason == "load"


def test_ollama_format_constrains_to_json(ollama_client):
    """`format`: a JSON schema (the answer is that object), or "json" (any object: checked
    to be one as far as the tokens allowed it)."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}
    r = ollama_client.chat(model=MODEL, format=schema, options={"temperature": 0,
                                                               "num_predict": 40},
                           messages=[{"role": "user", "content": "What is 2+2? JSON."}])
    assert r.done_reason == "stop" and isinstance(json.loads(r.message.content)["answer"], int)
    r = ollama_client.generate(model=MODEL, prompt="A JSON object:", format="json",
                               options={"temperature": 0, "num_predict": 12})
    assert r.response.lstrip().startswith("{")  # (unconstrained, this model writes prose)
    if r.done_reason == "stop":  # else cut at 12 tokens, inside the object
        assert isinstance(json.loads(r.response), dict)


def test_ollama_embed_is_the_openai_embedding(ollama_client, client):
    import torch

    texts = [PROMPT, "Once upon a time"]
    want = client.embeddings.create(model=MODEL, input=texts).data
    got = ollama_client.embed(model=MODEL, input=texts)
    assert got.prompt_eval_count == client.embeddings.create(model=MODEL,
                                                             input=texts).usage.prompt_tokens
    for w, g in zip(want, got.embeddings):
        assert g == pytest.approx(w.embedding, abs=1e-5)
    legacy = ollama_client.embeddings(model=MODEL, prompt=PROMPT).embedding  # as computed
    unit = torch.nn.functional.normalize(torch.tensor(legacy), dim=0)
    assert abs(float(torch.tensor(legacy).norm()) - 1) > 1e-3  # not scaled to unit length
    assert unit.tolist() == pytest.approx(want[0].embedding, abs=1e-5)


def test_ollama_model_listing(ollama_client, client):
    [m] = ollama_client.list().models
    assert m.model == MODEL and m.size > 0 and m.details.family == "llama"
    assert m.details.parameter_size == "135M" and m.details.format == "gguf"
    shown = ollama_client.show(MODEL)
    assert {"completion", "embedding"} <= set(shown.capabilities)
    assert shown.modelinfo["llama.context_length"] == client.models.list().data[0].max_model_len
    assert [p.model for p in ollama_client.ps().models] == [MODEL]
    assert ollama_client._client.get("/api/version").json()["version"]


@pytest.mark.parametrize("path, body, status, words", [
    ("/api/chat", {"model": "llama3", "messages": HELLO}, 404, "model 'llama3' not found"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "?",
                                                 "images": ["AAAA"]}]}, 400, "images"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "'suffix'"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "format": "xml"}, 400, "'format'"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "options": {"temperature": "hot"}}, 400,
     "'temperature'"),
    ("/api/embed", {"model": MODEL, "input": "hello " * 1100, "truncate": False}, 400,
     "more than this model's 1023 tokens"),
    ("/api/embed", {"model": MODEL, "input": [1, 2]}, 400, "'input' must be a string"),
])
def test_ollama_refusals_are_its_one_line_errors(server, path, body, status, words):
    r = post(server, path, body)
    assert r.status_code == status and set(r.json()) == {"error"}, r.text
    assert words in r.json()["error"] and "\n" not in r.json()["error"], r.text
    assert post(server, path, body, key=None).status_code == 401


def test_ollama_embed_truncates_by_default(server):
    r = post(server, "/api/embed", {"model": MODEL, "input": "hello " * 1100})
    assert r.status_code == 200 and r.json()["prompt_eval_count"] == 1023


def test_sixteen_concurrent_streams(client, server):
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(4)]
    expected = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=6,
                                             temperature=0).choices[0].text for p in prompts}
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                                 timeout=300)

    async def one(prompt):
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                                  temperature=0, stream=True)
        return "".join([ch.choices[0].text async for ch in stream])

    async def all16():
        try:
            return await asyncio.gather(*(one(prompts[i % 4]) for i in range(16)))
        finally:
            await aclient.close()

    texts = asyncio.run(all16())
    assert texts == [expected[prompts[i % 4]] for i in range(16)]


def _voluntary_switches(pid: int) -> int:
    """Voluntary context switches of all the process's threads so far (a thread that sleeps,
    on a lock, a futex or I/O, makes one each time)."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            text = status.read_text()
        except OSError:  # a thread that just ended
            continue
        total += int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", text, re.M).group(1))
    return total


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_decode_threads_do_not_sleep_between_barriers(server):
    """The engine loads and steps on one thread (EngineThread): when the server loaded it on
    the main thread and stepped it on another, libgomp held two worker pools, and on a
    2-core machine its workers then slept and woke at every parallel region of a decode step,
    ~160 voluntary context switches per token across the process (decode 2x slower); one
    pool makes ~9 (the output thread, the event loop and the worker between steps)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 128, "ignore_eos": True,
            "stream": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers,
                      timeout=120) as r:
        lines = r.iter_lines()
        for _ in range(8):  # past the prefill
            next(lines)
        before, chunks = _voluntary_switches(server.proc.pid), 0
        for line in lines:
            chunks += line.startswith("data: {")
        after = _voluntary_switches(server.proc.pid)
    assert chunks > 100
    assert (after - before) / chunks < 40, (after - before, chunks)


def test_disconnected_stream_frees_its_blocks(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True,
            "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers,
                      timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        m = server.metrics()
        assert m["qserve_requests_running"] == 1 and m["qserve_kv_blocks_used"] > 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["qserve_requests_running"] == 0 and m["qserve_kv_blocks_used"] == 0:
            break
        time.sleep(0.2)
    assert (m["qserve_requests_running"], m["qserve_kv_blocks_used"]) == (0, 0)
    assert m["qserve_generation_tokens_total"] > 0 and "qserve_preemptions_total" in m
    assert m["qserve_time_to_first_token_seconds_count"] > 0


# ---- errors ------------------------------------------------------------------------------
LONG = "hello " * 1100  # over the 1024-token context


@pytest.mark.parametrize("path, body, status, param, code", [
    ("/v1/completions", "{not json", 400, None, None),
    ("/v1/completions", [1, 2], 400, None, None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400,
     "max_tokens", None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 2.5}, 400,
     "temperature", None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400,
     "temperature", None),
    ("/v1/completions", {"model": MODEL, "prompt": 7}, 400, "prompt", None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
     400, "messages", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": "5"}, 400,
     "max_tokens", None),
    ("/v1/completions", {"model": MODEL, "prompt": LONG}, 400, "prompt",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": LONG}]},
     400, "messages", "context_length_exceeded"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5000}, 400,
     "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model", "model_not_found"),
    ("/v1/nothing-here", {}, 404, None, "not_found"),
])
def test_errors_have_openai_shape(server, path, body, status, param, code):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)


def test_errors_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    assert e.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=LONG, max_tokens=2)
    assert e.value.code == "context_length_exceeded"


def test_unknown_fields_are_ignored(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, user="me",
                                  extra_body={"no_such_option": 1, "logit_bias": {}})
    assert r.usage.completion_tokens == 2


def test_api_key_is_enforced(server):
    for key in (None, "wrong"):
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi"}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # health needs no key


# ---- back-pressure and shutdown ----------------------------------------------------------
def test_full_queue_is_503_and_sigterm_exits_0(small_server):
    srv = small_server
    body = {"model": MODEL, "prompt": PROMPT, "ignore_eos": True}
    # long enough to still run while the next two arrive (12 tokens took ~0.1 s once decode
    # got fast, and the "full" request was then simply served)
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=120,
                      json={**body, "max_tokens": 400, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # running: it holds the only sequence slot
        statuses = []
        waiting = threading.Thread(target=lambda: statuses.append(post(
            srv, "/v1/completions", {**body, "max_tokens": 2}, key=None).status_code))
        waiting.start()
        deadline = time.monotonic() + 30
        while srv.metrics()["qserve_requests_waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        full = post(srv, "/v1/completions", {**body, "max_tokens": 2}, key=None)
        assert full.status_code == 503, full.text
        assert full.json()["error"]["code"] == "queue_full"

        srv.proc.send_signal(signal.SIGTERM)  # in-flight requests finish, then exit 0
        assert [line for line in lines if line][-1] == "data: [DONE]"
    waiting.join(60)
    assert statuses == [200]  # the queued request was served before the exit
    assert srv.proc.wait(60) == 0, srv.log()


def test_binding_elsewhere_without_a_key_warns():
    from click.testing import CliRunner

    from qserve import cli

    # --max-model-len 1 fails in engine_config after the warning, before any model loads
    result = CliRunner().invoke(cli.main, ["serve", "--host", "0.0.0.0", "--max-model-len", "1"],
                                env={"QSERVE_API_KEY": ""})
    assert "warning: serving on 0.0.0.0 without an API key" in result.output



def test_an_address_serve_cannot_listen_on_fails_before_the_model_loads():
    """A host that does not resolve, or a port another server holds, is one line at once:
    they had surfaced as uvicorn's ERROR lines (exit 3) after the whole model had loaded."""
    from click.testing import CliRunner

    from qserve import cli

    r = CliRunner().invoke(cli.main, ["serve", "--host", "no-such-host.invalid"])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: --host 'no-such-host.invalid' is not an address this "
                               "machine can listen on (") and r.output.count("\n") == 1
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = CliRunner().invoke(cli.main, ["serve", "--port", str(port)])
    assert r.exit_code == 2, r.output
    assert r.output == f"error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
