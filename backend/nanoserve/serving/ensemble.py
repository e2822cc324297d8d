"""The ensemble (preprocessing -> token-level engine -> postprocessing) and its stateless detokenization.

Detokenizing each streamed chunk on its own loses spaces and splits multi-byte characters (the TRT-LLM
ensemble's known bug). Here the token model sends with every response the CONTEXT_IDS ids that precede the new
ones (prompt tail, then earlier output), and the postprocessing model computes the delta from those alone:

    delta = settled(decode(context + new)) - settled(decode(context))

where settled() drops a trailing U+FFFD (an incomplete UTF-8 sequence: held back until the bytes that complete it
arrive; the final response keeps it). Text that decoding renders differently at the window's start (a leading
space, a cut character) is the same on both sides and cancels, so the deltas concatenate to the text of the whole
output, as the engine's own detokenizer produces it for the text model.
"""
from __future__ import annotations

import json
import os

import numpy as np

from nanoserve.serving.responses import Stream, optional_arrays

CONTEXT_IDS = 16
REPLACEMENT_CHAR = "\ufffd"


# ---- token model side (a formatter for the response thread) ---------------------------------------------
def token_arrays(stream: Stream, output) -> dict | None:
    """Token-level engine: output_ids (new ids; all of them when not streaming), context_ids and finish_reason
    ("" until the last response) in every response, so postprocessing needs no state."""
    request = stream.request
    if request.stream:
        if not (output.new_token_ids or output.finished):
            return None
        new_ids, logprobs, num_output = output.new_token_ids, output.new_logprobs, len(output.new_token_ids)
        earlier = stream.token_ids
    else:
        stream.logprobs += output.new_logprobs
        if not output.finished:
            return None
        new_ids, logprobs, num_output = stream.token_ids + output.new_token_ids, stream.logprobs, \
            output.num_output_tokens
        earlier = []
    context = (request.prompt[-CONTEXT_IDS:] + earlier[-CONTEXT_IDS:])[-CONTEXT_IDS:]
    return {**optional_arrays(request, output, logprobs, num_output),
            "output_ids": np.array(new_ids, dtype=np.int32),
            "context_ids": np.array(context, dtype=np.int32),
            "finish_reason": np.array([(output.finish_reason or "").encode()], dtype=np.object_)}


def engine_tokenizer(args: dict):
    """Pre/postprocessing: the tokenizer of the engine model named by the config parameter "engine_model" (a
    model in the same repository), so the checkpoint is configured in one model.json."""
    from transformers import AutoTokenizer

    from nanoserve.serving.model_json import tokenizer_dir

    parameters = json.loads(args["model_config"]).get("parameters", {})
    engine_model = parameters.get("engine_model", {}).get("string_value", "nanoserve_tokens")
    engine_dir = os.path.join(os.path.dirname(args["model_repository"]), engine_model)
    return AutoTokenizer.from_pretrained(tokenizer_dir(engine_dir))


# ---- postprocessing side --------------------------------------------------------------------------------
def decode_delta(tokenizer, context_ids: list[int], new_ids: list[int], final: bool,
                 skip_special_tokens: bool = True) -> str:
    before = _settled(tokenizer.decode(context_ids, skip_special_tokens=skip_special_tokens))
    after = tokenizer.decode(list(context_ids) + list(new_ids), skip_special_tokens=skip_special_tokens)
    if not final:
        after = _settled(after)
    return after[len(before):]


def _settled(text: str) -> str:
    return text.rstrip(REPLACEMENT_CHAR)


# ---- preprocessing side ---------------------------------------------------------------------------------
def encode_prompt(tokenizer, text: str, chat: bool = False) -> list[int]:
    """Token ids as the text model's engine computes them. chat: render the tokenizer's chat template, text being
    a JSON list of {"role", "content"} messages or else one user message."""
    if not chat:
        return tokenizer.encode(text, add_special_tokens=True)
    if tokenizer.chat_template is None:
        raise ValueError("apply_chat_template: the tokenizer has no chat template")
    messages = _messages(text)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
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
