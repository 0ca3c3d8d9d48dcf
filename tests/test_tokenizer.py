"""Tokenizer: the default model's GGUF vocabulary against transformers' tokenizer for the same
file, token for token; sentencepiece vocabularies against sentencepiece itself; chat templates."""
from __future__ import annotations

import copy
import io

import gguf
import pytest
import sentencepiece as spm
from pydoc_data.topics import topics

from qserve.errors import ModelLoadError, QServeError
from qserve.loader.chat_template import CHATML_TEMPLATE
from qserve.loader.gguf_loader import GGUFFile, read_tokenizer
from qserve.loader.hf_loader import _sentencepiece_backend
from qserve.loader.tokenizer import Tokenizer

EDGE_CASES = [
    "", " ", "  ", "\n", "\n\n\n", "\t\t x", "\r\n", " leading space", "trailing space ",
    "two  spaces   three    four", "Hello, world! It's a dog's life; they're here, we'll see.",
    "1234567890", "3.14159 and 2,718", " 42", "x=1+2*3-4/5", "0x1F 1e-5 007",
    "naïve café résumé Ångström", "中文字符测试，日本語のテキスト、한국어", "Ελληνικά Русский עברית العربية",
    "emoji: 🤗 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️", "ﬁ ligature, full-width ＡＢＣ１２３", "\u00a0nbsp\u3000ideographic space",
    "zero\u200bwidth", "<|im_start|>user\nhi<|im_end|>\n", "<|im_start", "text<|endoftext|>more",
    "<repo_name>qserve<file_sep>", "def f(x):\n    return x ** 2  # square\n",
    "    indented\n\tmixed\n", "!!!???...---", "'s 't 're 've 'm 'll 'd 'S",
]
MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and 3+3?"}],
]


