"""Chat templates: a model's Jinja template, rendered the way Hugging Face transformers does.

Same environment as transformers' `apply_chat_template`: a sandbox that cannot mutate its inputs,
`trim_blocks` and `lstrip_blocks`, loop controls, the `{% generation %}` block, a `tojson` that
keeps non-ASCII text, and the globals `raise_exception` and `strftime_now`.

A template is code from the model file, and it runs at load (the turn-end probe) and on every
request. So one render is bounded: every call, attribute and item it makes checks a deadline
(nested loops over `range` call it each pass), `*` may not build more than MAX_REPEAT items, and
`**` no integer over MAX_POWER_BITS bits. Whatever a template raises becomes one QServeError.
"""
from __future__ import annotations

import json
import operator
import time
from contextvars import ContextVar
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

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


RENDER_SECONDS = 10.0      # a real template renders in milliseconds
MAX_REPEAT = 1 << 24       # items a string or list times a number may have
MAX_POWER_BITS = 1 << 16   # bits of an integer power
_deadline: ContextVar[float] = ContextVar("chat_template_deadline", default=float("inf"))


class _GenerationBlock(Extension):
    """transformers' `{% generation %}...{% endgeneration %}`: it marks the assistant's text
    for training masks and renders its body unchanged (in its own scope, as there)."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with the bounds of one render (module docstring)."""
    intercepted_binops = frozenset({"*", "**"})

    @staticmethod
    def _in_time() -> None:
        if time.monotonic() > _deadline.get():
            raise SecurityError(f"rendering took over {RENDER_SECONDS:g} s")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        __self._in_time()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        self._in_time()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self._in_time()
        return super().getitem(obj, argument)

    def call_binop(self, context, op, left, right):
        if op == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(n, int) and hasattr(seq, "__len__") and len(seq) * n > MAX_REPEAT:
                raise SecurityError(f"a repetition of over {MAX_REPEAT} items")
            return operator.mul(left, right)
        if (isinstance(left, int) and isinstance(right, int) and right > 0
                and (abs(left).bit_length() - 1) * right > MAX_POWER_BITS):
            raise SecurityError(f"a power of over {MAX_POWER_BITS} bits")
        return operator.pow(left, right)


class ChatTemplate:
    """One compiled template. `render` turns a message list into the prompt text."""

    def __init__(self, source: str):
        if not isinstance(source, str):
            raise ModelLoadError(f"the model's chat template is {type(source).__name__}, "
                                 f"not text")
        env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                              extensions=[loopcontrols, _GenerationBlock])
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
               tools: list[dict] | None = None, **variables) -> str:
        """messages: [{"role": "user", "content": "..."}, ...]; tools: OpenAI's function
        definitions ({"type": "function", "function": {...}}), for templates that list them;
        variables: bos_token=..., eos_token=... as the template expects them, and any others
        (enable_thinking=False)."""
        token = _deadline.set(time.monotonic() + RENDER_SECONDS)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, documents=None, **variables)
        except jinja2.TemplateError as e:  # raise_exception(), e.g. roles that do not alternate
            raise QServeError(f"the chat template rejected the messages: {e}") from None
        except Exception as e:  # noqa: BLE001 (content that is not a string; a broken template)
            raise QServeError(f"the chat template cannot render these messages: "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                              ) from None
        finally:
            _deadline.reset(token)
