"""Reasoning models' thinking read apart from their answer (qserve/server/reasoning.py): the
parsers over every split of a sample answer into deltas, both formats; which format a model
gets; and the server end to end, OpenAI's reasoning_content and Ollama's thinking.

End to end, the default model (SmolLM2-135M, which never thinks) is made to write a chosen
answer: `Forcing` wraps the engine's add_request so that each request's constraint allows only
the next token of that text, then EOS. Harmony's markers are then plain text, not special
tokens, which the parser reads the same way.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from qserve.server.reasoning import (HarmonyParser, Reasoning, ThinkParser, reasoning_format,
                                     split_reasoning)

THINK = "<think>\nThe user says hi.\nGreet back.\n</think>\n\nHello! How can I help?"
THOUGHT, ANSWER = "The user says hi.\nGreet back.", "Hello! How can I help?"
OPENED = "Two and two.\n\n</think>\n\nIt is 4."  # the prompt opened <think> (DeepSeek-R1)
HARMONY = ("<|channel|>analysis<|message|>User wants a greeting.<|end|><|start|>assistant"
           "<|channel|>final<|message|>Hello! How can I help?")
CALL_ARGS = '{"city": "Oslo", "unit": "celsius"}'
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
                "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                + CALL_ARGS)
# a Qwen3-style template: thinking unless enable_thinking is false (written for this test)
QWEN3_LIKE = """\
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""
# DeepSeek-R1's way: the generation prompt opens <think>
R1_LIKE = QWEN3_LIKE.replace("{% if enable_thinking", "<think>\n{% if enable_thinking")


def stream(parser, pieces: list[str]) -> tuple[str, str]:
    """(thinking, content) handed out over `pieces` and finish()."""
    thinking, content = "", ""
    for piece in pieces:
        t, c = parser.feed(piece)
        thinking, content = thinking + t, content + c
    t, c = parser.finish()
    return thinking + t, content + c


def splits(text: str):
    """Every way to cut `text` into two and into three deltas, and one character at a time."""
    n = len(text)
    for i in range(n + 1):
        yield [text[:i], text[i:]]
        for j in range(i, n + 1, 3):
            yield [text[:i], text[i:j], text[j:]]
    yield list(text)


# ---- the parsers ------------------------------------------------------------------------
@pytest.mark.parametrize("text, opened, want", [
    (THINK, False, (THOUGHT, ANSWER)),
    (OPENED, True, ("Two and two.", "It is 4.")),
    ("  An answer that mentions </think> and <think>.", False,
     ("", "  An answer that mentions </think> and <think>.")),
    ("<think>\n\n</think>\n\nNo thought.", False, ("", "No thought.")),  # enable_thinking off
    ("<think>\nCut short while thin", False, ("Cut short while thin", "")),  # a length cut
    ("Cut short while thin", True, ("Cut short while thin", "")),
])
def test_think_parser_over_every_split(text, opened, want):
    """The deltas join to the whole-text form, wherever the text is cut, <think> and
    </think> included; whitespace around the thinking goes, text without it stays as written."""
    for pieces in splits(text):
        assert stream(ThinkParser(opened), pieces) == want, pieces
    thinking, content = split_reasoning(text, Reasoning("think", opened=opened))
    assert (thinking or "", content) == want


def test_thinking_streams_as_it_comes():
    """Only a possible marker (and whitespace that may lead </think>) is held back."""
    parser = ThinkParser()
    assert parser.feed("<thi") == ("", "")
    assert parser.feed("nk>\nThe user ") == ("The user", "")
    assert parser.feed("says hi.</th") == (" says hi.", "")
    assert parser.feed("ink>\n\nHel") == ("", "Hel")
    assert parser.feed("lo") == ("", "lo")


@pytest.mark.parametrize("text, want, calls", [
    (HARMONY, ("User wants a greeting.", "Hello! How can I help?"), []),
    (HARMONY_CALL, ("Need the weather.", ""), [("get_weather", CALL_ARGS)]),
    # the header as the template writes an earlier call; a preamble on commentary is content
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_time"
     "<|channel|>commentary json<|message|>{}", ("", "Checking."), [("get_time", "{}")]),
    # a message to a built-in tool is dropped; arguments cut short are no call
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis to=browser."
     "search<|message|>{\"q\": 1}<|call|>", ("a", ""), []),
    (HARMONY_CALL[:-3], ("Need the weather.", ""), []),
    ("Plain text, no harmony.", ("", "Plain text, no harmony."), []),
])
def test_harmony_parser_over_every_split(text, want, calls):
    for pieces in splits(text):
        parser = HarmonyParser()
        assert stream(parser, pieces) == want, pieces
        assert [(c["function"]["name"], c["function"]["arguments"])
                for c in parser.calls] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in parser.calls)


