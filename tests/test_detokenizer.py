"""IncrementalDetokenizer against tokenizer.decode(all output ids), for byte-level BPE and SentencePiece-style
(Metaspace) tokenizers: streamed deltas, invalid UTF-8, stop strings, special tokens."""
import functools
import glob
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve.engine.detokenizer import MAX_WINDOW, IncrementalDetokenizer

SAMPLE = "héllo wörld — naïve 你好 🎉 Ελληνικά, the license's terms\n\tand  spaces"
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _license_files():
    return sorted(glob.glob("/usr/share/common-licenses/*"))[:8]


@functools.lru_cache
def byte_level():
    from nanoserve.tiny_model import build_tokenizer
    return build_tokenizer()


@functools.lru_cache
def unigram_metaspace():
    """SentencePiece-like Unigram: Metaspace pre-tokenizer and decoder (drops the first token's leading space)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train(_license_files(), trainers.UnigramTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>", show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>")


@functools.lru_cache
def bpe_byte_fallback():
    """Llama-2-like SentencePiece BPE: '▁' for spaces, <0xNN> byte-fallback tokens, Strip of the first space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.train(_license_files(), trainers.BpeTrainer(
        vocab_size=700, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>")


class _Proxy:
    def __init__(self, target, **overrides):
        self._target = target
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._target, name)

    def __len__(self):
        return len(self._target)


@functools.lru_cache
def byte_level_window():
    """The byte-level tokenizer with its decoder hidden: exercises the generic window path, not the byte table."""
    tokenizer = byte_level()
    return _Proxy(tokenizer, backend_tokenizer=_Proxy(tokenizer.backend_tokenizer, decoder=None))


TOKENIZERS = {"byte_level": byte_level, "byte_level_window": byte_level_window,
              "unigram_metaspace": unigram_metaspace, "bpe_byte_fallback": bpe_byte_fallback}
tokenizer_names = st.sampled_from(sorted(TOKENIZERS))


def stream(tokenizer, ids, chunks=None, **kwargs):
    """Feed ids (in chunks of the given sizes, default one by one); return (detokenizer, deltas)."""
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas, pos = [], 0
    for size in chunks or [1] * len(ids):
        if detok.stop_matched is not None or pos >= len(ids):
            break
        deltas.append(detok.add(ids[pos:pos + size]))
        assert detok.text == "".join(deltas)
        pos += size
    deltas.append(detok.flush())
    return detok, deltas


def truncate_at_stop(text, stops, include):
    """Reference: cut at the stop occurrence that ends first (longer one on a tie)."""
    found = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, minus_len, stop = min(found)
    return text[:end if include else end + minus_len], stop


def check(tokenizer, ids, chunks=None, skip_special_tokens=True, stop=(), include=False):
    detok, deltas = stream(tokenizer, ids, chunks, skip_special_tokens=skip_special_tokens, stop=list(stop),
                           include_stop_str_in_output=include)
    expected, matched = truncate_at_stop(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens),
                                         stop, include)
    assert "".join(deltas) == detok.text == expected
    assert detok.stop_matched == matched
    return detok, deltas


def test_byte_level_uses_the_byte_table_and_others_the_window():
    assert IncrementalDetokenizer(byte_level())._bytes is not None
    for name in ("byte_level_window", "unigram_metaspace", "bpe_byte_fallback"):
        assert IncrementalDetokenizer(TOKENIZERS[name]())._bytes is None


# ---- plain text ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_one_token_at_a_time_matches_decode(name):
    tokenizer = TOKENIZERS[name]()
    ids = tokenizer.encode(SAMPLE * 3, add_special_tokens=False)
    _, deltas = check(tokenizer, ids)
    assert sum(1 for d in deltas if d) > len(ids) // 3  # really streamed, not all at flush


