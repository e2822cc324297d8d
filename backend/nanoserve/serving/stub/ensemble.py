"""The ensemble (preprocessing -> token-level engine -> postprocessing) and its stateless detokenization.

Detokenizing each streamed chunk on its own loses spaces and splits multi-byte characters (the TRT-LLM
ensemble's known bug). Here the token model sends with every response the CONTEXT_SIZE output ids that precede
the new ones, and the postprocessing model computes the delta from those alone:

    delta = committed(context + new) - committed(context)      (the last response: all of context + new)

committed(ids) is the text of ids up to the last point no later token can change: not inside a character
(the text would end with U+FFFD) nor after a SentencePiece <0xNN> byte token (a run of those decodes as a
whole). The engine's IncrementalDetokenizer commits at the same points, so the deltas concatenate to the text
the text model returns; whatever decoding does at the window's start (a dropped leading space, a cut character)
is the same on both sides of the subtraction and cancels.
Each response also carries the request's detokenize_params (skip_special_tokens, stop strings and
include_stop_str_in_output). Stop strings are applied as the engine applies them: the last (longest stop - 1)
characters of the committed text are withheld until no stop string can start in them, and the final text is cut
at the earliest stop. Withheld text is recomputed from the window, not remembered, so with stop strings the
window grows by 4 ids per withheld character (a character is at most 4 tokens: one per UTF-8 byte). Skipped
special tokens add no text: the window holds its size in the ids that decoding keeps, a run of skipped ones cut
to one id (DecodeContext).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import numpy as np

from nanoserve.engine.detokenizer import REPLACEMENT, earliest_stop, withheld_chars
from nanoserve.engine.tokenize import check_prompt_bytes, encode_prompt_text, max_prompt_bytes
from nanoserve.engine.tokenize import token_decoder
from nanoserve.errors import RequestError
from nanoserve.sampling_params import SamplingParams
from nanoserve.serving.shared.contracts.token_model import (CONTEXT_IDS, DETOKENIZE_KEYS, DETOKENIZE_PARAMS,
                                                             FINISH_REASON, FINISH_REASONS, OUTPUT_IDS, REQUEST_ID)
from nanoserve.serving.shared.model_json import max_model_len_bound, tokenizer_dir
from nanoserve.serving.stub.request import json_object, required, single, utf8
from nanoserve.serving.stub.responses import (Entry, Generated, Stream, accumulate, finish_reason_text, optional_arrays,
                                              prompt_logprobs_of, whole_generated)

CONTEXT_SIZE = 16  # ids of context per response, without stop strings
CANCEL_CHECK_INTERVAL = 0.1  # seconds between two asks whether one stream's client cancelled


# ---- token model side (a formatter for the response thread) ---------------------------------------------
def token_formatter(tokenizer, send_empty: bool = False):
    """The token model's formatter for the response thread, knowing the engine tokenizer's special ids. Every
    streamed step has new ids to send, so send_empty (see text_formatter) changes nothing here."""
    special_ids = special_token_ids(tokenizer)
    token_text = token_decoder(tokenizer)
    return lambda stream, outputs: token_arrays(stream, outputs, special_ids, token_text)


def special_token_ids(tokenizer) -> frozenset[int]:
    """The ids that decoding with skip_special_tokens drops."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(tokenizer.all_special_ids) | {i for i, token in added.items() if token.special}


@dataclass
class DecodeContext:
    """A streamed request's decode context, kept in stream.formatter_state: what every response carries, built
    once, and the tail of its output ids, a run of skipped special ids cut to its first. The cut changes no
    decoded text (decoding drops them all) and no point where text can be committed (after any of them the text is
    the same), so a run of them, however long, never pushes the text ids out of the window."""
    size: int  # ids of context per response that decoding keeps: context_size(params)
    params: np.ndarray  # detokenize_params, as sent
    skipped: frozenset  # the ids decoding drops: the special ids when skip_special_tokens, else none
    tail: list[int] = field(default_factory=list)  # the latest output ids, skipped runs cut to one id

    @classmethod
    def of(cls, params, special_ids: frozenset) -> "DecodeContext":
        skipped = special_ids if params.skip_special_tokens else frozenset()
        return cls(context_size(params), DETOKENIZE_PARAMS.array(detokenize_params(params)), skipped)

    def window(self) -> list[int]:
        """The shortest end of the tail with `size` ids that decoding keeps (all of it when shorter)."""
        start, kept = len(self.tail), 0
        while start > 0 and kept < self.size:
            start -= 1
            kept += self.tail[start] not in self.skipped
        return self.tail[start:]

    def add(self, ids: list[int]) -> None:
        for i in ids:
            if not (i in self.skipped and self.tail and self.tail[-1] in self.skipped):
                self.tail.append(i)
        if len(self.tail) > 4 * self.size + 2:  # twice the longest window: size kept ids, a skipped one around each
            del self.tail[:-(2 * self.size + 1)]