def test_answer_parser_reads_tool_calls_in_the_content_only():
    """Thinking first, then the tool-call parser on the content alone: a call written inside
    the thinking is no call. Harmony's calls come from its parser, whole, once complete."""
    from qserve.server.structured import HERMES, parse_structure
    from qserve.server.tool_calls import AnswerParser

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    s = parse_structure({"tools": [weather]}, chat=True)
    call = HERMES.write("get_weather", {"city": "Oslo"})
    text = f"<think>\nMaybe {call} later.\n</think>\n\n{call}"
    for pieces in splits(text):
        parser = AnswerParser(Reasoning("think"), s, HERMES)
        thinking, content, args = "", "", ""
        for piece in pieces + [None]:
            t, c, deltas = parser.feed(piece) if piece is not None else parser.finish()
            thinking, content = thinking + t, content + c
            args += "".join(d["function"]["arguments"] for d in deltas)
        assert (thinking, content, args) == (f"Maybe {call} later.", "", '{"city": "Oslo"}')
    thinking, content, calls = parser.message()
    assert thinking == f"Maybe {call} later." and content is None
    assert [c["function"]["name"] for c in calls] == ["get_weather"]

    for pieces in splits(HARMONY_CALL):
        parser = AnswerParser(Reasoning("harmony", special=True), s, HERMES)
        deltas = [d for p in pieces for d in parser.feed(p)[2]] + parser.finish()[2]
        assert [(d["index"], d["function"]["name"], d["function"]["arguments"])
                for d in deltas] == [(0, "get_weather", CALL_ARGS)]
    assert parser.message() == ("Need the weather.", None, parser.calls)


# ---- which format a model gets ------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    from qserve.loader import load_tokenizer

    return load_tokenizer(None)


def _with_template(tok, template: str):
    from qserve.loader import Tokenizer

    return Tokenizer(tok.backend, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     extra_eos_ids=sorted(tok.eos_token_ids), chat_template=template)


def _harmony_tokenizer():
    """A tiny vocabulary with gpt-oss's special tokens, and its chat template."""
    from tokenizers import AddedToken, Tokenizer as Backend, models, pre_tokenizers

    from qserve.loader import Tokenizer

    backend = Backend(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True) for t in (
        "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
        "<|constrain|>")])
    return Tokenizer(backend, chat_template="{% for m in messages %}<|start|>{{ m.role }}"
                     "<|message|>{{ m.content }}<|end|>{% endfor %}<|start|>assistant")


def test_auto_detects_the_format(tok):
    assert reasoning_format("auto", tok) is None  # SmolLM2's ChatML: no thinking
    assert reasoning_format("think", tok) == Reasoning("think")
    assert reasoning_format("auto", _with_template(tok, QWEN3_LIKE)) == Reasoning("think")
    harmony = _harmony_tokenizer()
    assert reasoning_format("auto", harmony) == Reasoning("harmony", special=True)
    assert reasoning_format("none", harmony) is None