def test_multibyte_characters_are_withheld_until_complete():
    tokenizer = byte_level()
    ids = tokenizer.encode("a🎉", add_special_tokens=False)
    assert len(ids) > 2  # the emoji spans several byte tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([i]) for i in ids]
    assert deltas[0] == "a" and all(d == "" for d in deltas[1:-1]) and deltas[-1] == "🎉"
    assert "\ufffd" not in "".join(deltas)


def test_byte_fallback_run_spoiled_by_a_bad_byte_matches_decode():
    """<0xC3><0xA9> alone is 'é', but <0xC3><0xA9><0xFF> decodes as three U+FFFD: nothing may stream early."""
    tokenizer = bpe_byte_fallback()
    byte = lambda b: tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>")  # noqa: E731
    word = tokenizer.encode("the", add_special_tokens=False)
    for tail in ([0xC3, 0xA9], [0xC3, 0xA9, 0xFF], [0xC3, 0xA9, 0xC3]):
        check(tokenizer, word + [byte(b) for b in tail] + word)
        check(tokenizer, word + [byte(b) for b in tail])


@pytest.mark.parametrize("name", ["unigram_metaspace", "bpe_byte_fallback"])
def test_sentencepiece_spaces_between_tokens(name):
    tokenizer = TOKENIZERS[name]()
    text = "the license is free software and you can redistribute it"
    ids = tokenizer.encode(text, add_special_tokens=False)
    _, deltas = check(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) and " is free" in "".join(deltas)


@given(name=tokenizer_names, text=st.text(alphabet=st.sampled_from(list(SAMPLE + "ab\u00e9\u4e16")), max_size=60),
       data=st.data())
@SETTINGS
def test_random_text_in_random_chunks(name, text, data):
    tokenizer = TOKENIZERS[name]()
    ids = tokenizer.encode(text, add_special_tokens=False)
    chunks = data.draw(st.lists(st.integers(1, 5), min_size=len(ids), max_size=len(ids)))
    check(tokenizer, ids, chunks)


@given(name=tokenizer_names, data=st.data())
@SETTINGS
def test_random_token_ids_including_invalid_utf8(name, data):
    """Arbitrary ids (lone byte tokens, specials, broken sequences): deltas still equal decode, U+FFFD included."""
    tokenizer = TOKENIZERS[name]()
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=40))
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
    skip = data.draw(st.booleans())
    check(tokenizer, ids, chunks, skip_special_tokens=skip)


def byte_token_ids(tokenizer, data: bytes) -> list[int]:
    """One byte-level token per byte (the alphabet maps each byte to one printable character)."""
    from nanoserve.engine.detokenizer import _byte_level_alphabet
    char_of = {b: c for c, b in _byte_level_alphabet().items()}
    return tokenizer.convert_tokens_to_ids([char_of[b] for b in data])


TRICKY_UTF8 = [b"\xed\xa0\x80", b"\xc0\x80", b"\xf4\x90\x80\x80", b"\xf5", b"\xe4\xbd", b"\xf0\x9f\x8e",
               b"\x80\x80", b"\xe4\xbd\xa0\xbd", b"\xc3", b"\xef\xbf\xbd", b"\xf0\x9f\x8e\x89"]


@pytest.mark.parametrize("name", ["byte_level", "byte_level_window"])
def test_invalid_and_split_utf8_match_decode(name):
    """Surrogates, overlong forms, out-of-range and truncated sequences: U+FFFD exactly where decode puts them."""
    tokenizer = TOKENIZERS[name]()
    word = tokenizer.encode("ab", add_special_tokens=False)
    for raw in TRICKY_UTF8:
        for ids in (byte_token_ids(tokenizer, raw), word + byte_token_ids(tokenizer, raw) + word,
                    byte_token_ids(tokenizer, raw * 2) + [tokenizer.eos_token_id] + word):
            check(tokenizer, ids)
            check(tokenizer, ids, skip_special_tokens=False)


@given(name=st.sampled_from(["byte_level", "byte_level_window"]),
       pieces=st.lists(st.sampled_from(TRICKY_UTF8 + [b"a", b" ", "é你🎉".encode()]), max_size=12),
       data=st.data())
