"""Incremental detokenization with stop strings: the deltas concatenate to exactly tokenizer.decode(output_ids)
(replacement characters included), cut at the first stop string.

Byte-level BPE (GPT-2, Llama 3, Qwen) decodes as the UTF-8 of the tokens' concatenated bytes, from a per-token
bytes table. Other tokenizers decode a short window of the latest tokens and commit the text later tokens can no
longer change: nothing while the window ends inside a character (U+FFFD, or a <0xNN> byte token), and the window
starts a few tokens back, at a committed point, for decoders that drop the first token's leading space.
"""
from __future__ import annotations

import codecs
import contextlib
import weakref
from collections.abc import Sequence

from tokenizers import decoders

REPLACEMENT = "\ufffd"
MAX_WINDOW = 12  # tokens decoded per step before the window start moves up to the previous commit


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False):
        self._decode = _decode_fn(tokenizer, skip_special_tokens)
        self._id_to_token = _id_to_token_fn(tokenizer)
        tables = _byte_tables(tokenizer, skip_special_tokens)  # None: not byte-level, use the window
        self._bytes = tables[0] if tables else None
        self._tail = b""  # byte-level path: bytes of a character not complete yet
        self.stop = [s for s in stop if s]
        # add_token's table, for byte-level without stop strings (None once finished)
        self._texts = tables[1] if tables and not self.stop else None
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_matched: str | None = None
        self._hold = withheld_chars(self.stop)
        self._ids: list[int] = []  # window path: the output ids
        self._start = 0  # window start: a token index where the decoded text splits cleanly
        self._sent = 0  # chars of the window's text already committed
        self._committed_at = 0  # token index up to which the text is committed
        self._held = ""  # committed text withheld for stop-string matching
        self._parts: list[str] = []  # released text
        self._flushed = False

    @property
    def text(self) -> str:
        """All text released so far (after flush(): the final text)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def finished(self) -> bool:
        return self.stop_matched is not None or self._flushed

    def add_token(self, token_id: int) -> str:
        """add([token_id]); for byte-level tokenizers without stop strings, a table lookup or the UTF-8 decode."""
        texts = self._texts
        if texts is None:
            return self.add((token_id,))
        if not self._tail:
            try:
                text = texts[token_id]
            except IndexError:  # past the tokenizer's vocab: decoded (as nothing) below
                text = None
            if text is not None:
                if text:
                    self._parts.append(text)
                return text
        table = self._bytes
        text = self._decode_bytes(table[token_id] if token_id < len(table) else b"")
        if text:
            self._parts.append(text)
        return text

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append generated tokens; return the newly released text (possibly "")."""
        if self.finished or not new_token_ids:
            return ""
        if self._bytes is not None:
            return self._release(self._decode_bytes(token_bytes(self._bytes, new_token_ids)), final=False)
        self._ids.extend(new_token_ids)
        return self._release(self._decode_new(), final=False)

    def flush(self) -> str:
        """At the end of the request: release everything withheld (unless a stop string already matched)."""
        if self.finished:
            return ""
        self._texts = None  # add_token must not bypass the finished check from now on
        if self._bytes is not None:
            rest = self._decode_bytes(b"", final=True)
        else:
            window = self._decode(self._ids[self._start:])
            rest, self._sent = window[self._sent:], len(window)
        self._flushed = True
        return self._release(rest, final=True)

    def _decode_bytes(self, data: bytes, final: bool = False) -> str:
        """Byte-level path: UTF-8 of the pending bytes and data; an unfinished character waits in self._tail."""
        data = self._tail + data
        text, used = codecs.utf_8_decode(data, "replace", final)
        self._tail = data[used:]
        return text

    def _decode_new(self) -> str:
        """Text the new tokens settle, or "" while the window may still change (ends inside a character)."""
        window = self._decode(self._ids[self._start:])
        if window.endswith(REPLACEMENT) or self._ends_in_byte_token():
            return ""
        new_text, self._sent = window[self._sent:], max(self._sent, len(window))
        self._slide_window()
        return new_text

    def _ends_in_byte_token(self) -> bool:
        """SentencePiece byte fallback decodes a run of <0xNN> tokens as a whole (one bad byte spoils the run)."""
        token = self._id_to_token(self._ids[-1])
        return token is not None and len(token) == 6 and token.startswith("<0x") and token.endswith(">")

    def _slide_window(self) -> None:
        """At a commit point: restart a long window at the previous commit point, provided the tokens since then
        show some text (so the next token is never the first one decoded)."""
        end = len(self._ids)
        if end - self._start > MAX_WINDOW:
            context = self._decode(self._ids[self._committed_at:end])
            if context:
                self._start, self._sent = self._committed_at, len(context)
        self._committed_at = end

    def _release(self, new_text: str, final: bool) -> str:
        """Search stop strings in the withheld + new text; release what can no longer be part of a stop."""
        pending = self._held + new_text
        self._held = ""
        match = earliest_stop(pending, self.stop) if self.stop else None
        if match is not None:
            stop, start = match
            self.stop_matched = stop
            pending = pending[:start + len(stop) if self.include_stop_str_in_output else start]
        elif not final and self._hold:
            cut = max(0, len(pending) - self._hold)
            pending, self._held = pending[:cut], pending[cut:]
        if pending:
            self._parts.append(pending)
        return pending