@pytest.fixture(scope="module")
def hf_gguf_tokenizer_as_converted(default_model_path):
    """transformers' own conversion of the GGUF's vocabulary, exactly as it makes it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_path.parent),
                                         gguf_file=default_model_path.name)


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(hf_gguf_tokenizer_as_converted):
    """The independent reference: transformers' conversion, with one fix.

    transformers (5.x) does not know `tokenizer.ggml.pre = "smollm"` and splits text with
    GPT-2's regex alone. SmolLM2's published tokenizer.json, and llama.cpp for "smollm", first
    isolate every digit, then apply GPT-2's regex. We give the reference that pre-tokenizer;
    vocabulary, merges, special tokens and decoder stay transformers' own.
    (test_transformers_gguf_pre_tokenizer_differs_only_around_digits shows what that changes.)
    """
    from tokenizers import pre_tokenizers

    hf = copy.deepcopy(hf_gguf_tokenizer_as_converted)
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return hf


def corpus() -> list[str]:
    return list(topics.values()) + EDGE_CASES


@pytest.mark.slow
def test_encode_matches_transformers(tokenizer, hf_gguf_tokenizer):
    texts = corpus()
    for text in texts:
        assert tokenizer.encode(text) == hf_gguf_tokenizer.encode(text), repr(text[:80])
    whole = "\n".join(texts)  # ~470k characters
    ids = tokenizer.encode(whole)
    assert len(ids) > 100_000
    assert ids == hf_gguf_tokenizer.encode(whole)


@pytest.mark.slow
def test_transformers_gguf_pre_tokenizer_differs_only_around_digits(
        tokenizer, hf_gguf_tokenizer_as_converted):
    plain = hf_gguf_tokenizer_as_converted
    no_digits = [text for text in corpus() if not any(c.isdigit() for c in text)]
    assert len(no_digits) > 20
    for text in no_digits:
        assert tokenizer.encode(text) == plain.encode(text), repr(text[:80])
    # Whitespace before a digit: the digit is cut off first, so the whitespace stays one token.
    assert [tokenizer.decode([i]) for i in tokenizer.encode("steps:\n\n1.")] == \
        ["steps", ":", "\n\n", "1", "."]
    assert [plain.decode([i]) for i in plain.encode("steps:\n\n1.")] == \
        ["steps", ":", "\n", "\n", "1", "."]


@pytest.mark.slow
def test_decode_round_trips_and_matches_transformers(tokenizer, hf_gguf_tokenizer):
    for text in corpus():
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
        for skip in (True, False):
            assert tokenizer.decode(ids, skip) == hf_gguf_tokenizer.decode(ids, skip_special_tokens=skip)
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == "user\nhi"


@pytest.mark.slow
def test_special_tokens(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.bos_token_id == 1 and tokenizer.bos_token == "<|im_start|>"
    assert tokenizer.eos_token_id == 2 and tokenizer.eos_token == "<|im_end|>"
    # transformers' generation_config for this model stops on 2 only, and so do we.
    assert tokenizer.eos_token_ids == {2}
    assert tokenizer.all_special_ids == list(range(17))
    # The GGUF says add_bos_token=False: nothing is added, with or without special tokens.
    assert tokenizer.encode("Hello") == tokenizer.encode("Hello", add_special_tokens=False) == [19556]
    # Digits are split one by one (SmolLM's pre-tokenizer).
    assert [tokenizer.decode([i]) for i in tokenizer.encode("2025")] == ["2", "0", "2", "5"]


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, hf_gguf_tokenizer, add_generation_prompt):
    assert tokenizer.chat_template == hf_gguf_tokenizer.chat_template
    for messages in MESSAGES:
        ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        theirs = hf_gguf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours == theirs
    prompt = tokenizer.apply_chat_template(MESSAGES[0])
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_chat_template_errors_are_user_errors(tokenizer):
    with pytest.raises(QServeError, match="chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": ["a", "list"]}])


def test_fallback_and_raise_exception_template():
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel

    backend = Backend(WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tok = Tokenizer(backend)
    assert tok.chat_template is None
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    strict = Tokenizer(backend, chat_template=(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first turn must be user') }}"
        "{% endif %}{{ messages | tojson }}"))
    with pytest.raises(QServeError, match="first turn must be user"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])
    assert strict.apply_chat_template([{"role": "user", "content": "é"}]) == \
        '[{"role": "user", "content": "é"}]'
    assert CHATML_TEMPLATE  # the fallback is exported for the CLI's `info`


def _word_level_tokenizer(**kwargs) -> Tokenizer:
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel

    return Tokenizer(Backend(WordLevel({"<unk>": 0}, unk_token="<unk>")), **kwargs)


def test_generation_block_renders_its_body_in_its_own_scope():
    """transformers' `{% generation %}` tag (templates written for assistant-only training
    masks): the body renders unchanged; a `set` inside it stays inside, as in transformers."""
    tok = _word_level_tokenizer(chat_template=(
        "{% set x = 'outer' %}{% for m in messages %}{% if m.role == 'assistant' %}"
        "{% generation %}{% set x = 'inner' %}[{{ m.content }}|{{ x }}]{% endgeneration %}"
        "{% else %}{{ m.content }}{% endif %}{% endfor %}{{ x }}"))
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert tok.apply_chat_template(messages) == "q[a|inner]outer"


@pytest.mark.parametrize("template,problem", [
    ("{{ 1 / 0 }}", "ZeroDivisionError: division by zero"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ("{% for i in range(10**6) %}{% endfor %}", "OverflowError: Range too big"),
    # loops and macros that would run for hours end at the render's deadline
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     r"rendering took over 0\.2 s"),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
     r"rendering took over 0\.2 s"),
    ("{{ 'x' * 10**10 }}", "a repetition of over 16777216 items"),
    ("{{ ([1] * 10**9) | length }}", "a repetition of over 16777216 items"),
    ("{% set b = 10**8 %}{{ 3 ** b }}", "a power of over 65536 bits"),  # (** is left-associative)
    ("{{ strftime_now(5) }}", "TypeError"),
])
def test_broken_templates_load_and_refuse_in_one_line(monkeypatch, template, problem):
    """A model file's template that fails, never ends or builds gigabytes: the tokenizer still
    loads (its turn-end probe fails quietly), and each render is one QServeError."""
    from qserve.loader import chat_template

    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.2)
    tok = _word_level_tokenizer(chat_template=template)
    for tools in (None, [{"type": "function", "function": {"name": "f"}}]):
        with pytest.raises(QServeError, match=problem) as e:
            tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools)
        assert "\n" not in str(e.value)
    assert not tok.chat_template_renders_tools


@pytest.mark.parametrize("source", [7, ["{{ x }}"], b"{{ x }}"])
def test_chat_template_that_is_not_text_is_a_load_error(source):
    with pytest.raises(ModelLoadError, match=f"chat template is {type(source).__name__}, not text"):
        _word_level_tokenizer(chat_template=source)


@pytest.mark.slow
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_llama3_and_qwen2_pre_tokenizers_match_transformers(default_model_path, tmp_path, pre):
    """Llama 3's and Qwen2's split regexes, on SmolLM2's vocabulary relabelled with their names."""
    from transformers import AutoTokenizer

    md = GGUFFile(default_model_path).metadata
    writer = gguf.GGUFWriter(str(tmp_path / f"{pre}.gguf"), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(md["tokenizer.ggml.tokens"])
    writer.add_token_types(md["tokenizer.ggml.token_type"])
    writer.add_token_merges(md["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    ours = read_tokenizer(GGUFFile(tmp_path / f"{pre}.gguf"))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=f"{pre}.gguf")
    for text in corpus():
        assert ours.encode(text) == ref.encode(text), repr(text[:80])


# o200k's split (gpt-oss's tokenizer.json, llama.cpp's "gpt-4o"), as written there
O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
         r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
         r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
         r"[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.mark.parametrize("pre", ["gpt-4o", "llama4"])
def test_o200k_pre_tokenizer_splits_as_its_regex(pre):
    """A GGUF that says gpt-4o (gpt-oss) or llama4 splits text as o200k's regex does (Python's
    `regex`, not the tokenizers library's engine), then maps bytes as GPT-2 does: camelCase
    and contractions, 1-3 digit runs, "/" after punctuation with the newlines."""
    import regex
    from tokenizers import decoders

    from qserve.loader.tokenizer import _byte_level_pre_tokenizer

    split, to_text = _byte_level_pre_tokenizer(pre), decoders.ByteLevel()
    for text in corpus() + ["HelloWorld's CAPSLock don'T 1234567 a//\n\nb\r\n  x"]:
        pieces = [to_text.decode([p]) for p, _ in split.pre_tokenize_str(text)]
        assert pieces == regex.findall(O200K, text), repr(text[:80])


# --- sentencepiece vocabularies (Llama 2 / Mistral style), against sentencepiece itself -------

@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    """A small sentencepiece BPE model trained like Llama's: byte fallback, identity
    normalization, digits split, a dummy prefix space."""
    texts = list(topics.values())
    lines = [line for text in texts[:40] for line in text.splitlines() if line.strip()]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=600, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True, character_coverage=1.0,
        minloglevel=2, num_threads=1)
    path = tmp_path_factory.mktemp("sp") / "tokenizer.model"
    path.write_bytes(buf.getvalue())
    return path, spm.SentencePieceProcessor(model_file=str(path)), texts[40:] + EDGE_CASES


def test_sentencepiece_model_file_matches_sentencepiece(sp_model):
    path, sp, texts = sp_model
    tok = Tokenizer(_sentencepiece_backend(path, {}), bos_token_id=1, eos_token_id=2, add_bos=True)
    for text in texts:
        expected = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False) == expected, repr(text[:80])
        assert tok.encode(text) == [1] + expected
        assert tok.decode(expected) == sp.decode(expected)


def test_sentencepiece_gguf_vocab_matches_sentencepiece(sp_model, tmp_path):
    path, sp, texts = sp_model
    n = sp.get_piece_size()
    types = [3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i) else 1
             for i in range(n)]
    writer = gguf.GGUFWriter(str(tmp_path / "sp.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_chat_template("{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    tok = read_tokenizer(GGUFFile(tmp_path / "sp.gguf"))
    for text in texts:  # add_bos_token is absent: llama.cpp's default for sentencepiece is True
        assert tok.encode(text) == [sp.bos_id()] + sp.encode(text), repr(text[:80])
    # A space prefix starts each stretch of text after a special token, as in llama.cpp.
    assert tok.encode("</s>hi", add_special_tokens=False) == [sp.eos_id()] + sp.encode("hi")
    assert tok.eos_token_ids == {sp.eos_id()}
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[INST] x [/INST]"


NAMED = {"default": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}",
         "tool_use": "[{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}]"
                     "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"}
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "now",
                                           "parameters": {"type": "object", "properties": {}}}}]