def test_the_prompt_says_whether_thinking_is_open(tok):
    """R1's generation prompt opens <think>; Qwen3's does not, nor with enable_thinking
    false, which the request's template variables reach."""
    from qserve.server.structured import HERMES, Structure
    from qserve.server.tool_calls import render_chat

    ask = [{"role": "user", "content": "hi"}]
    for template, opened in ((QWEN3_LIKE, False), (R1_LIKE, True)):
        t = _with_template(tok, template)
        ids = t.encode(render_chat(t, ask, Structure(), HERMES), add_special_tokens=False)
        assert reasoning_format("auto", t).for_prompt(t, ids).opened is opened
    t = _with_template(tok, QWEN3_LIKE)
    off = render_chat(t, ask, Structure(), HERMES, {"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = t.encode(off, add_special_tokens=False)
    assert not Reasoning("think").for_prompt(t, ids).opened


@pytest.mark.parametrize("name, kind, opened", [
    ("Qwen-Qwen3-0.6B", "think", False),
    ("Qwen3.5-4B", "think", True),
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "think", True),
    ("HuggingFaceTB-SmolLM3-3B", "think", False),
    ("openai-gpt-oss-120b", "harmony", False),
    ("meta-llama-Llama-3.1-8B-Instruct", None, False),
])
def test_real_templates(tok, name, kind, opened):
    """llama.cpp's collection of real chat templates, where it is unpacked (scripts/peer.py)."""
    from test_server_tools import _vendored_templates

    folder = _vendored_templates()
    if folder is None or not (folder / f"{name}.jinja").exists():
        pytest.skip("llama.cpp's templates are not unpacked (scripts/peer.py)")
    source = (folder / f"{name}.jinja").read_text()
    if kind == "harmony":
        from qserve.loader import Tokenizer

        t = Tokenizer(_harmony_tokenizer().backend, chat_template=source)
    else:
        t = _with_template(tok, source)
    found = reasoning_format("auto", t)
    assert (found and found.kind) == kind
    if found is not None:
        text = t.apply_chat_template([{"role": "user", "content": "hi"}])
        assert found.for_prompt(t, t.encode(text, add_special_tokens=False)).opened is opened


# ---- bad input ----------------------------------------------------------------------------
def test_an_unknown_parser_is_a_one_line_error():
    from test_cli import assert_user_error, invoke

    from qserve.errors import ConfigError
    from qserve.server.config import ServerConfig

    for command in ("serve", "chat"):
        assert_user_error(invoke(command, "--reasoning-parser", "deepseek"), "'deepseek'",
                          "auto", "harmony")
    with pytest.raises(ConfigError, match="--reasoning-parser 'x' is not one of auto, none"):
        ServerConfig(reasoning_parser="x")


def test_chat_template_kwargs_are_checked():
    from qserve.server import protocol as P

    ask = {"messages": [{"role": "user", "content": "hi"}]}
    assert P.parse_chat(ask | {"chat_template_kwargs": {"enable_thinking": False}}
                        ).template_kwargs == {"enable_thinking": False}
    for value, words in (([1], "must be an object"), ({"messages": []}, "may not set")):
        with pytest.raises(P.APIError) as e:
            P.parse_chat(ask | {"chat_template_kwargs": value})
        assert e.value.status == 400 and words in e.value.message


# ---- end to end ---------------------------------------------------------------------------
class Forced:
    """A TokenConstraint that allows one token a step: `ids`, then `eos`."""

    def __init__(self, ids: list[int], eos: int):
        self.ids = ids + [eos]

    def _next(self, out: list[int]) -> int:
        return self.ids[min(len(out), len(self.ids) - 1)]

    def mask(self, logits, outputs):
        for r, out in enumerate(outputs):
            t = self._next(out)
            keep = logits[r, t].clone()
            logits[r] = float("-inf")
            logits[r, t] = keep

    def allows(self, outputs, tokens):
        return [t == self._next(out) for out, t in zip(outputs, tokens)]


class Forcing:
    """Makes an engine's model write `text` (then EOS) whatever it is asked, by giving every
    request it adds a Forced constraint (replacing any grammar)."""

    def __init__(self, engine):
        self.text = ""
        self.tok, add = engine.tokenizer, engine.add_request
        eos = min(self.tok.eos_token_ids)

        def add_request(rid, prompt, params, **kw):
            ids = self.tok.encode(self.text, add_special_tokens=False)
            return add(rid, prompt, dataclasses.replace(params, constraint=Forced(ids, eos)),
                       **kw)
        engine.add_request = add_request

    def tokens(self, text: str) -> int:
        """The completion tokens of `text`: its own and EOS."""
        return len(self.tok.encode(text, add_special_tokens=False)) + 1


def _server(native_model, parser: str, template: str | None = None):
    pytest.importorskip("fastapi")
    from test_structured_outputs import InProcessServer, make_served_engine

    model = native_model
    if template is not None:
        model = dataclasses.replace(native_model,
                                    tokenizer=_with_template(native_model.tokenizer, template))
    engine = make_served_engine(model, kv_cache_memory="48MiB", enable_prefix_caching=False)
    forcing = Forcing(engine)
    srv = InProcessServer(engine, reasoning_parser=parser)
    return srv, forcing


@pytest.fixture(scope="module")
def thinker(native_model):
    """The default model with a Qwen3-style template: `auto` finds the think format."""
    srv, forcing = _server(native_model, "auto", QWEN3_LIKE)
    yield srv, forcing
    srv.stop()


@pytest.fixture(scope="module")
def harmony(native_model):
    srv, forcing = _server(native_model, "harmony")
    yield srv, forcing
    srv.stop()


@pytest.fixture(scope="module")
def plain(native_model):
    srv, forcing = _server(native_model, "none", QWEN3_LIKE)
    yield srv, forcing
    srv.stop()


ASK = [{"role": "user", "content": "Hi!"}]
MODEL = "smollm2-135m-instruct"  # the name InProcessServer serves
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}


def _client(srv):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)


def _streamed(chunks) -> dict[int, list]:
    """choice index -> [thinking, content, finish_reason] joined over a stream's chunks."""
    got: dict[int, list] = {}
    for ch in chunks:
        for c in ch.choices:
            g = got.setdefault(c.index, ["", "", None])
            g[0] += getattr(c.delta, "reasoning_content", None) or ""
            g[1] += c.delta.content or ""
            g[2] = c.finish_reason or g[2]
    return got