def withheld_chars(stops) -> int:
    """Characters of released text kept back so that no stop string is streamed in part: the longest - 1."""
    return max((len(s) for s in stops if s), default=1) - 1


def earliest_stop(text: str, stops: list[str]) -> tuple[str, int] | None:
    """The stop string occurrence that ends first (the one a token-by-token stream completes first);
    on a tie the longer one. Returns (stop, start index)."""
    best = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < (best[1] + len(best[0]), best[1])):
            best = (stop, start)
    return best


def token_bytes(table: list[bytes], token_ids: Sequence[int]) -> bytes:
    """The tokens' bytes; ids past the tokenizer's vocab (padded embedding rows) are dropped, as decode() does."""
    try:
        return b"".join([table[i] for i in token_ids])
    except IndexError:
        return b"".join([table[i] for i in token_ids if i < len(table)])


def _decode_fn(tokenizer, skip_special_tokens: bool):
    """The Rust tokenizer's decode when it is what tokenizer.decode does anyway (no clean-up pass): ~3x cheaper."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _id_to_token_fn(tokenizer):
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if hasattr(backend, "id_to_token"):
        return backend.id_to_token
    return tokenizer.convert_ids_to_tokens


_BYTE_TABLES = weakref.WeakKeyDictionary()  # tokenizer -> {skip_special_tokens: (bytes, texts) per id} or None


def _byte_tables(tokenizer, skip_special_tokens: bool) -> tuple[list[bytes], list[str | None]] | None:
    """Per token id, the bytes it contributes to tokenizer.decode() (b"" for skipped specials) and its text where
    those bytes are whole UTF-8 characters (else None); None when decode is not plain byte-level UTF-8. Built once
    per tokenizer."""
    try:
        tables = _BYTE_TABLES[tokenizer]
    except (KeyError, TypeError):
        tables = _build_byte_tables(tokenizer)
        with contextlib.suppress(TypeError):  # not weak-referenceable: rebuilt next time
            _BYTE_TABLES[tokenizer] = tables
    return None if tables is None else tables[skip_special_tokens]


def _whole_chars(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:  # part of a character, or invalid: the incremental decoder decides
        return None


def _build_byte_tables(tokenizer) -> dict[bool, tuple[list[bytes], list[str | None]]] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False)
            or not isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)):
        return None
    byte_of = _byte_level_alphabet()
    added = backend.get_added_tokens_decoder()
    table = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        token = added[token_id].content if token_id in added else backend.id_to_token(token_id)
        if token is None:
            table.append(b"")
        elif token_id in added or not all(c in byte_of for c in token):
            table.append(token.encode())
        else:
            table.append(bytes(byte_of[c] for c in token))
    # Trust the table only if it reproduces decode() for every single token.
    decoded = backend.decode_batch([[i] for i in range(len(table))], skip_special_tokens=False)
    if any(raw.decode("utf-8", "replace") != text for raw, text in zip(table, decoded)):
        return None
    skipping = list(table)
    for token_id, token in added.items():
        if token.special and token_id < len(table):
            skipping[token_id] = b""
    return {skip: (t, [_whole_chars(raw) for raw in t]) for skip, t in ((False, table), (True, skipping))}


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level alphabet: printable bytes stand for themselves, the other bytes for chr(256 + n)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return alphabet
