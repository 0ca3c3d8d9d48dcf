"""Structured outputs and tool calls on the real default model, through a real HTTP server
(uvicorn in a thread of this process, so the test can read the engine's block manager) and the
unmodified `openai` client.

Every constrained answer must parse and validate against its schema, whatever a 135M model
would write unconstrained; several requests run at once (continuous batching, each sample its
own grammar matcher), with n > 1, and under a KV pool small enough to preempt.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytest.importorskip("fastapi")

MODEL = "smollm2-135m-instruct"

PERSON = {  # nested objects, enums, an array, bounded strings (a 135M model rambles)
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 12},
                                   "country": {"enum": ["FR", "DE", "US"]}},
                    "required": ["city", "country"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "role", "address", "active"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 16},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Describe a user of our site as JSON."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InProcessServer:
    """make_server's uvicorn server on a thread; `engine` is the LLMEngine it serves."""

    def __init__(self, engine, **config):
        from qserve.server.api import make_server
        from qserve.server.config import ServerConfig

        self.engine = engine
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = make_server(engine, MODEL, ServerConfig(port=port, log_level="warning",
                                                              **config))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "no server"
            time.sleep(0.05)

    def idle_blocks(self) -> int:
        """The free KV blocks once the engine has nothing left to run."""
        deadline = time.monotonic() + 30
        while self.engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the engine thread's last step boundary
        return self.engine.block_manager.num_free_blocks

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def make_served_engine(model, **options):
    from qserve.config import engine_config
    from qserve.llm import make_engine

    torch.manual_seed(0)
    options.setdefault("max_model_len", 1024)
    return make_engine(engine_config(None, **options), loaded=model)


@pytest.fixture(scope="module")
def served(native_model):
    # the prefix cache off, so free blocks return to the start count after every request
    srv = InProcessServer(make_served_engine(native_model, kv_cache_memory="64MiB",
                                             enable_prefix_caching=False))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=300)


def _post(srv, path, body):
    return httpx.post(srv.url + path, json=body, timeout=300)


# ---- response_format --------------------------------------------------------------------
def test_json_schema_valid_at_concurrent_requests_and_n(served):
    """Eight concurrent requests (two with n=2, sampled), nested objects and enums: every
    answer parses and validates, and the KV pool is back where it started."""
    start = served.idle_blocks()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}

    async def one(http, k):
        body = {"model": MODEL, "messages": ASK, "max_tokens": 120, "response_format": fmt,
                "temperature": 0.0 if k % 2 else 0.9, "seed": k, "n": 2 if k < 2 else 1}
        r = await http.post(served.url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"]

    async def run():
        async with httpx.AsyncClient() as http:
            return await asyncio.gather(*(one(http, k) for k in range(8)))

    choices = [c for cs in asyncio.run(run()) for c in cs]
    assert len(choices) == 10
    for c in choices:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["message"]["content"]), PERSON)
    assert served.idle_blocks() == start


def test_json_object_is_valid_json_streamed_and_on_completions(served, client):
    # json_object leaves the keys and values to the model: a prompt it answers briefly
    ask = 'Is the sky blue? Answer as JSON like {"answer": "yes"}.'
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ask}], max_tokens=100,
        temperature=0, stream=True, response_format={"type": "json_object"})
    chunks = [ch.choices[0] for ch in stream if ch.choices]
    text = "".join(c.delta.content or "" for c in chunks)
    assert chunks[-1].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)
    r = _post(served, "/v1/completions", {"model": MODEL, "prompt": 'JSON: {"a": 1}\nJSON:',
                                          "max_tokens": 100, "temperature": 0,
                                          "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["text"]), dict)


def test_constraint_survives_preemption(native_model):
    """A pool of a few blocks and four long constrained requests: sequences are preempted
    (recomputed) mid-answer and resume with their grammar state."""
    from qserve.sampling_params import SamplingParams
    from qserve.server.structured import Grammars, Structure

    # room for about 700 tokens (fp16 K/V): four answers of ~300 tokens cannot all stay
    # resident
    engine = make_served_engine(native_model, max_model_len=512, kv_cache_memory="15MiB",
                                swap_space=0, enable_prefix_caching=False)
    grammars = Grammars(engine.tokenizer)
    schema = {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 5, "maxItems": 5, "items": PERSON}},
        "required": ["items"], "additionalProperties": False}
    constraint = grammars.constraint(Structure(grammar=("json_schema", json.dumps(schema))))
    prompt = engine.tokenizer.encode("List five users as JSON:")
    for k in range(4):
        engine.add_request(f"r{k}", None, SamplingParams(max_tokens=480, temperature=0.8,
                                                         seed=k, constraint=constraint),
                           prompt_token_ids=prompt)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    assert engine.scheduler.num_preemptions > 0
    for c in finals.values():
        assert c.finish_reason == "stop", c.text[-80:]
        jsonschema.validate(json.loads(c.text), schema)


