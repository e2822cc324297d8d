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
from nanoserve.errors import RequestError
from nanoserve.serving.openai_api.errors import APIError, api_error, bad_request
from nanoserve.serving.openai_api.formats import ChatFormat, CompletionFormat, Format
from nanoserve.serving.openai_api.models import ModelRegistry, Target
from nanoserve.serving.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from nanoserve.engine.tokenize import encode_prompt_text, token_decoder
from nanoserve.serving.openai_api.tokenizer_routes import add_tokenizer_routes
from nanoserve.serving.openai_api.tools import Parser, check_tool_choice, make_parser
from nanoserve.serving.openai_api.triton import Chunk, generate, request_inputs


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def create_app(grpc_url: str, repository: Path, metrics_url: str | None = None,
               tool_call_parser: str | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        client = grpcaio.InferenceServerClient(grpc_url)  # on the server's event loop
        app.state.client, app.state.models, app.state.started = client, ModelRegistry(client, repository), time.time()
        yield
        await client.close()

    app = FastAPI(title="nanoserve OpenAI-compatible API", lifespan=lifespan)
    app.add_exception_handler(APIError, lambda request, error: error.response())
    app.add_exception_handler(RequestError, lambda request, error: api_error(error).response())
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
        body.check()
        models = request.app.state.models
        target = await models.require(body.model)
        tokenizer = await models.tokenizer(target.model)
        fmt = await asyncio.to_thread(completion_format, body, tokenizer)
        return await respond(request, fmt, target)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        body.check()
        models = request.app.state.models
        target = await models.require(body.model)
        fmt = chat_format(body, await models.tokenizer(target.model), make_parser(tool_call_parser))
        return await respond(request, fmt, target)

    add_tokenizer_routes(app)
    return app


def chat_format(body: ChatCompletionRequest, tokenizer, parser: Parser | None) -> ChatFormat:
    """The messages rendered with the chat template, with the tools unless tool_choice is "none"."""
    tool_choice = check_tool_choice(body.tool_choice_value, body.functions, parser)
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools and tool_choice != "none" \
        else None
    messages = [message.template_dict() for message in body.messages]
    prompt = render_chat(tokenizer, messages, body.chat_template_kwargs, tools=tools)
    return ChatFormat(body, [prompt], tool_choice, parser)


def completion_format(body: CompletionRequest, tokenizer) -> CompletionFormat:
    """The request's prompts as the engine takes them, and what echo shows of them. With echo and logprobs a text
    prompt is tokenized here (as the engine would: engine/tokenize.py), so that its first token is known."""
    prompts = body.prompts(len(tokenizer))
    echoes = [prompt if isinstance(prompt, str) else tokenizer.decode(prompt) for prompt in prompts]
    first_tokens = []
    if body.echoes_logprobs:
        prompts = [encode_prompt_text(tokenizer, p) if isinstance(p, str) else p for p in prompts]
        token_text = token_decoder(tokenizer)
        first_tokens = [token_text(prompt[0]) for prompt in prompts]
    return CompletionFormat(body, prompts, echoes, first_tokens)


def read_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def validation_error(error: RequestValidationError) -> APIError:
    """pydantic's first complaint as a 400 naming the parameter ("messages.0.content", ...)."""
    first = error.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        return bad_request(param, "unknown or unsupported parameter")
    if first.get("type") == "json_invalid":
        return bad_request(None, f"invalid JSON body: {first.get('msg')}")
    return bad_request(param, str(first.get("msg")))


async def respond(request: Request, fmt: Format, target: Target):
    body = fmt.request
    parameters = body.sampling_parameters()
    if target.lora_name is not None:
        parameters["lora_name"] = target.lora_name
    prompt_logprobs = getattr(body, "wants_prompt_logprobs", False)
    names = body.sampling_values()[1]  # the engine's checks (e.g. logprobs against max_logprobs) name its parameters
    streams = [generate(request.app.state.client, target.model,
                        request_inputs(prompt, parameters, body.stream, body.top_logprobs_count is not None,
                                       prompt_logprobs), uuid.uuid4().hex, index, names)
               for index, prompt in enumerate(fmt.prompts)]
    chunks = streams[0] if len(streams) == 1 else merged(streams)
    try:
        if not body.stream:
            return JSONResponse(fmt.full(await unless_disconnected(request, collect(chunks))))
        first = await unless_disconnected(request, anext(chunks))  # an error before any text is an HTTP error
    except ClientGone:
        return JSONResponse({}, status_code=499)  # nobody reads it
    return StreamingResponse(sse(fmt, first, chunks), media_type="text/event-stream")


async def merged(streams: list[AsyncIterator[Chunk]]) -> AsyncIterator[Chunk]:
    """The chunks of several requests as they come; the first error ends them all. Leaving early (the client went
    away) cancels every request's gRPC call."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in stream:
                await queue.put(chunk)
        except Exception as error:  # noqa: BLE001 - handed to the consumer
            await queue.put(error)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
    except RequestError as error:
        yield _event(api_error(error).body())
    yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
