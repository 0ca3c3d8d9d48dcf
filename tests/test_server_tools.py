"""Tool calls (issue 17): the model's own chat template for tools, tool-call arguments streamed
as OpenAI deltas, and response_format together with tools.

The default model's template (SmolLM2-135M's plain ChatML) ignores `tools`, so the tests that
need a template which lists them use one written here, in Qwen's `<tool_call>` style, served
through a second engine over the same weights; a Llama-3-style template checks the format
detection and the Llama JSON call format.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytest.importorskip("fastapi")

from test_structured_outputs import (MODEL, TIME, WEATHER, InProcessServer,  # noqa: E402
                                     make_served_engine)

# A template that lists tools, Qwen-style tags (written for this test).
TAGS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}

# Tools
You may call these functions:
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>
Write each call as <tool_call>
{"name": NAME, "arguments": ARGUMENTS}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}
{%- elif m.role == 'tool' %}<|im_start|>user
<tool_response name="{{ m.name }}">
{{ m.content }}
</tool_response><|im_end|>
{% elif m.tool_calls %}<|im_start|>assistant
{{ m.content }}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# A Llama-3.1-style template: tools as JSON, calls as {"name": ..., "parameters": ...}.
LLAMA_TEMPLATE = """\
{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>

Answer a function call as {"name": function name, "parameters": dictionary of arguments}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>{% endif %}
{%- for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>

{% if m.tool_calls %}{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

REPO = Path(__file__).resolve().parent.parent
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
WEATHER_ARGS = WEATHER["function"]["parameters"]


def _with_template(tok, template: str):
    from qserve.loader import Tokenizer

    return Tokenizer(tok.backend, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     extra_eos_ids=sorted(tok.eos_token_ids), chat_template=template)


@pytest.fixture(scope="module")
def tok():
    from qserve.loader import load_tokenizer

    return load_tokenizer(None)


# ---- the prompt -------------------------------------------------------------------------
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


def _structure(body):
    from qserve.server.structured import parse_structure

    return parse_structure(body, chat=True)


def test_a_template_that_lists_tools_renders_them_the_calls_and_the_results(tok):
    from qserve.server.structured import HERMES, tool_format
    from qserve.server.tool_calls import render_chat

    t = _with_template(tok, TAGS_TEMPLATE)
    assert t.chat_template_renders_tools and not tok.chat_template_renders_tools
    assert tool_format(t) is HERMES
    s = _structure({"tools": [WEATHER, TIME]})
    text = render_chat(t, HISTORY, s, HERMES)
    assert "# Tools" in text and "You can call these functions" not in text
    assert json.dumps(WEATHER, ensure_ascii=False) in text  # the definition, description too
    assert '"name": "get_time", "description": ""' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": ' \
           '"celsius"}}\n</tool_call>' in text
    # the result carries the name of the call it answers (OpenAI sends only the id)
    assert '<tool_response name="get_weather">\n{"temp": 21}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")
    # tool_choice "none": no definitions, the history still through the model's template
    none = render_chat(t, HISTORY, _structure({"tools": [WEATHER], "tool_choice": "none"}),
                       HERMES)
    assert "# Tools" not in none and '<tool_response name="get_weather">' in none


def test_a_template_without_tools_gets_qserves_rendering(tok):
    from qserve.server.structured import HERMES, tool_format
    from qserve.server.tool_calls import render_chat

    assert tool_format(tok) is HERMES
    text = render_chat(tok, HISTORY, _structure({"tools": [WEATHER]}), HERMES)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou can call these functions")
    assert '"description": "The weather in a city"' in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo", "unit": "celsius"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>" in text


def test_a_llama_template_selects_llamas_json_call_format(tok):
    from qserve.server.structured import LLAMA3_JSON, tool_format
    from qserve.server.tool_calls import render_chat

    t = _with_template(tok, LLAMA_TEMPLATE)
    assert tool_format(t) is LLAMA3_JSON
    text = render_chat(t, HISTORY, _structure({"tools": [WEATHER]}), LLAMA3_JSON)
    assert '"name": "get_weather"' in text.split("<|eot_id|>")[0]
    assert ('{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}'
            in text)
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n{\"temp\": 21}" in text


def _vendored_templates() -> Path | None:
    """llama.cpp's collection of real chat templates (scripts/peer.py's source), if unpacked."""
    spec = importlib.util.spec_from_file_location("peer", REPO / "scripts" / "peer.py")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    try:
        return peer.source_dir(download=False) / "models" / "templates"
    except peer.PeerError:
        return None


@pytest.mark.parametrize("name, renders, fmt_name", [
    ("TAGS_TEMPLATE", True, "HERMES"),
    ("LLAMA_TEMPLATE", True, "LLAMA3_JSON"),
    ("Qwen-Qwen2.5-7B-Instruct", True, "HERMES"),
    ("Qwen-Qwen3-0.6B", True, "HERMES"),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", True, "HERMES"),
    ("meta-llama-Llama-3.1-8B-Instruct", True, "LLAMA3_JSON"),
    ("meta-llama-Llama-3.2-3B-Instruct", True, "LLAMA3_JSON"),
    ("meta-llama-Llama-3.3-70B-Instruct", True, "LLAMA3_JSON"),
    ("HuggingFaceTB-SmolLM3-3B", False, "HERMES"),  # llama.cpp's copy has no tools block
])
def test_the_template_path_renders_as_transformers_does(tok, name, renders, fmt_name):
    """With tools, history calls and a tool result, the prompt equals transformers'
    apply_chat_template(..., tools=...) on the same template (real ones from llama.cpp's
    collection where it is unpacked); the call format is the one the template teaches."""
    transformers = pytest.importorskip("transformers")
    from qserve.server import structured
    from qserve.server.tool_calls import _name_tool_results, render_chat

    if name.isupper():
        source = globals()[name]
    else:
        folder = _vendored_templates()
        if folder is None or not (folder / f"{name}.jinja").exists():
            pytest.skip("llama.cpp's templates are not unpacked (scripts/peer.py)")
        source = (folder / f"{name}.jinja").read_text()
    t = _with_template(tok, source)
    fmt = structured.tool_format(t)
    assert t.chat_template_renders_tools == renders and fmt is getattr(structured, fmt_name)
    if not renders:
        return
    structure = _structure({"tools": [WEATHER, TIME]})  # TIME has no description
    tools = [tool.openai() for tool in structure.tools]
    history = [{"role": "system", "content": "Be brief."}] + HISTORY
    ours = render_chat(t, history, structure, fmt)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend)
    theirs = hf.apply_chat_template(_name_tool_results(history), tools=tools,
                                    chat_template=source, tokenize=False,
                                    add_generation_prompt=True, bos_token=t.bos_token,
                                    eos_token=t.eos_token)
    assert ours == theirs


# ---- reading calls back -----------------------------------------------------------------
@pytest.mark.parametrize("fmt_name", ["HERMES", "LLAMA3_JSON"])
def test_streamed_fragments_join_to_the_whole_answer(fmt_name):
    """Fed a character, three or all at once, the parser gives the same content and calls;
    braces and quotes inside JSON strings do not end the arguments early."""
    from qserve.server import structured
    from qserve.server.tool_calls import ToolCallParser, parse_tool_calls

    fmt = getattr(structured, fmt_name)
    s = _structure({"tools": [WEATHER, TIME]})
    w = fmt.write("get_weather", {"city": 'O{s}"lo]', "unit": "celsius"})
    t = fmt.write("get_time", {"zone": "UTC"})
    text = f"Let me look. {w}\n{t}\n"
    for step in (1, 3, len(text)):
        parser, content, args, firsts = ToolCallParser(s, fmt), "", {}, []
        for i in range(0, len(text), step):
            c, deltas = parser.feed(text[i:i + step])
            content += c
            for d in deltas:
                if "id" in d:
                    firsts.append(d)
                args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
        c, deltas = parser.finish()
        assert c == "" and deltas == []
        assert content == "Let me look. "
        assert [(d["index"], d["type"], d["function"]["name"]) for d in firsts] == [
            (0, "function", "get_weather"), (1, "function", "get_time")]
        assert all(d["id"].startswith("call_") for d in firsts)
        assert json.loads(args[0]) == {"city": 'O{s}"lo]', "unit": "celsius"}
        assert json.loads(args[1]) == {"zone": "UTC"}
    content, calls = parse_tool_calls(text, s, fmt)
    assert content == "Let me look."
    assert [c["function"]["arguments"] for c in calls] == [args[0], args[1]]
    assert parse_tool_calls("no call {here}", s, fmt) == ("no call {here}", [])


def test_a_call_cut_short_is_no_call():
    from qserve.server.structured import HERMES
    from qserve.server.tool_calls import ToolCallParser, parse_tool_calls

    s = _structure({"tools": [WEATHER]})
    whole = HERMES.write("get_weather", {"city": "Oslo", "unit": "celsius"})
    for cut in (len(whole) - 3, len(whole) - 20):  # in the close tag, in the arguments
        parser = ToolCallParser(s, HERMES)
        content, deltas = parser.feed("Hi " + whole[:cut])
        parser.finish()
        assert content == "Hi " and deltas[0]["function"]["name"] == "get_weather"
        assert parser.message() == ("Hi " + whole[:cut], [])
    # text the grammar would not have written after the arguments: no call, all content
    odd = whole.replace("}\n</tool_call>", "} and more")
    assert parse_tool_calls(odd + " " + whole, s, HERMES) == (odd + " " + whole, [])


# ---- the grammar: response_format with tools ----------------------------------------------
@pytest.mark.parametrize("fmt_name", ["HERMES", "LLAMA3_JSON"])
def test_response_format_with_tools(tok, fmt_name):
    """auto: the answer is the response_format's JSON or calls, nothing else; required or a
    named function: calls only (the tool grammar wins)."""
    import xgrammar as xgr

    from qserve.server import structured

    fmt = getattr(structured, fmt_name)
    grammars = structured.Grammars(tok, fmt)
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
    call = fmt.write("get_weather", {"city": "Oslo", "unit": "celsius"})
    two = call + fmt.separator + fmt.write("get_time", {"zone": "UTC"})
    eos = sorted(tok.eos_token_ids)[0]

    def accepts(body, text):
        constraint = grammars.constraint(_structure(dict(body, response_format=rf)))
        m = xgr.GrammarMatcher(constraint.compiled)
        return m.accept_string(text) and m.accept_token(eos)

    auto = {"tools": [WEATHER, TIME]}
    assert accepts(auto, '{"answer": "yes"}') and accepts(auto, call) and accepts(auto, two)
    for wrong in ('{"answer": "maybe"}', "yes", "Sure. " + call, '{"answer":"yes"}'):
        assert not accepts(auto, wrong), wrong
    required = dict(auto, tool_choice="required")
    assert accepts(required, call) and not accepts(required, '{"answer": "yes"}')
    assert not accepts(dict(required, parallel_tool_calls=False), two)
    named = dict(auto, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert not accepts(named, call) and not accepts(named, '{"answer": "yes"}')
    assert accepts(named, fmt.write("get_time", {"zone": "CET"}))


def test_parameters_that_are_not_an_object_schema_are_a_400():
    from qserve.server.structured import StructureError

    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    with pytest.raises(StructureError) as e:
        _structure({"tools": [bad]})
    assert e.value.param == "tools"
    ok = {"type": "function", "function": {"name": "f", "parameters": {"properties": {}}}}
    assert _structure({"tools": [ok]}).tools[0].parameters["type"] == "object"


# ---- over HTTP ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(native_model):
    srv = InProcessServer(make_served_engine(native_model, kv_cache_memory="48MiB",
                                             enable_prefix_caching=False))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def served_tags(native_model):
    """The same weights, served with a chat template that lists tools."""
    model = dataclasses.replace(native_model,
                                tokenizer=_with_template(native_model.tokenizer, TAGS_TEMPLATE))
    srv = InProcessServer(make_served_engine(model, kv_cache_memory="48MiB",
                                             enable_prefix_caching=False))
    yield srv
    srv.stop()


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)


ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.mark.parametrize("which", ["served", "served_tags"])
def test_arguments_stream_as_fragments(which, request):
    """stream=true: a call's first delta has index, id, type, name and the arguments so far
    (empty, or what the same step wrote); the rest follow in several fragments, and all of
    them joined validate; the last chunk's finish_reason is "tool_calls"."""
    srv = request.getfixturevalue(which)
    stream = _client(srv).chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=80,
        temperature=0, stream=True, parallel_tool_calls=False)
    chunks = [ch.choices[0] for ch in stream if ch.choices]
    deltas = [d for c in chunks for d in c.delta.tool_calls or []]
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather")
    assert first.id.startswith("call_") and first.function.arguments in ("", "{", '{"')
    assert len(rest) >= 3 and all(d.index == 0 and d.id is None and d.function.name is None
                                  for d in rest)
    args = "".join(d.function.arguments for d in deltas)
    jsonschema.validate(json.loads(args), WEATHER_ARGS)
    assert chunks[-1].finish_reason == "tool_calls"
    assert not any(c.delta.content for c in chunks)


def test_openai_stream_helper_accepts_the_deltas(served_tags):
    """client.chat.completions.stream (the SDK's accumulator and events) with a strict
    pydantic tool: it sees argument deltas and parses the final arguments into the model."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        city: str = Field(max_length=16)
        unit: Literal["celsius", "fahrenheit"]

    kinds = []
    with _client(served_tags).chat.completions.stream(
            model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)],
            tool_choice="required", max_tokens=80, temperature=0,
            parallel_tool_calls=False) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_completion()
    assert kinds.count("tool_calls.function.arguments.delta") >= 3
    assert "tool_calls.function.arguments.done" in kinds
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_the_template_is_what_the_server_renders(served_tags):
    """The prompt the server tokenizes is the model's own template with the tools (its token
    count), not qserve's system-prompt rendering; a tool round trip goes through it too."""
    from qserve.server.structured import HERMES
    from qserve.server.tool_calls import render_chat

    tok = served_tags.engine.tokenizer
    body = {"model": MODEL, "messages": HISTORY[:1], "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": 60, "temperature": 0}
    r = httpx.post(served_tags.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    s = _structure(body)
    want = len(tok.encode(render_chat(tok, HISTORY[:1], s, HERMES), add_special_tokens=False))
    assert r.json()["usage"]["prompt_tokens"] == want
    assert "# Tools" in render_chat(tok, HISTORY[:1], s, HERMES)
    msg = r.json()["choices"][0]["message"]
    (call,) = msg["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_ARGS)

    history = HISTORY[:1] + [
        {"role": "assistant", "content": None, "tool_calls": [dict(call)]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temp": 21}'}]
    r = httpx.post(served_tags.url + "/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": history, "tools": [WEATHER], "max_tokens": 8,
        "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_and_tools_over_http(served, stream):
    """auto: a well-formed answer either way (content that validates against response_format,
    or calls); required: calls, whatever response_format says."""
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    client = _client(served)
    ask = [{"role": "user", "content": "Is it sunny in Oslo? Answer yes or no as JSON."}]
    for choice, n in (("auto", 2), ("required", 1)):
        kw = dict(model=MODEL, messages=ask, tools=[WEATHER], tool_choice=choice,
                  response_format=rf, max_tokens=80, temperature=0.8, seed=3, n=n,
                  parallel_tool_calls=False)
        if stream:
            content, args, reasons = {}, {}, {}
            for ch in client.chat.completions.create(stream=True, **kw):
                for c in ch.choices:
                    content[c.index] = content.get(c.index, "") + (c.delta.content or "")
                    for d in c.delta.tool_calls or []:
                        args[c.index] = args.get(c.index, "") + (d.function.arguments or "")
                    reasons[c.index] = c.finish_reason or reasons.get(c.index)
            answers = [(content.get(i) or None, args.get(i), reasons[i]) for i in range(n)]
        else:
            r = client.chat.completions.create(**kw)
            answers = [(c.message.content,
                        c.message.tool_calls and c.message.tool_calls[0].function.arguments,
                        c.finish_reason) for c in r.choices]
        for content, arguments, reason in answers:
            if arguments:
                assert reason == "tool_calls" and content is None
                jsonschema.validate(json.loads(arguments), WEATHER_ARGS)
            else:
                assert choice == "auto" and reason == "stop"
                jsonschema.validate(json.loads(content), ANSWER)