def test_speculative_drafts_are_checked_against_the_grammar(native_model):
    """With an n-gram draft, a constrained request speculates: its drafts are verified against
    the target masked by the grammar at each draft position, so a forbidden draft is rejected.
    Greedy, the output is token for token the one without speculation, and it validates."""
    from qserve.sampling_params import SamplingParams
    from qserve.server.structured import Grammars, Structure

    prompt_text = ('{"name": "ann", "role": "admin", "address": {"city": "Lyon", "country": '
                   '"FR"}, "active": true}\n{"name": "ann", "role": "admin", "address": {')
    outputs = {}
    for draft in (None, "ngram"):
        extra = {"draft": draft, "spec_max_batch_size": 2} if draft else {}
        engine = make_served_engine(native_model, kv_cache_memory="64MiB", **extra)
        grammars = Grammars(engine.tokenizer)
        constraint = grammars.constraint(Structure(grammar=("json_schema", json.dumps(PERSON))))
        prompt = engine.tokenizer.encode(prompt_text)
        engine.add_request("c", None, SamplingParams(max_tokens=100, temperature=0,
                                                     constraint=constraint),
                           prompt_token_ids=prompt)
        engine.add_request("s", None, SamplingParams(max_tokens=100, temperature=0.8, seed=1,
                                                     constraint=constraint),
                           prompt_token_ids=prompt)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[draft, out.request_id] = out.outputs[0]
    assert outputs["ngram", "c"].spec_draft_tokens > 0
    assert outputs["ngram", "c"].spec_accepted_tokens < outputs["ngram", "c"].spec_draft_tokens \
        or outputs["ngram", "s"].spec_accepted_tokens < outputs["ngram", "s"].spec_draft_tokens
    assert outputs["ngram", "c"].token_ids == outputs[None, "c"].token_ids
    for c in outputs.values():
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)


# ---- tools ------------------------------------------------------------------------------
def test_named_and_required_tool_calls(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    # one call: a 135M model left to it repeats calls until max_tokens
    req = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME],
                                         tool_choice="required", max_tokens=120, temperature=0,
                                         parallel_tool_calls=False)
    calls = req.choices[0].message.tool_calls
    assert req.choices[0].finish_reason == "tool_calls" and calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    assert len(calls) == 1


def test_tool_calls_stream_as_deltas_and_a_tool_round_trip(client):
    msgs = [{"role": "user", "content": "What is the weather in Oslo?"}]
    stream = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="required", max_tokens=120,
        temperature=0, stream=True, parallel_tool_calls=False)
    calls, reasons = {}, []
    for ch in stream:
        for c in ch.choices:
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "args": ""})
                calls[d.index]["args"] += d.function.arguments or ""
    assert reasons[-1] == "tool_calls" and calls
    call = calls[0]
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    args = json.loads(call["args"])
    # the call and its result go back in: role "tool" and assistant tool_calls are accepted
    follow = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temp": 21}'}]
    r = client.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER],
                                       tool_choice="none", max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_auto_tool_choice_over_http_answers(served):
    """auto: free text or a tagged call; either way a well-formed OpenAI message."""
    r = _post(served, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Weather in Rome?"}],
        "tools": [WEATHER], "max_tokens": 60, "temperature": 0})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    for c in msg.get("tool_calls") or []:
        jsonschema.validate(json.loads(c["function"]["arguments"]),
                            WEATHER["function"]["parameters"])
    assert msg.get("tool_calls") or msg["content"]


# ---- errors -----------------------------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": []}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "assistant", "tool_calls": "x"}]}, "messages"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools"),
    ({"tools": [WEATHER], "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
])
def test_bad_structures_are_openai_400s(served, body, param):
    full = {"model": MODEL, "messages": ASK, "max_tokens": 4, **body}
    r = _post(served, "/v1/chat/completions", full)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert err["type"] == "invalid_request_error" and "Traceback" not in err["message"]


