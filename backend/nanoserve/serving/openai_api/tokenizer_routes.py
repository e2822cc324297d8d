"""vLLM's /tokenize, /detokenize and /tokenizer_info: a prompt (or chat messages, rendered as
/v1/chat/completions renders them) as the token ids the engine is fed, and token ids back to text, with the served
model's tokenizer."""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from pydantic import Field

from nanoserve.engine.tokenize import token_decoder
from nanoserve.serving.openai_api.chat import render_chat
from nanoserve.serving.openai_api.errors import bad_request
from nanoserve.serving.openai_api.models import Target
from nanoserve.serving.openai_api.protocol import ChatMessage, RequestBody
from nanoserve.serving.shared.model_json import max_model_len_bound


class TokenizeRequest(RequestBody):
    """vLLM's TokenizeCompletionRequest (prompt) or TokenizeChatRequest (messages)."""
    model: str | None = None  # None: the first text model served
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # a prompt: default true; messages: the template writes them
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def add_tokenizer_routes(app: FastAPI) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict:
        body.check()
        target, tokenizer = await model_and_tokenizer(request, body.model)
        ids = await asyncio.to_thread(token_ids, body, tokenizer)
        token_text = token_decoder(tokenizer)
        return {"count": len(ids), "max_model_len": max_model_len(request, target), "tokens": ids,
                "token_strs": [token_text(t) for t in ids] if body.return_token_strs else None}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request, model: str | None = None) -> dict:
        """vLLM's: what a client needs to tokenize as the server does (lm-eval's remote tokenizer reads it)."""
        target, tokenizer = await model_and_tokenizer(request, model)
        return {"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token,
                "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token,
                "chat_template": tokenizer.chat_template, "model_max_length": max_model_len(request, target)}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
        body.check()
        _, tokenizer = await model_and_tokenizer(request, body.model)
        outside = [(i, t) for i, t in enumerate(body.tokens) if not 0 <= t < len(tokenizer)]
        if outside:
            index, token_id = outside[0]
            raise bad_request(f"tokens.{index}", f"token id {token_id} is outside the vocabulary "
                                                 f"[0, {len(tokenizer)})", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}


async def model_and_tokenizer(request: Request, name: str | None) -> tuple[Target, object]:
    models = request.app.state.models
    if name is None:
        served = await models.refresh()
        if not served:
            raise bad_request("model", "no text model is ready")
        name = served[0]
    target = await models.require(name)
    return target, await models.tokenizer(target.model)


def max_model_len(request: Request, target: Target) -> int | None:
    """model.json's max_model_len, else the checkpoint's max_position_embeddings (what the engine takes at most)."""
    models = request.app.state.models
    return max_model_len_bound(str(models.repository / target.model), models.versions[target.model])


def token_ids(body: TokenizeRequest, tokenizer) -> list[int]:
    """What the engine is fed for the prompt, or for the messages as /v1/chat/completions renders them."""
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("prompt", "give prompt or messages, one of them")
    if body.prompt is not None:
        return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    if body.add_special_tokens is not None:
        raise bad_request("add_special_tokens", "only with prompt (the chat template writes the special tokens)")
    messages = [message.template_dict() for message in body.messages]
    text = render_chat(tokenizer, messages, body.chat_template_kwargs, body.add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=True)