@SETTINGS
def test_random_byte_soup(name, pieces, data):
    tokenizer = TOKENIZERS[name]()
    ids = byte_token_ids(tokenizer, b"".join(pieces))
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
    check(tokenizer, ids, chunks)


# ---- special tokens --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(name, skip):
    tokenizer = TOKENIZERS[name]()
    eos = tokenizer.eos_token_id
    words = tokenizer.encode("the free license", add_special_tokens=False)
    ids = [eos] + words[:2] + [eos, eos] + words[2:] + [eos]
    detok, _ = check(tokenizer, ids, skip_special_tokens=skip)
    assert (tokenizer.eos_token in detok.text) is not skip


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("every", [1, 2, 3, 5])
def test_skipped_special_tokens_between_words_over_long_outputs(name, every):
    """A window must not restart at a skipped special token: the word after it would lose its space."""
    tokenizer = TOKENIZERS[name]()
    eos = tokenizer.eos_token_id
    words = tokenizer.encode("the terms of this license and the free software " * 4, add_special_tokens=False)
    ids = [t for i, word in enumerate(words) for t in ([word, eos] if i % every == 0 else [word])]
    for shift in range(MAX_WINDOW + 1):  # so window restarts land on every kind of position
        check(tokenizer, ids[shift:], skip_special_tokens=True)


# ---- stop strings ----------------------------------------------------------------------------------------

def test_stop_string_spanning_tokens_is_cut_and_never_streamed():
    tokenizer = byte_level()
    ids = tokenizer.encode("Permission is hereby granted, free of charge", add_special_tokens=False)
    stop = "hereby gr"
    detok, deltas = check(tokenizer, ids, stop=[stop])
    assert detok.text == "Permission is " and detok.stop_matched == stop
    streamed = ""
    for delta in deltas:
        streamed += delta
        assert "h" not in streamed[len("Permission is "):]


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output(include):
    tokenizer = byte_level()
    ids = tokenizer.encode("copy, modify, merge, publish", add_special_tokens=False)
    detok, _ = check(tokenizer, ids, stop=["merge", "zzz"], include=include)
    assert detok.text == ("copy, modify, merge" if include else "copy, modify, ")


def test_first_completed_stop_wins_and_nothing_follows():
    tokenizer = byte_level()
    ids = tokenizer.encode("abcdef and more text", add_special_tokens=False)
    detok, _ = check(tokenizer, ids, stop=["bcdef", "cd"])  # "cd" completes first
    assert detok.text == "ab" and detok.stop_matched == "cd"
    assert detok.add(ids[:3]) == "" and detok.flush() == "" and detok.text == "ab"


def test_stop_at_the_very_start_and_in_flushed_tail():
    tokenizer = byte_level()
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    assert check(tokenizer, ids, stop=["Hel"])[0].text == ""
    detok, deltas = check(tokenizer, ids, stop=["rld"])  # completes on the last token
    assert detok.text == "Hello wo"
    emoji = tokenizer.encode("ab🎉", add_special_tokens=False)  # the stop sits in text withheld until flush
    assert check(tokenizer, emoji[:-1], stop=["b"])[0].text == "a"


def test_held_back_text_is_released_at_flush():
    tokenizer = byte_level()
    ids = tokenizer.encode("some text here", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["xyzw"])
    streamed = "".join(detok.add([t]) for t in ids)
    assert streamed == "some text h"  # the last len("xyzw") - 1 chars wait for flush
    assert detok.flush() == "ere" and detok.text == "some text here"


