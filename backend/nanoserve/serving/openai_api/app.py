"""The FastAPI application: routes, OpenAI-style errors, and cancelling the Triton request of a client that
went away (a closed stream is cancelled by Starlette; a waiting non-streamed request by unless_disconnected).
GET /metrics passes tritonserver's Prometheus page on: vLLM serves it on its API's port, and routers that pick a
replica from its metrics (the Gateway API Inference Extension's endpoint picker) scrape the port they route to."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import AsyncIterator

import tritonclient.grpc.aio as grpcaio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from nanoserve.serving.openai_api.chat import render_chat
from nanoserve.serving.openai_api.errors import APIError, bad_request, from_field_error
from nanoserve.serving.openai_api.formats import ChatFormat, CompletionFormat, Format
from nanoserve.serving.openai_api.models import ModelRegistry, Target
from nanoserve.serving.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from nanoserve.serving.openai_api.triton import Chunk, generate, request_inputs


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def create_app(grpc_url: str, repository: Path, metrics_url: str | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        client = grpcaio.InferenceServerClient(grpc_url)  # on the server's event loop
        app.state.client, app.state.models, app.state.started = client, ModelRegistry(client, repository), time.time()
        yield
        await client.close()

    app = FastAPI(title="nanoserve OpenAI-compatible API", lifespan=lifespan)
    app.add_exception_handler(APIError, lambda request, error: error.response())
    app.add_exception_handler(RequestValidationError, lambda request, error: validation_error(error).response())

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        models = request.app.state.models
        names = await models.refresh()
        created = int(request.app.state.started)
        entries = [{"id": name, "object": "model", "created": created, "owned_by": "nanoserve"} for name in names]
        entries += [{"id": adapter, "object": "model", "created": created, "owned_by": "nanoserve", "parent": model}
                    for adapter, model in models.adapters.items()]  # LoRA adapters, as vLLM lists them
        return {"object": "list", "data": entries}

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        ready = await request.app.state.client.is_server_ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        if metrics_url is None:
            return PlainTextResponse("no metrics", status_code=404)
        try:
            text = await asyncio.to_thread(read_text, metrics_url)
        except (urllib.error.URLError, OSError) as e:
            return PlainTextResponse(f"tritonserver's metrics: {e}", status_code=503)
        return PlainTextResponse(text, media_type=PROMETHEUS_TEXT)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.check_utf8()
        target = await request.app.state.models.require(body.model)
        prompt = body.prompt_text()
        return await respond(request, CompletionFormat(body, prompt), target)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        body.check_utf8()
        models = request.app.state.models
        target = await models.require(body.model)
        messages = [message.template_dict() for message in body.messages]
        prompt = render_chat(await models.tokenizer(target.model), messages, body.chat_template_kwargs)
        return await respond(request, ChatFormat(body, prompt), target)

    return app


def read_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def validation_error(error: RequestValidationError) -> APIError:
    """pydantic's first complaint as a 400 naming the parameter ("messages.0.content", ...)."""
    first = error.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        return bad_request(f"{param}: unknown or unsupported parameter", param)
    if first.get("type") == "json_invalid":
        return bad_request(f"invalid JSON body: {first.get('msg')}")
    return bad_request(f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param)


async def respond(request: Request, fmt: Format, target: Target):
    body = fmt.request
    parameters = body.sampling_parameters()
    if target.lora_name is not None:
        parameters["lora_name"] = target.lora_name
    inputs = request_inputs(fmt.prompt, parameters, body.stream, body.top_logprobs_count is not None)
    chunks = generate(request.app.state.client, target.model, inputs, request_id=uuid.uuid4().hex)
    try:
        if not body.stream:
            return JSONResponse(fmt.full(await unless_disconnected(request, collect(chunks))))
        first = await unless_disconnected(request, anext(chunks))  # an error before any text is an HTTP error
    except ClientGone:
        return JSONResponse({}, status_code=499)  # nobody reads it
    except APIError as error:  # the engine's checks (e.g. logprobs against max_logprobs) name its parameters
        names = body.sampling_values()[1]
        raise from_field_error(error.message, names) if error.status == 400 and error.param in names else error
    return StreamingResponse(sse(fmt, first, chunks), media_type="text/event-stream")


async def collect(chunks: AsyncIterator[Chunk]) -> list[Chunk]:
    return [chunk async for chunk in chunks]


async def unless_disconnected(request: Request, awaitable):
    """awaitable's result; when the client disconnects first it is cancelled (so is its Triton request)."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not work.done():
        work.cancel()
        raise ClientGone()
    return work.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def sse(fmt: Format, first: Chunk, chunks: AsyncIterator[Chunk]) -> AsyncIterator[str]:
    """Server-sent events: the format's opening events, one per chunk, the usage, then [DONE]. An error midway
    is an error event. When the client disconnects, Starlette cancels this (and so the Triton request)."""
    try:
        for event in fmt.start() + fmt.events(first):
            yield _event(event)
        async for chunk in chunks:
            for event in fmt.events(chunk):
                yield _event(event)
        for event in fmt.end():
            yield _event(event)
    except APIError as error:
        yield _event(error.body())
    yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
