"""Text <-> token ids, over a Hugging Face `tokenizers` backend.

The backend comes from a model directory's tokenizer.json (see hf_loader.py) or is built here
from a bare vocabulary (a GGUF's `tokenizer.ggml.*` arrays, or a sentencepiece tokenizer.model):

- byte-level BPE (GPT-2 style; `tokenizer.ggml.model == "gpt2"`): tokens + merges, with the
  pre-tokenizer the vocabulary was trained with (`tokenizer.ggml.pre`);
- sentencepiece BPE (`"llama"`): tokens + scores; merges are recovered from the scores, spaces
  become "▁" and unknown bytes fall back to <0xNN> tokens.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from qserve.loader.chat_template import CHATML_TEMPLATE, ChatTemplate

# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (gpt-oss, GPT-4o; Llama 4): words split at case changes, contractions kept with them,
# "/" joins the newlines after punctuation
_LETTERS_UPPER, _LETTERS_LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_UPPER}*{_LETTERS_LOWER}+{_CONTRACTION}"
                rf"|[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_UPPER}+{_LETTERS_LOWER}*{_CONTRACTION}"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regex that splits text before byte-level BPE
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
               "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
               "gpt-4o": _GPT4O_SPLIT, "llama4": _GPT4O_SPLIT}
_GPT2_LIKE = ("gpt2", "default", "smollm")  # GPT-2's own regex (inside ByteLevel)
# llama.cpp emits a whole word that is in the vocabulary without merging for these.
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe"}


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], types: Sequence[int],
                   pre: str) -> Backend:
    """GPT-2 style BPE over bytes. merges: "left right" strings, best first."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Backend(models.BPE(vocab, pairs, ignore_merges=pre in _IGNORE_MERGES))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, tokens, types)
    return backend


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # as SmolLM's tokenizer.json and llama.cpp: every digit alone, then GPT-2
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre in _PRE_SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre not in _GPT2_LIKE:
        warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}; splitting text as GPT-2 does", stacklevel=3)
    return gpt2


def sentencepiece_bpe(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int],
                      add_space_prefix: bool = True) -> Backend:
    """Sentencepiece-style BPE: merge the adjacent pair whose union scores highest, so the merge
    list is every split of every normal token into two normal tokens, best union first."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    normal = {tok for tok, ty in zip(tokens, types) if ty == NORMAL}
    ranked = []
    for i, tok in enumerate(tokens):
        if tok not in normal:
            continue
        for k in range(1, len(tok)):
            left, right = tok[:k], tok[k:]
            if left in normal and right in normal:
                ranked.append((-scores[i], i, vocab[left], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = next((tok for tok, ty in zip(tokens, types) if ty == UNKNOWN), None)
    byte_fallback = "<0x00>" in vocab
    backend = Backend(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=byte_fallback))
    # Like sentencepiece and llama.cpp: spaces are "▁", and one more leads the text and every
    # stretch of text after a special token (Metaspace would skip it when the text starts with a space).
    space = [normalizers.Prepend("▁")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence(space + [normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    _add_special_tokens(backend, tokens, types)
    return backend


def _add_special_tokens(backend: Backend, tokens: Sequence[str], types: Sequence[int]) -> None:
    """Control and unknown tokens become special added tokens and user-defined ones plain added
    tokens: either way they are matched whole in the text, never split by BPE."""
    backend.add_special_tokens([AddedToken(tok, special=True, normalized=False)
                                for tok, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN)])
    backend.add_tokens([AddedToken(tok, special=False, normalized=False)
                        for tok, ty in zip(tokens, types) if ty == USER_DEFINED])


class Tokenizer:
    """A model's tokenizer: encode/decode, its special tokens, and its chat template.

    eos_token_ids: the tokens that end generation. It holds the eos token, the file's declared
    extras (GGUF eot/eom ids, generation_config.json's eos list) and the token the chat template
    closes an assistant turn with, if special. For SmolLM2 that is {2} (<|im_end|>), the same set
    transformers' generation_config stops on; <|endoftext|> (0) is not in it.
    """

    def __init__(self, backend: Backend, *, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, extra_eos_ids: Sequence[int] = (),
                 add_bos: bool | None = None, add_eos: bool | None = None,
                 chat_template: str | None = None, tool_use_template: str | None = None):
        """add_bos / add_eos: None keeps the backend's own post-processor (a tokenizer.json's).
        tool_use_template: a second, named template some models (Hermes 2 Pro, Command R) keep
        for requests with tools, which transformers and llama.cpp then use."""
        self.backend = backend
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        if add_bos is not None or add_eos is not None:
            self._set_post_processor(bool(add_bos) and bos_token_id is not None,
                                     bool(add_eos) and eos_token_id is not None)
        self.chat_template, self.tool_use_template = chat_template, tool_use_template
        self._template = ChatTemplate(chat_template or CHATML_TEMPLATE)
        self._tools_template = (ChatTemplate(tool_use_template) if tool_use_template
                                else self._template)  # what renders requests with tools
        added = backend.get_added_tokens_decoder()
        self.all_special_ids: list[int] = sorted(i for i, tok in added.items() if tok.special)
        self.eos_token_ids: set[int] = {i for i in (eos_token_id, *extra_eos_ids) if i is not None}
        turn_end = self._turn_end_id()
        if turn_end is not None:
            self.eos_token_ids.add(turn_end)

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        bos, eos = self.id_to_token(self.bos_token_id), self.id_to_token(self.eos_token_id)
        single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
        pair = single + " " + " ".join([f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos)
        special = [(bos, self.bos_token_id)] * add_bos + [(eos, self.eos_token_id)] * add_eos
        self.backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special)

    def _turn_end_id(self) -> int | None:
        """The special token right after an assistant message in the rendered template."""
        probe = "qserve-turn-end-probe"
        try:
            text = self.apply_chat_template([{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": probe}],
                                            add_generation_prompt=False)
        except ValueError:  # a template that insists on other turns; nothing to learn
            return None
        after = text.partition(probe)[2]
        ids = self.encode(after, add_special_tokens=False) if after else []
        return ids[0] if ids and ids[0] in self.all_special_ids else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_id)

    def id_to_token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special tokens written in `text` (e.g. "<|im_start|>") become their ids;
        add_special_tokens adds BOS/EOS only where the model's tokenizer config asks for them."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **variables) -> str:
        """Render a conversation to prompt text (tokenize it with encode(add_special_tokens=False)
        when the template writes BOS itself). `tools` reach templates that list them
        (`chat_template_renders_tools`), through the tool-use template where there is one.
        `variables`: more of the template's variables (a request's chat_template_kwargs:
        Qwen3's enable_thinking, gpt-oss's reasoning_effort)."""
        template = self._template if tools is None else self._tools_template
        return template.render(messages, add_generation_prompt, tools=tools,
                               bos_token=self.bos_token, eos_token=self.eos_token, **variables)

    @property
    def chat_template_renders_tools(self) -> bool:
        return self._tools_template.renders_tools