@given(name=tokenizer_names, data=st.data())
@SETTINGS
def test_random_stops(name, data):
    tokenizer = TOKENIZERS[name]()
    text = data.draw(st.text(alphabet=st.sampled_from(list("ab cé你🎉")), min_size=1, max_size=40))
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoded = tokenizer.decode(ids)
    pieces = [decoded[i:j] for i in range(len(decoded)) for j in range(i + 1, min(len(decoded), i + 5) + 1)]
    stops = data.draw(st.lists(st.sampled_from(pieces) if pieces else st.just("zz"), max_size=3))
    stops += data.draw(st.lists(st.text(alphabet="abz", min_size=1, max_size=4), max_size=2))
    chunks = data.draw(st.lists(st.integers(1, 3), min_size=len(ids), max_size=len(ids)))
    include = data.draw(st.booleans())
    detok, deltas = check(tokenizer, ids, chunks, stop=stops, include=include)
    final = detok.text
    streamed = ""
    for delta in deltas:  # every intermediate state is a prefix of the final (stop-free) text
        streamed += delta
        assert final.startswith(streamed)


# ---- cost --------------------------------------------------------------------------------------------------

class _CountingBackend:
    def __init__(self, backend):
        self.backend, self.lengths = backend, []

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id):
        return self.backend.id_to_token(token_id)


class _CountingTokenizer:
    clean_up_tokenization_spaces = False

    def __init__(self, tokenizer):
        self.backend_tokenizer = _CountingBackend(tokenizer.backend_tokenizer)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_decodes_only_a_short_window(name):
    tokenizer = TOKENIZERS[name]()
    ids = tokenizer.encode("the terms of this license " * 60, add_special_tokens=False)
    counting = _CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting)
    text = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert text == tokenizer.decode(ids)
    lengths = counting.backend_tokenizer.lengths
    assert max(lengths) <= MAX_WINDOW + 2 and len(lengths) < 1.2 * len(ids)


# ---- add_token: the engine's one-token-per-step call -----------------------------------------------------

def stream_add_token(tokenizer, ids, **kwargs):
    """Feed ids one at a time through add_token, next to a twin fed through add([id]): same deltas each step."""
    fast = IncrementalDetokenizer(tokenizer, **kwargs)
    slow = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas = []
    for token_id in ids:
        delta = fast.add_token(token_id)
        assert delta == slow.add([token_id])
        assert fast.stop_matched == slow.stop_matched and fast.text == slow.text
        deltas.append(delta)
        if fast.stop_matched is not None:
            break
    deltas.append(fast.flush())
    assert deltas[-1] == slow.flush() and fast.text == slow.text
    assert fast.add_token(ids[0] if ids else 0) == "" and fast.text == slow.text  # finished: nothing more
    return fast, deltas


def test_add_token_uses_a_whole_character_table_only_for_byte_level_without_stops():
    assert IncrementalDetokenizer(byte_level())._texts is not None
    assert IncrementalDetokenizer(byte_level(), stop=["x"])._texts is None
    for name in ("byte_level_window", "unigram_metaspace", "bpe_byte_fallback"):
        assert IncrementalDetokenizer(TOKENIZERS[name]())._texts is None


@given(name=tokenizer_names, data=st.data())
@SETTINGS
def test_add_token_matches_add_for_any_ids(name, data):
    """Arbitrary ids (lone bytes, specials, ids past the tokenizer's vocab), with and without stop strings."""
    tokenizer = TOKENIZERS[name]()
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) + 3), max_size=40))
    skip = data.draw(st.booleans())
    stop = data.draw(st.sampled_from([(), ("e",), ("the", "\ufffd")]))
    _, deltas = stream_add_token(tokenizer, ids, skip_special_tokens=skip, stop=list(stop))
    if not stop:
        expected = tokenizer.decode([t for t in ids if t < len(tokenizer)], skip_special_tokens=skip)
        assert "".join(deltas) == expected


@given(pieces=st.lists(st.sampled_from(TRICKY_UTF8 + [b"a", b" ", "é你🎉".encode()]), max_size=12))
@SETTINGS
def test_add_token_on_split_and_invalid_utf8(pieces):
    tokenizer = byte_level()
    ids = byte_token_ids(tokenizer, b"".join(pieces))
    _, deltas = stream_add_token(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids)