def token_arrays(stream: Stream, outputs: list, special_ids: frozenset = frozenset(), token_text=str) -> dict | None:
    """Token-level engine: output_ids (new ids; all of them when not streaming), context_ids, finish_reason
    ("None" until the last response) and detokenize_params in every response, so postprocessing needs no state.
    One sequence per request (parse_request refuses n > 1 here): `outputs` is one output."""
    request, (output,) = stream.request, outputs
    if stream.formatter_state is None:
        stream.formatter_state = DecodeContext.of(request.sampling_params, special_ids)
    context = stream.formatter_state
    if request.stream:
        if not (output.new_token_ids or output.finished):
            return None
        generated = Generated(output.new_token_ids, output.new_logprobs, output.new_logprob_ranks)
        window = context.window()  # output only, as the engine decodes it
        context.add(generated.token_ids)
        prompt_logprobs = output.prompt_logprobs
    else:
        if not accumulate(stream, outputs):
            return None
        generated, window, prompt_logprobs = whole_generated(stream.samples[0]), [], prompt_logprobs_of(stream)
    return {**optional_arrays(request, [Entry("", generated, output)], prompt_logprobs, token_text),
            OUTPUT_IDS.name: OUTPUT_IDS.array(generated.token_ids),
            CONTEXT_IDS.name: CONTEXT_IDS.array(window),
            FINISH_REASON.name: FINISH_REASON.array(finish_reason_text(output)),
            DETOKENIZE_PARAMS.name: context.params,
            REQUEST_ID.name: REQUEST_ID.array(output.request_id)}


def ended_token_arrays(stream: Stream, request_id: str) -> dict:
    """The last response of a token-model stream that ends early (a cancel it noticed itself, the engine's
    failure, the exit timeout) after it responded: no new ids, finish_reason "abort". Not an error: Triton 2.51's
    ensemble never releases a request one of whose steps failed while another (a postprocessing of an earlier
    response) was still running, so the ensemble would never unload."""
    return {OUTPUT_IDS.name: OUTPUT_IDS.array([]), CONTEXT_IDS.name: CONTEXT_IDS.array([]),
            FINISH_REASON.name: FINISH_REASON.array("abort"), DETOKENIZE_PARAMS.name: stream.formatter_state.params,
            REQUEST_ID.name: REQUEST_ID.array(request_id)}


def context_size(params) -> int:
    """Ids of context per response: CONTEXT_SIZE, plus room for the characters withheld for stop strings."""
    return CONTEXT_SIZE + 4 * withheld_chars(params.stop)


def detokenize_params(params) -> str:
    return json.dumps({"skip_special_tokens": params.skip_special_tokens, "stop": list(params.stop),
                       "include_stop_str_in_output": params.include_stop_str_in_output})


def engine_model(args: dict) -> str:
    """Pre/postprocessing: the engine model named by the config parameter "engine_model" (a model in the same
    repository), so the checkpoint is configured in one model.json."""
    parameters = json.loads(args["model_config"]).get("parameters", {})
    return parameters.get("engine_model", {}).get("string_value", "nanoserve_tokens")


def engine_dir(args: dict) -> str:
    return os.path.join(os.path.dirname(args["model_repository"]), engine_model(args))


def engine_tokenizer(args: dict):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir(engine_dir(args)))


def engine_max_prompt_bytes(args: dict, tokenizer) -> int | None:
    """The longest text the engine model could take (None: unknown), so preprocessing rejects what cannot fit
    before it tokenizes; the engine checks the exact length."""
    max_model_len = max_model_len_bound(engine_dir(args))
    return None if max_model_len is None else max_prompt_bytes(tokenizer, max_model_len)