def _hf_tokenizer_dir(path, layout: str):
    """A tokenizer directory whose templates are named as transformers keeps them: a list in
    tokenizer_config.json, or chat_template.jinja + additional_chat_templates/tool_use.jinja."""
    import json

    _word_level_tokenizer().backend.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}
    if layout == "list":
        cfg["chat_template"] = [{"name": k, "template": v} for k, v in NAMED.items()]
    else:
        (path / "chat_template.jinja").write_text(NAMED["default"])
        (path / "additional_chat_templates").mkdir()
        (path / "additional_chat_templates" / "tool_use.jinja").write_text(NAMED["tool_use"])
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("layout", ["list", "files"])
def test_tool_use_template_is_used_with_tools_as_transformers_does(tmp_path, layout):
    """Models with a named `tool_use` template (Hermes 2 Pro, Command R): requests with tools
    render through it, the rest through the default, as transformers chooses."""
    from transformers import AutoTokenizer

    from qserve.loader.hf_loader import read_tokenizer

    ours = read_tokenizer(_hf_tokenizer_dir(tmp_path, layout))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "user", "content": "hi"}]
    for tools in (None, TOOLS):
        text = ours.apply_chat_template(messages, tools=tools)
        assert text == theirs.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=True)
        assert text.startswith("[get_time]") == (tools is not None)
    assert (ours.chat_template, ours.tool_use_template) == (NAMED["default"], NAMED["tool_use"])
    assert ours.chat_template_renders_tools