@pytest.mark.parametrize("which, text", [("thinker", THINK), ("harmony", HARMONY)])
def test_openai_reasoning_content(which, text, request):
    """The thinking in message.reasoning_content, the answer in content, whole and streamed
    (n=2: each choice its own parser); usage counts every generated token."""
    srv, forcing = request.getfixturevalue(which)
    forcing.text = text
    client = _client(srv)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80)
    msg = r.choices[0].message
    want = THOUGHT if which == "thinker" else "User wants a greeting."
    assert (msg.reasoning_content, msg.content) == (want, ANSWER)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == forcing.tokens(text)
    got = _streamed(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80,
                                                   stream=True, n=2))
    assert got == {0: [want, ANSWER, "stop"], 1: [want, ANSWER, "stop"]}


def test_none_leaves_the_text_as_generated(plain):
    srv, forcing = plain
    forcing.text = THINK
    msg = _client(srv).chat.completions.create(model=MODEL, messages=ASK,
                                               max_tokens=80).choices[0].message
    assert msg.content == THINK and getattr(msg, "reasoning_content", None) is None


@pytest.mark.parametrize("which, text", [
    ("thinker", "<think>\nMaybe <tool_call> later.\n</think>\n\n<tool_call>\n"
                f'{{"name": "get_weather", "arguments": {CALL_ARGS}}}\n</tool_call>'),
    ("harmony", HARMONY_CALL),
])
@pytest.mark.parametrize("streamed", [False, True])
def test_tool_calls_come_from_the_content(which, text, streamed, request):
    """Thinking, then a call: the call in tool_calls (harmony's own form too), the thinking in
    reasoning_content, finish_reason tool_calls."""
    srv, forcing = request.getfixturevalue(which)
    forcing.text = text
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=120)
    if streamed:
        thinking, args, reasons = "", "", []
        for ch in _client(srv).chat.completions.create(stream=True, **kw):
            for c in ch.choices:
                thinking += getattr(c.delta, "reasoning_content", None) or ""
                assert not c.delta.content
                args += "".join(d.function.arguments or "" for d in c.delta.tool_calls or [])
                reasons.append(c.finish_reason)
        assert reasons[-1] == "tool_calls"
    else:
        choice = _client(srv).chat.completions.create(**kw).choices[0]
        thinking = choice.message.reasoning_content
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and choice.message.content is None
        assert choice.finish_reason == "tool_calls"
        args = call.function.arguments
    assert json.loads(args) == json.loads(CALL_ARGS)
    assert thinking == ("Maybe <tool_call> later." if which == "thinker" else "Need the weather.")


def test_template_variables_reach_the_template(thinker):
    """chat_template_kwargs (vLLM's): enable_thinking false renders Qwen3's empty thinking."""
    httpx = pytest.importorskip("httpx")
    srv, _ = thinker

    def count(**extra) -> int:
        r = httpx.post(srv.url + "/tokenize", json={"messages": ASK, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["count"]
    off = srv.engine.tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    assert count(chat_template_kwargs={"enable_thinking": False}) == count() + len(off)


def test_ollama_thinking(thinker):
    """/api/chat's message.thinking and /api/generate's thinking, whole and streamed; think
    false renders the template without thinking and leaves thinking out; a think that is
    not a boolean or an effort is a 400."""
    ollama = pytest.importorskip("ollama")
    srv, forcing = thinker
    forcing.text = THINK
    client = ollama.Client(host=srv.url)
    r = client.chat(model=MODEL, messages=ASK, think=True)
    assert (r.message.thinking, r.message.content) == (THOUGHT, ANSWER)
    parts = list(client.chat(model=MODEL, messages=ASK, think=True, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == THOUGHT
    assert "".join(p.message.content for p in parts) == ANSWER and parts[-1].done
    g = client.generate(model=MODEL, prompt="Hi!")
    assert (g.thinking, g.response) == (THOUGHT, ANSWER)
    off = client.chat(model=MODEL, messages=ASK, think=False)
    assert off.message.thinking is None and off.message.content == ANSWER
    assert off.prompt_eval_count > r.prompt_eval_count  # the template's empty thinking
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=ASK, think="maybe")
    assert e.value.status_code == 400 and "'think' must be true, false" in e.value.error
    assert "thinking" in client.show(MODEL).capabilities


def test_ollama_think_on_a_model_that_does_not(plain):
    ollama = pytest.importorskip("ollama")
    srv, _ = plain
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=srv.url).chat(model=MODEL, messages=ASK, think=True)
    assert e.value.status_code == 400 and "does not support thinking" in e.value.error