# ---- postprocessing side --------------------------------------------------------------------------------
class CancelChecks:
    """Which of the ensemble's streams the postprocessing asks now whether their client cancelled: each ask is an
    IPC round trip to tritonserver, so one per stream every CANCEL_CHECK_INTERVAL, none once it was cancelled, and
    a stream is forgotten at its last response."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.next_check: dict[str, float] = {}  # request_id -> when its next ask is due (inf: cancelled)

    def due(self, request_id: str, final: bool) -> bool:
        if final:
            self.next_check.pop(request_id, None)
            return False
        now = self.clock()
        if now < self.next_check.get(request_id, now):
            return False
        self.next_check[request_id] = now + CANCEL_CHECK_INTERVAL
        return True

    def cancelled(self, request_id: str) -> None:
        self.next_check[request_id] = float("inf")
@dataclass
class DetokenizeRequest:
    """The postprocessing model's inputs, checked (ValueError naming the input): what the token model sends."""
    context_ids: list[int]
    new_ids: list[int]
    finish_reason: str
    params: dict  # decode_delta's keyword arguments
    request_id: str | None  # the engine's id for the request, which cancels it (None: no cancellation)

    @classmethod
    def parse(cls, get, max_ids: int | None) -> "DetokenizeRequest":
        """get(name) -> numpy array or None; max_ids bounds each id input (the engine's max_model_len)."""
        reason = utf8(FINISH_REASON.name, single(FINISH_REASON.name, required(get, FINISH_REASON.name)))
        if reason not in FINISH_REASONS:
            raise RequestError("finish_reason", f"must be one of {FINISH_REASONS}, got {reason[:100]!r}")
        params = get(DETOKENIZE_PARAMS.name)
        name = DETOKENIZE_PARAMS.name
        params = {} if params is None else json_object(name, single(name, params))
        request_id = get(REQUEST_ID.name)
        request_id = None if request_id is None else utf8(REQUEST_ID.name, single(REQUEST_ID.name, request_id))
        return cls(_token_ids(get, CONTEXT_IDS.name, max_ids), _token_ids(get, OUTPUT_IDS.name, max_ids), reason,
                   _detokenize_params(params), request_id)


def _token_ids(get, name: str, max_ids: int | None) -> list[int]:
    array = required(get, name)
    if array.dtype.kind not in "iu":
        raise RequestError(name, f"expected integer token ids, got {array.dtype}")
    if max_ids is not None and array.size > max_ids:
        raise RequestError(name, f"at most {max_ids} ids, got {array.size}")
    if array.size and array.min() < 0:
        raise RequestError(name, f"token ids are >= 0, got {array.min()}")
    return array.reshape(-1).tolist()


def _detokenize_params(values: dict) -> dict:
    """The keys detokenize_params() writes, checked as SamplingParams checks them."""
    unknown = sorted(set(values) - set(DETOKENIZE_KEYS))
    if unknown:
        raise RequestError("detokenize_params", f"unknown key {unknown[0]!r} (known: {', '.join(DETOKENIZE_KEYS)})")
    try:
        checked = SamplingParams(**values)
    except ValueError as e:
        raise RequestError.of(e).within("detokenize_params") from None
    return {key: getattr(checked, key) for key in values}


def decode_delta(tokenizer, context_ids: list[int], new_ids: list[int], final: bool, skip_special_tokens=True,
                 stop=(), include_stop_str_in_output=False) -> str:
    ids = list(context_ids) + list(new_ids)
    before = _committed(tokenizer, list(context_ids), skip_special_tokens)
    after = (tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if final
             else _committed(tokenizer, ids, skip_special_tokens))
    stop = [s for s in stop if s]
    hold = withheld_chars(stop)  # as IncrementalDetokenizer withholds; 0 without stop strings
    pending = after[max(0, len(before) - hold):]  # what earlier responses withheld, and the new text
    match = earliest_stop(pending, stop)
    if match is not None:
        matched, start = match
        return pending[:start + len(matched) if include_stop_str_in_output else start]
    return pending if final else pending[:max(0, len(pending) - hold)]


def _committed(tokenizer, ids: list[int], skip_special_tokens: bool) -> str:
    for end in range(len(ids), 0, -1):
        if _is_byte_token(tokenizer.convert_ids_to_tokens(ids[end - 1])):
            continue
        text = tokenizer.decode(ids[:end], skip_special_tokens=skip_special_tokens)
        if not text.endswith(REPLACEMENT):
            return text
    return ""


def _is_byte_token(token) -> bool:
    return token is not None and len(token) == 6 and token.startswith("<0x") and token.endswith(">")


# ---- preprocessing side ---------------------------------------------------------------------------------
def encode_prompt(tokenizer, text: str, chat: bool = False, max_bytes: int | None = None) -> list[int]:
    """Token ids as the text model's engine computes them. chat: render the tokenizer's chat template, text being
    a JSON list of {"role", "content"} messages or else one user message. A text longer than max_bytes
    (max_prompt_bytes) is rejected untokenized."""
    if not chat:
        return encode_prompt_text(tokenizer, text, max_bytes)
    if tokenizer.chat_template is None:
        raise RequestError("apply_chat_template", "the tokenizer has no chat template")
    messages = _messages(text)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    check_prompt_bytes(rendered, max_bytes)
    return tokenizer.encode(rendered, add_special_tokens=False)


def _messages(text: str) -> list[dict]:
    try:
        messages = json.loads(text)
    except json.JSONDecodeError:
        messages = None
    if isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        return messages
    return [{"role": "user", "content": text}]
