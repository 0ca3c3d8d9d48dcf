"""IncrementalDetokenizer: split UTF-8 characters, stop strings across tokens, flush, window size.

Most tests use a tiny byte-level BPE trained here (no network) with a 500-token vocabulary, so
'é', '中' and '👍' come out as 2, 3 and 4 byte tokens."""
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from qserve.engine.detokenizer import IncrementalDetokenizer
from qserve.sampling_params import SamplingParams

MULTIBYTE = "naïve café — 中文 👍 ok"


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    from pydoc_data.topics import topics

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<|end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([topics[k] for k in sorted(topics)][:50], trainer)
    return tok


def encode(tok, text: str) -> list[int]:
    ids = tok.encode(text)
    return list(getattr(ids, "ids", ids))


def stream(tok, ids, chunks=None, prompt=(), **kw):
    """Feed `ids` in chunks of the given sizes (default 1). Returns (deltas, stop, detok);
    flushes if no stop string matched."""
    det = IncrementalDetokenizer(tok, list(prompt), SamplingParams(**kw))
    deltas, stop, i = [], None, 0
    for n in chunks or [1] * len(ids):
        delta, stop = det.add_tokens(ids[i:i + n])
        deltas.append(delta)
        i += n
        if stop is not None:
            break
    if stop is None:
        deltas.append(det.flush())
    return deltas, stop, det


def test_split_characters_are_held_until_complete(bpe):
    ids = encode(bpe, MULTIBYTE)
    assert any("\ufffd" in bpe.decode([i]) for i in ids)  # the test means something
    deltas, stop, det = stream(bpe, ids)
    assert stop is None and not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == det.text == bpe.decode(ids) == MULTIBYTE
    assert det.output_token_ids == ids


def test_prompt_context_does_not_change_byte_level_text(bpe):
    prompt = encode(bpe, "Question: 中文?\n")
    ids = encode(bpe, MULTIBYTE)
    deltas, _, det = stream(bpe, ids, prompt=prompt)
    assert "".join(deltas) == det.text == bpe.decode(ids)


def test_stop_string_across_tokens_is_cut_and_never_streamed(bpe):
    text = "The END is near"
    ids = encode(bpe, text)
    assert not any("END" in bpe.decode([i]) for i in ids)  # "END" spans several tokens
    deltas, stop, det = stream(bpe, ids, stop=["END"], include_stop_str_in_output=False)
    assert stop == "END" and det.finished
    assert det.text == "".join(deltas) == "The "
    assert not any(c in "".join(deltas) for c in "END")


def test_include_stop_str_in_output(bpe):
    ids = encode(bpe, "The END is near")
    deltas, stop, det = stream(bpe, ids, stop="END", include_stop_str_in_output=True)
    assert stop == "END" and det.text == "".join(deltas) == "The END"


def test_multibyte_stop_string(bpe):
    ids = encode(bpe, "say 中文 👍 now")
    deltas, stop, det = stream(bpe, ids, stop=["👍"])
    assert stop == "👍" and det.text == "say 中文 " and "\ufffd" not in det.text


@pytest.mark.parametrize("chunks", [None, "all"])
def test_earliest_of_several_stop_strings_wins(bpe, chunks):
    ids = encode(bpe, "one two three four")
    sizes = [len(ids)] if chunks == "all" else None
    # listed last but matched first; with everything in one step too
    deltas, stop, det = stream(bpe, ids, chunks=sizes, stop=["four", "three", "wo th"])
    assert stop == "wo th" and det.text == "".join(deltas) == "one t"


def test_flush_releases_held_text_on_length_or_eos(bpe):
    ids = encode(bpe, "abc XY")
    det = IncrementalDetokenizer(bpe, [], SamplingParams(stop=["XYZ"]))
    streamed = "".join(det.add_tokens([i])[0] for i in ids)
    assert streamed == "abc " and det.text == "abc "  # "XY" might begin "XYZ"
    assert det.flush() == "XY" and det.text == "abc XY" and det.flush() == ""


def test_flush_of_an_incomplete_character_shows_what_decode_shows(bpe):
    ids = encode(bpe, "ok 👍")[:-2]  # cut inside the emoji's 4 bytes
    deltas, stop, det = stream(bpe, ids)
    assert not any("\ufffd" in d for d in deltas[:-1]) and deltas[-1].endswith("\ufffd")
    assert det.text == bpe.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(bpe, skip):
    ids = encode(bpe, "done<|end|>")
    _, _, det = stream(bpe, ids, skip_special_tokens=skip)
    assert det.text == ("done" if skip else "done<|end|>")


def test_sentencepiece_first_token_keeps_its_space_after_a_prompt():
    tok = Tokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "!": 2, "<unk>": 3},
                                     unk_token="<unk>"))
    tok.decoder = decoders.Metaspace()
    assert tok.decode([1, 2]) == "world!"  # decoding from the start drops the space
    deltas, _, det = stream(tok, [1, 2], prompt=[0])
    assert deltas[:2] == [" world", "!"] and det.text == " world!"


def test_random_text_chunks_and_stops_match_a_full_decode(bpe):
    rng = random.Random(0)
    alphabet = list("abc xyz.\n") + ["é", "ü", "中", "文", "👍", "—", "the "]
    for trial in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        ids = encode(bpe, text)
        chunks, left = [], len(ids)
        while left:
            chunks.append(min(left, rng.randint(1, 4)))
            left -= chunks[-1]
        start = rng.randrange(len(text))
        stop = text[start:start + rng.randint(1, 4)] if rng.random() < 0.7 else "qq"
        include = rng.random() < 0.5
        deltas, got, det = stream(bpe, ids, chunks, stop=[stop], include_stop_str_in_output=include)
        at = text.find(stop)
        want = text if at < 0 else text[:at + (len(stop) if include else 0)]
        assert (got, det.text, "".join(deltas)) == (None if at < 0 else stop, want, want), trial
        assert not any("\ufffd" in d for d in deltas)
        if not include:  # no part of the stop string's occurrence is ever streamed
            assert "".join(deltas) == text[:len("".join(deltas))]


class CountingTokenizer:
    """Wraps a tokenizer and records the longest id list it was asked to decode."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def decode(self, ids, skip_special_tokens):
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_work_per_token_is_bounded_by_the_window(bpe):
    text = (MULTIBYTE + " and some plain words in between. ") * 60
    ids = encode(bpe, text)
    counting = CountingTokenizer(bpe)
    deltas, _, det = stream(counting, ids, prompt=ids[:50], stop=["never appears"])
    assert det.text == text and len(ids) > 1000
    assert counting.longest <= 5 + 4  # prompt context + at most one 4-byte character's tokens


def test_real_tokenizer_on_long_text(tokenizer):
    tok = tokenizer
    from pydoc_data.topics import topics

    text = topics["typesseq"][:6000] + f" {MULTIBYTE} ünïcödé ✓ 🤖🚀 日本語のテキスト"
    ids = encode(tok, text)
    full = tok.decode(ids, skip_special_tokens=True)
    deltas, stop, det = stream(tok, ids)
    assert stop is None and not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == det.text == full
    cut = full.index("🤖")
    deltas, stop, det = stream(tok, ids, stop=["🤖🚀 日", "sequence types"])
    assert stop == "sequence types" and det.text == full[:full.index("sequence types")]
    deltas, stop, det = stream(tok, ids, stop=["🤖🚀 日"], include_stop_str_in_output=True)
    assert stop == "🤖🚀 日" and det.text == "".join(deltas) == full[:cut] + "🤖🚀 日"