def test_tools_on_completions_is_a_400(served):
    r = _post(served, "/v1/completions", {"model": MODEL, "prompt": "hi", "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_prefetched_masks_equal_masks_filled_on_demand():
    """prefetch (the output thread, during the forward pass) fills the same masks `mask` would;
    a prefetched mask is never used for a different output of the same length (a sibling
    sample that diverged, or a rollback)."""
    from qserve.loader import load_tokenizer
    from qserve.server.structured import Grammars, Structure

    tok = load_tokenizer(None)
    grammars = Grammars(tok)
    structure = Structure(grammar=("json_schema", json.dumps(PERSON)))
    ids = tok.encode('{"name": "Ann", "role": "admin", "address": {"city": "Lyon", '
                     '"country": "FR"}, "active": true}', add_special_tokens=False)
    other = tok.encode('{"name": "Bob", "role": "viewer"', add_special_tokens=False)
    logits = torch.randn(2, 49152)

    def masked(constraint, outs):
        x = logits[:len(outs)].clone()
        constraint.mask(x, outs)
        return x

    ahead, fresh = grammars.constraint(structure), grammars.constraint(structure)
    for k in range(1, len(ids) + 1):
        ahead.prefetch([ids[:k]])
        assert torch.equal(masked(ahead, [ids[:k]]), masked(fresh, [ids[:k]])), k
    assert torch.isinf(masked(fresh, [ids])[0]).sum() > 49000  # only EOS is left
    # a prefetch for one output, then a different output of the same length
    n = min(len(ids), len(other)) - 1
    a, b = ids[:n], other[:n]
    assert a != b
    ahead.prefetch([a])
    assert torch.equal(masked(ahead, [b]), masked(grammars.constraint(structure), [b]))
    # two samples at once, prefetched then asked in the other order
    ahead.prefetch([a, b])
    assert torch.equal(masked(ahead, [b, a]), masked(grammars.constraint(structure), [b, a]))


def test_generate_json_schema_cli(tmp_path):
    """`qserve generate --json-schema FILE`: the answer validates; a bad file is one line."""
    import subprocess
    import sys

    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "country": {"enum": ["FR", "DE"]}},
        "required": ["city", "country"], "additionalProperties": False}
    good, bad = tmp_path / "schema.json", tmp_path / "bad.json"
    good.write_text(json.dumps(schema))
    bad.write_text('{"type": "nonsense"}')
    run = lambda f: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "qserve", "generate", "--json-schema", str(f), "--chat",
         "--temperature", "0", "--max-tokens", "60", "Where is Paris? Answer in JSON."],
        capture_output=True, text=True, timeout=300)
    ok = run(good)
    assert ok.returncode == 0, ok.stderr
    jsonschema.validate(json.loads(ok.stdout), schema)
    err = run(bad)
    assert err.returncode != 0 and "Traceback" not in err.stderr
    assert err.stderr.strip().splitlines()[-1].startswith("error: --json-schema")


def test_tool_history_with_arguments_nested_too_deep_stays_text():
    from qserve.server.tool_calls import check_tool_history

    deep = "[" * 100_000 + "]" * 100_000  # json.loads: RecursionError
    m = {"role": "assistant", "tool_calls": [{"type": "function",
                                              "function": {"name": "f", "arguments": deep}}]}
    assert check_tool_history(m, 0) == {"tool_calls": [
        {"id": None, "type": "function", "function": {"name": "f", "arguments": deep}}]}


def test_logit_columns_past_the_tokenizer_are_never_allowed():
    """Models pad their embedding rows past the tokenizer's vocabulary; those ids have no text
    and the grammar must never allow them."""
    from qserve.loader import load_tokenizer
    from qserve.server.structured import Grammars, Structure

    tok = load_tokenizer(None)
    constraint = Grammars(tok).constraint(Structure(grammar=("json_schema", "{}")))
    V = tok.backend.get_vocab_size(with_added_tokens=True)
    logits = torch.zeros(1, V + 64)
    logits[0, V:] = 100.0  # the padded columns would win the argmax
    constraint.mask(logits, [[]])
    assert torch.isinf(logits[0, V:]).all() and torch.isfinite(logits[0, :V]).any()


def test_allows_agrees_with_the_mask():
    """`allows` (the sampler's check after a greedy or temperature-only draw) accepts exactly
    the tokens the mask leaves, and a token it accepts becomes the sample's next: a later
    mask for the longer output is the one a fresh constraint fills."""
    from qserve.loader import load_tokenizer
    from qserve.server.structured import Grammars, Structure

    tok = load_tokenizer(None)
    grammars = Grammars(tok)
    structure = Structure(grammar=("json_schema", json.dumps(PERSON)))
    ids = tok.encode('{"name": "Ann", "role": "admin", "address": {"city": "Lyon", '
                     '"country": "FR"}, "active": true}', add_special_tokens=False)
    V = tok.backend.get_vocab_size(with_added_tokens=True)
    gen = torch.Generator().manual_seed(0)
    checked, fresh = grammars.constraint(structure), grammars.constraint(structure)
    for k in range(len(ids)):
        x = torch.zeros(1, V + 8)
        fresh.mask(x, [ids[:k]])
        candidates = torch.randint(0, V + 8, (6,), generator=gen).tolist()
        for t in candidates:  # refused ones leave the state as it was
            if t != ids[k]:
                assert checked.allows([ids[:k]], [t]) == [bool(torch.isfinite(x[0, t]))], (k, t)
        assert checked.allows([ids[:k]], [ids[k]]) == [True]
    y, z = torch.zeros(1, V), torch.zeros(1, V)
    checked.mask(y, [ids])
    grammars.constraint(structure).mask(z, [ids])
    assert torch.equal(y, z)
