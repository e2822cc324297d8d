"""How a text prompt becomes token ids: one definition for the engine, the serving front end and the ensemble's
preprocessing model, so that every path feeds the model the same ids. Imports nothing heavy.

A prompt that cannot fit is rejected before it is tokenized (tokenizing a multi-MB text takes seconds and
hundreds of MB): a token stands for at most `max_token_bytes(tokenizer)` bytes of text, so a text of B bytes is
at least B / max_token_bytes tokens.
"""

import functools

from nanoserve.errors import RequestError

# NFC/NFKC normalization can compose up to three characters into one (Hangul jamo) before the text is split.
NORMALIZER_SLACK = 3


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes of prompt text one token can stand for (compute once per tokenizer: it walks the
    vocabulary). The longest vocabulary entry's UTF-8 length bounds it: a byte-level BPE entry has one
    character per byte it encodes, a SentencePiece one a 3-byte "▁" per space. Times NORMALIZER_SLACK when the
    tokenizer normalizes the text first (or its pipeline is not known)."""
    longest = max((len(token.encode("utf-8")) for token in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalizes = backend is None or backend.normalizer is not None
    return max(longest, 1) * (NORMALIZER_SLACK if normalizes else 1)


def max_prompt_bytes(tokenizer, max_model_len: int) -> int:
    """The longest text (UTF-8 bytes) that may still leave room for one generated token within max_model_len."""
    return (max_model_len - 1) * max_token_bytes(tokenizer)


def check_prompt_bytes(text: str, max_bytes: int | None) -> None:
    error = prompt_bytes_error(text, max_bytes)
    if error is not None:
        raise error


def prompt_bytes_error(text: str, max_bytes: int | None) -> RequestError | None:
    """The error that rejects a text too long to fit max_model_len; None for one that may fit."""
    if max_bytes is None:
        return None
    size = len(text.encode("utf-8"))
    if size <= max_bytes:
        return None
    return RequestError("prompt", f"{size} bytes of text cannot fit max_model_len (at most {max_bytes} bytes for "
                                  f"this tokenizer); rejected without tokenizing")


def encode_prompt_text(tokenizer, text: str, max_bytes: int | None = None) -> list[int]:
    """One text's token ids (encode_prompt_texts); max_bytes (max_prompt_bytes): a longer text is rejected with a
    RequestError (a ValueError) naming the prompt, untokenized."""
    (encoded,) = encode_prompt_texts(tokenizer, [text], max_bytes)
    if isinstance(encoded, RequestError):
        raise encoded
    return encoded


def encode_prompt_texts(tokenizer, texts: list[str], max_bytes: int | None) -> list[list[int] | RequestError]:
    """Each text's token ids with the tokenizer's special tokens, in one call to the tokenizer (a fast tokenizer
    encodes a batch without holding the GIL); a text that cannot fit gets its RequestError in its place (made,
    never raised: a caught exception's traceback would hold this frame, and with it every text, until the cycle
    collector runs)."""
    results = [prompt_bytes_error(text, max_bytes) for text in texts]
    fitting = [text for text, result in zip(texts, results) if result is None]
    encoded = iter(tokenizer(fitting, add_special_tokens=True, return_attention_mask=False)["input_ids"]
                   if fitting else ())
    return [next(encoded) if result is None else result for result in results]


def token_decoder(tokenizer):
    """token id -> its text alone, as vLLM's decoded_token (cached: a vocabulary's worth at most)."""
    @functools.lru_cache(maxsize=None)
    def token_text(token_id: int) -> str:
        return tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(token_id)])
    return token_text
