"""Token ids -> text, one step at a time, with stop strings.

Two things make streaming text harder than decoding at the end:

* A character may be split across tokens (byte-level BPE splits 'é' into two tokens). Decoding
  the first alone gives U+FFFD. So each step decodes a small window of recent tokens and emits
  only the suffix beyond what the window's older part decoded to, holding everything back while
  the window ends in U+FFFD:

      ids:   ... | prefix_offset ........ read_offset ........ len(ids)
                   '-- decoded before --'  '-- new tokens -----'
      delta = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]

  Decoding from a few tokens back also keeps SentencePiece's leading spaces right; the window
  starts in the prompt's last tokens so the first output token's space is kept (the text
  continues the prompt, as in vLLM). For byte-level tokenizers the text therefore equals
  tokenizer.decode(output ids); a SentencePiece decode(output ids) would drop that first space.

* A stop string may span tokens. The last (longest stop string - 1) characters are held back
  while streaming, so a stop string is never emitted, even in part, unless
  include_stop_str_in_output. Each step searches only the held text, so the cost per token is
  O(window + longest stop string), not O(text so far).
"""
from __future__ import annotations

from typing import Protocol

from qserve.sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output, for leading spaces
REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    """Streams one sequence's output text; see the module docstring for the rules."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])  # context tail + output ids
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._output_ids: list[int] = []
        self._emitted: list[str] = []  # deltas returned so far
        self._text_cache: str | None = ""
        self._held = ""  # decoded text not yet returned (tail that might begin a stop string)
        self._hold = max(map(len, params.stop), default=1) - 1
        self.stop_reason: str | None = None  # the stop string matched, once one has

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_ids

    @property
    def text(self) -> str:
        """Text returned so far (== concatenation of the deltas); final after a stop or flush()."""
        if self._text_cache is None:
            self._text_cache = "".join(self._emitted)
        return self._text_cache

    def text_since(self, pieces: int) -> tuple[str, int]:
        """(the text returned after the first `pieces` deltas, how many deltas there are now):
        a caller that hands out only what is new joins just that, not the whole text."""
        return "".join(self._emitted[pieces:]), len(self._emitted)

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    def add_tokens(self, new_ids: list[int]) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string matched or None). After a match the
        sequence is done: the text after the stop string is dropped, and no more tokens go in."""
        assert not self.finished, "add_tokens after a stop string matched"
        self._output_ids.extend(new_ids)
        self._ids.extend(new_ids)
        return self._advance(self._decode_window(final=False), final=False)

    def flush(self) -> str:
        """Text still held back, for a sequence that ends for another reason (length, EOS).
        Includes an incomplete trailing character (as U+FFFD, as a full decode would show it)."""
        if self.finished:
            return ""
        return self._advance(self._decode_window(final=True), final=True)[0]

    def _decode_window(self, final: bool) -> str:
        """New text from the tokens past read_offset; '' (and the window kept) while it ends in
        an incomplete character, unless final."""
        skip = self.params.skip_special_tokens
        window = self._ids[self._prefix_offset:]
        prefix_text = self.tokenizer.decode(window[:self._read_offset - self._prefix_offset],
                                            skip_special_tokens=skip)
        new_text = self.tokenizer.decode(window, skip_special_tokens=skip)
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text):]

    def _advance(self, piece: str, final: bool) -> tuple[str, str | None]:
        """Append `piece` to the held text, cut at the earliest stop string, and release all but
        the last `_hold` characters (everything once stopped or final)."""
        # A match must end inside `piece`, so it starts at most _hold characters before it.
        start = max(0, len(self._held) - self._hold)
        held = self._held + piece
        if piece and self.params.stop:
            match = _earliest(held, self.params.stop, start)
            if match is not None:
                at, stop = match
                include = self.params.include_stop_str_in_output
                held = held[:at + len(stop)] if include else held[:at]
                self.stop_reason = stop
        keep = 0 if (self.finished or final) else min(self._hold, len(held))
        delta, self._held = held[:len(held) - keep], held[len(held) - keep:]
        if delta:
            self._emitted.append(delta)
            self._text_cache = None
        return delta, self.stop_reason


def _earliest(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """(index, stop string) of the match that starts first at or after `start`; among matches
    starting at the same index, the shortest (it completes first)."""
    best = None
    for s in stops:
        at = text.find(s, start)
        if at >= 0 and (best is None or (at, len(s)) < (best[0], len(best[1]))):
            best = (at, s)
    return best