@pytest.mark.slow
def test_tool_use_template_from_gguf_and_through_a_checkpoint(tmp_path):
    """llama.cpp's `tokenizer.chat_template.tool_use` key; `qserve quantize` keeps both
    templates (tokenizer_config.json's named list), and so does a GGUF export of that."""
    from test_loader import write_tiny_gguf

    from qserve.loader import load_tokenizer
    from qserve.quant.quantize import quantize

    src = write_tiny_gguf(tmp_path / "named.gguf", extra_kv={
        "tokenizer.chat_template": NAMED["default"],
        "tokenizer.chat_template.tool_use": NAMED["tool_use"]})
    quantize(str(src), tmp_path / "ck")
    quantize(str(tmp_path / "ck"), tmp_path / "ck.gguf", fmt="gguf")
    for path in (src, tmp_path / "ck", tmp_path / "ck.gguf"):
        tok = load_tokenizer(path)
        assert (tok.chat_template, tok.tool_use_template) == (NAMED["default"],
                                                              NAMED["tool_use"]), path
        assert tok.apply_chat_template([{"role": "user", "content": "x"}],
                                       tools=TOOLS) == "[get_time]<user>x"


def test_malformed_named_templates_are_load_errors(tmp_path):
    import json

    from test_loader import write_tiny_gguf

    from qserve.loader import load_tokenizer
    from qserve.loader.hf_loader import read_tokenizer

    _hf_tokenizer_dir(tmp_path, "files")
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_bytes(b"\xff{{ x }}")
    with pytest.raises(ModelLoadError, match=r"tool_use\.jinja: not readable as UTF-8 text"):
        read_tokenizer(tmp_path)
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").unlink()
    for value in ([{"template": "{{ x }}"}], [7], 7):  # (a list entry without a name had
        # raised KeyError)
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": value}))
        with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json: chat_template must "
                                                 r"be text or a list of"):
            read_tokenizer(tmp_path)
    gguf_file = write_tiny_gguf(tmp_path / "t.gguf",
                                extra_kv={"tokenizer.chat_template.tool_use": 7})
    with pytest.raises(ModelLoadError, match=r"t\.gguf: metadata key tokenizer\.chat_template"
                                             r"\.tool_use is int, not text$"):
        load_tokenizer(gguf_file)
