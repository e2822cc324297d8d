"""The ensemble (preprocessing -> token-level engine -> postprocessing) and its stateless detokenization.

Detokenizing each streamed chunk on its own loses spaces and splits multi-byte characters (the TRT-LLM
ensemble's known bug). Here the token model sends with every response the CONTEXT_IDS output ids that precede
the new ones, and the postprocessing model computes the delta from those alone:

    delta = committed(context + new) - committed(context)      (the last response: all of context + new)

committed(ids) is the text of ids up to the last point no later token can change: not inside a character
(the text would end with U+FFFD) nor after a SentencePiece <0xNN> byte token (a run of those decodes as a
whole). The engine's IncrementalDetokenizer commits at the same points, so the deltas concatenate to the text
the text model returns; whatever decoding does at the window's start (a dropped leading space, a cut character)
is the same on both sides of the subtraction and cancels.
Each response also carries the request's skip_special_tokens, which the postprocessing decodes with.
Stop strings end generation in the token model too, but the postprocessing does not know them: the ensemble's
text includes the tokens that completed the match (the text model cuts it before the stop string).
"""
from __future__ import annotations

import json
import os

import numpy as np

from nanoserve.engine.detokenizer import REPLACEMENT
from nanoserve.engine.tokenize import encode_prompt_text
from nanoserve.serving.responses import Stream, optional_arrays, string_array

CONTEXT_IDS = 16


# ---- token model side (a formatter for the response thread) ---------------------------------------------
def token_arrays(stream: Stream, output) -> dict | None:
    """Token-level engine: output_ids (new ids; all of them when not streaming), context_ids, finish_reason
    ("" until the last response) and skip_special_tokens in every response, so postprocessing needs no state."""
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
    context = earlier[-CONTEXT_IDS:]  # output only: the engine decodes the output without the prompt
    return {**optional_arrays(request, output, logprobs, num_output),
            "output_ids": np.array(new_ids, dtype=np.int32),
            "context_ids": np.array(context, dtype=np.int32),
            "finish_reason": string_array(output.finish_reason or ""),
            "skip_special_tokens": np.array([request.sampling_params.skip_special_tokens], dtype=bool)}


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
    ids = list(context_ids) + list(new_ids)
    after = (tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if final
             else _committed(tokenizer, ids, skip_special_tokens))
    return after[len(_committed(tokenizer, list(context_ids), skip_special_tokens)):]


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
def encode_prompt(tokenizer, text: str, chat: bool = False) -> list[int]:
    """Token ids as the text model's engine computes them. chat: render the tokenizer's chat template, text being
    a JSON list of {"role", "content"} messages or else one user message."""
    if not chat:
        return encode_prompt_text(tokenizer, text)
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
