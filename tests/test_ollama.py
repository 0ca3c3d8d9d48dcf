"""Ollama's requests as the OpenAI requests they mean (qserve/server/ollama.py), without a model:
options, num_predict, format, a templated or raw /api/generate, tool calls both ways, and
what is refused. (The routes through the ollama client against a live server:
test_server.py.)"""
import json

import pytest

from qserve.server import ollama as O
from qserve.server import protocol as P


def test_options_and_format():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "format": "json",
            "options": {"temperature": 0.2, "top_k": 5, "repeat_penalty": 1.1, "seed": 3,
                        "num_predict": 7, "stop": ["\n"], "num_ctx": 4096}}
    oa = O.openai_request(body, chat=True)
    assert oa == {"model": "m", "stream": True, "temperature": 0.2, "top_k": 5,
                  "repetition_penalty": 1.1, "seed": 3, "stop": ["\n"], "max_tokens": 7,
                  "response_format": {"type": "json_object"},
                  "messages": [{"role": "user", "content": "hi"}]}
    req = P.parse_chat(oa)  # what protocol.py makes of it
    assert (req.params.temperature, req.params.top_k, req.max_tokens) == (0.2, 5, 7)
    assert req.stream and req.structure.grammar is not None
    schema = {"type": "object"}
    oa = O.openai_request(body | {"format": schema, "options": {"num_predict": -1}}, chat=True)
    assert oa["response_format"] == {"type": "json_schema",
                                     "json_schema": {"name": "format", "schema": schema}}
    assert "max_tokens" not in oa  # -1: as many as the context leaves


def test_generate_is_templated_unless_raw():
    body = {"model": "m", "prompt": "Why?", "system": "Be brief.", "stream": False}
    assert O.openai_request(body, chat=False)["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    raw = O.openai_request(body | {"raw": True}, chat=False)
    assert raw["prompt"] == "Why?" and "messages" not in raw and raw["stream"] is False


def test_tool_calls_both_ways():
    history = {"role": "assistant", "content": "",
               "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]}
    oa = O.openai_request({"messages": [history], "tools": [{"type": "function",
                                                              "function": {"name": "f"}}]},
                          chat=True)
    [call] = oa["messages"][0]["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": json.dumps({"x": 1})}
    assert oa["tools"][0]["function"]["name"] == "f"
    answer = [{"id": "call_0", "type": "function",
               "function": {"name": "f", "arguments": '{"x": 2}'}}]
    assert O._calls(answer) == [{"function": {"name": "f", "arguments": {"x": 2}}}]


def test_think_reaches_the_template():
    """`think` becomes the template's enable_thinking (Qwen3's switch), an effort gpt-oss's
    reasoning_effort; a raw prompt has no template to tell."""
    ask = {"messages": [{"role": "user", "content": "hi"}]}
    assert "chat_template_kwargs" not in O.openai_request(ask, chat=True)
    assert O.openai_request(ask | {"think": False}, chat=True)["chat_template_kwargs"] == {
        "enable_thinking": False}
    high = O.openai_request(ask | {"think": "high"}, chat=True)
    assert P.parse_chat(high).template_kwargs == {"enable_thinking": True,
                                                  "reasoning_effort": "high"}
    raw = O.openai_request({"prompt": "x", "raw": True, "think": True}, chat=False)
    assert "chat_template_kwargs" not in raw


@pytest.mark.parametrize("body, words", [
    ({"prompt": "x", "think": "yes"}, "'think' must be true, false, \"low\""),
    ({"prompt": "x", "think": 1}, "not 1"),
    ({"prompt": "x", "images": ["AAAA"]}, "images are not served"),
    ({"prompt": "x", "suffix": "}"}, "'suffix' is not supported"),
    ({"prompt": "x", "template": "{{ .Prompt }}"}, "'template' is not supported"),
    ({"prompt": "x", "options": [1]}, "'options' must be an object"),
    ({"prompt": "x", "format": "yaml"}, "'format' must be \"json\" or a JSON schema"),
])
def test_refusals(body, words):
    with pytest.raises(O.OllamaError) as e:
        O.openai_request(body, chat=False)
    assert e.value.status == 400 and words in e.value.message
