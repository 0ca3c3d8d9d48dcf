"""Chat templates: a model's Jinja template, rendered the way Hugging Face transformers does.

Same environment as transformers' `apply_chat_template`: a sandbox that cannot mutate its inputs,
`trim_blocks` and `lstrip_blocks`, loop controls, a `tojson` that keeps non-ASCII text, and the
globals `raise_exception` and `strftime_now`.
"""
from __future__ import annotations

import json
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from qserve.errors import ModelLoadError, QServeError

# Used when a model ships no template: ChatML, as SmolLM2 and Qwen2 speak it.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """One compiled template. `render` turns a message list into the prompt text."""

    def __init__(self, source: str):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"the model's chat template does not compile: {e} "
                                 f"(line {e.lineno})") from None
        self.source = source
        self._renders_tools: bool | None = None

    @property
    def renders_tools(self) -> bool:
        """Whether the template writes tool definitions into the prompt (Llama 3.1+, Qwen 2.5+
        do; a plain ChatML template ignores `tools`): a probe tool's name must show up."""
        if self._renders_tools is None:
            probe = "qserve_probe_tool"
            tool = {"type": "function", "function": {
                "name": probe, "description": "probe",
                "parameters": {"type": "object", "properties": {}}}}
            try:
                text = self.render([{"role": "user", "content": "hi"}], True, tools=[tool])
            except QServeError:
                text = ""
            self._renders_tools = probe in text
        return self._renders_tools

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, **special_tokens: str | None) -> str:
        """messages: [{"role": "user", "content": "..."}, ...]; tools: OpenAI's function
        definitions ({"type": "function", "function": {...}}), for templates that list them;
        special_tokens: bos_token=..., eos_token=... as the template expects them."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, documents=None, **special_tokens)
        except jinja2.TemplateError as e:  # raise_exception(), e.g. roles that do not alternate
            raise QServeError(f"the chat template rejected the messages: {e}") from None
        except (TypeError, KeyError, AttributeError) as e:  # e.g. content that is not a string
            raise QServeError(f"the chat template cannot render these messages: "
                              f"{type(e).__name__}: {e}") from None
