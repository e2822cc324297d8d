"""Stream one completion from nanoserve in Triton: gRPC streaming (default) or HTTP SSE (`generate_stream`).

    python client/stream.py --prompt "What is paged attention?" --max-tokens 64 --stats
    python client/stream.py --protocol http --url 127.0.0.1:8000 "Hello"

Importable: `stream_grpc(...)` / `stream_http(...)` return a `StreamResult`.
"""
from __future__ import annotations

import argparse
import http.client
import json
import queue
import socket
import sys
import time
import urllib.parse
from dataclasses import dataclass, field

from nanoserve.help_format import ArgumentParser
from nanoserve.serving.shared.contracts.vllm_text import TextRequest, TextResponse, accepted_flags, decode_response

DEFAULT_URLS = {"grpc": "127.0.0.1:8001", "http": "127.0.0.1:8000"}
FLAGS = {"stream": True, "exclude_input_in_output": True, "return_num_output_tokens": True,
         "return_finish_reason": True}  # each sent only to a model that declares it (the ensemble has `stream`)


@dataclass
class StreamResult:
    text: str = ""
    deltas: list[str] = field(default_factory=list)
    num_output_tokens: int | None = None  # as counted by the server (None: not returned)
    finish_reason: str | None = None
    ttft: float | None = None  # seconds from sending to the first non-empty delta
    total: float = 0.0  # seconds from sending to the final response

    def add(self, response: TextResponse, elapsed: float) -> str:
        """A response of the request's one sequence; returns its text."""
        delta = response.texts[0] if response.texts else ""
        if delta:
            self.ttft = elapsed if self.ttft is None else self.ttft
            self.deltas.append(delta)
            self.text += delta
        if response.num_output_tokens:  # streamed responses carry the count of their own delta's tokens
            self.num_output_tokens = (self.num_output_tokens or 0) + response.num_output_tokens[0]
        self.finish_reason = (response.finish_reasons or [None])[0] or self.finish_reason
        return delta


def sampling_parameters(max_tokens=None, temperature=None, top_p=None, seed=None, **extra) -> dict:
    """The `sampling_parameters` JSON, with the unset values left to the server's defaults."""
    given = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, **extra)
    return {key: value for key, value in given.items() if value is not None}


def grpc_inputs(prompt: str, params: dict, flags: dict = FLAGS) -> list:
    """The input tensors vllm_backend's clients send (usable with tritonclient.grpc and .grpc.aio)."""
    return TextRequest(prompt, params, flags).grpc_inputs()


def stream_grpc(url: str, model: str, prompt: str, params: dict, on_text=None, timeout: float = 600.0,
                request_id: str = "stream-0") -> StreamResult:
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    result = StreamResult()
    finished = False
    try:
        flags = accepted_flags(FLAGS, (i.name for i in _grpc_metadata(client, model).inputs))
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        start = time.perf_counter()
        client.async_stream_infer(model, grpc_inputs(prompt, params, flags), request_id=request_id,
                                  enable_empty_final_response=True)
        while True:
            try:
                response, error = responses.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"{model}: no response in {timeout} s") from None
            if error is not None:  # an error ends the request (nanoserve sends it as the final response)
                finished = True
                raise RuntimeError(f"{model}: {error}")
            delta = result.add(decode_response(response.as_numpy), time.perf_counter() - start)
            if on_text and delta:
                on_text(delta)
            if response.get_response().parameters["triton_final_response"].bool_param:
                result.total = time.perf_counter() - start
                finished = True
                return result
    finally:
        # Cancel only a request still running: tritonserver 2.51 never releases a request whose stream is cancelled
        # after its final response (before the server ended the stream), and its model then never unloads.
        client.stop_stream(cancel_requests=not finished)
        client.close()


def _grpc_metadata(client, model: str):
    from tritonclient.utils import InferenceServerException

    try:
        return client.get_model_metadata(model)
    except InferenceServerException as e:  # e.g. an unknown model: the same error type as a failed stream
        raise RuntimeError(f"{model}: {e}") from None


def _sse_events(response):
    """The JSON payloads of a Server-Sent Events body (`data: {...}` lines)."""
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data:"):
            yield json.loads(line[len("data:"):])


def open_generate_stream(url: str, model: str, body: dict, timeout: float | None = None) -> socket.socket:
    """A /generate_stream request on a raw socket, so that closing it is a client going away mid-stream."""
    host, port = url.split(":")
    connection = socket.create_connection((host, int(port)), timeout=timeout)
    data = json.dumps(body).encode()
    connection.sendall(b"POST /v2/models/%s/generate_stream HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json"
                       b"\r\nContent-Length: %d\r\n\r\n%s" % (model.encode(), host.encode(), len(data), data))
    return connection


def first_sse_event(connection) -> bytes:
    """What a raw /generate_stream socket received up to its first event (the headers may come on their own)."""
    received = b""
    while b"data:" not in received:
        chunk = connection.recv(65536)
        if not chunk:
            break
        received += chunk
    return received


def stream_http(url: str, model: str, prompt: str, params: dict, on_text=None,
                timeout: float = 600.0) -> StreamResult:
    parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port or 80, timeout=timeout)
    result = StreamResult()
    try:
        conn.request("GET", f"/v2/models/{model}")
        metadata = conn.getresponse()
        if metadata.status != 200:
            raise RuntimeError(f"{model}: HTTP {metadata.status}: {_error_message(metadata.read())}")
        flags = accepted_flags(FLAGS, (i["name"] for i in json.loads(metadata.read()).get("inputs", [])))
        body = TextRequest(prompt, params, flags).generate_body()
        start = time.perf_counter()
        conn.request("POST", f"/v2/models/{model}/generate_stream", json.dumps(body),
                     {"Content-Type": "application/json", "Accept": "text/event-stream"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{model}: HTTP {response.status}: {_error_message(response.read())}")
        for event in _sse_events(response):
            if "error" in event:
                raise RuntimeError(f"{model}: {event['error']}")
            delta = result.add(decode_response(event.get), time.perf_counter() - start)
            if on_text and delta:
                on_text(delta)
        result.total = time.perf_counter() - start
        return result
    except http.client.HTTPException as e:  # e.g. a gRPC port: no HTTP response at all
        raise RuntimeError(f"no HTTP response ({type(e).__name__}: {e}): is this Triton's HTTP port?") from None
    finally:
        conn.close()


def _error_message(body: bytes) -> str:
    """The message of Triton's error body ({"error": ...}, as JSON or as one SSE `data:` event), else the body."""
    text = body.decode(errors="replace").strip()
    payload = text[len("data:"):] if text.startswith("data:") else text
    try:
        return json.loads(payload)["error"]
    except (ValueError, KeyError, TypeError):
        return " ".join(text.split())


def count_tokens(result: StreamResult, tokenizer_dir: str | None) -> int | None:
    if result.num_output_tokens is not None or not tokenizer_dir:
        return result.num_output_tokens
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(tokenizer_dir)(result.text, add_special_tokens=False).input_ids)


def format_stats(result: StreamResult, num_tokens: int | None) -> str:
    ttft = "n/a" if result.ttft is None else f"{result.ttft * 1000:.1f} ms"
    rate = "n/a (pass --tokenizer)" if num_tokens is None else f"{num_tokens / max(result.total, 1e-9):.1f}"
    return (f"time to first token: {ttft}\noutput tokens: {num_tokens if num_tokens is not None else 'n/a'}"
            f"\ntokens/s: {rate}\ntotal time: {result.total:.3f} s\nfinish reason: {result.finish_reason}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("text", nargs="?", help="the prompt (or --prompt)")
    parser.add_argument("--prompt", default=None, help="the prompt (default: the positional text, else "
                        "\"The future of AI is\")")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc",
                        help="gRPC streaming, or HTTP generate_stream (SSE)")
    parser.add_argument("--url", help="host:port (default 127.0.0.1:8001 for grpc, 127.0.0.1:8000 for http)")
    parser.add_argument("--model", default="nanoserve", help="the Triton model")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--temperature", type=float, help="0: greedy (default: the server's, 1.0)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling (default: the server's, 1.0)")
    parser.add_argument("--seed", type=int, help="sampling seed (default: none)")
    parser.add_argument("--stats", action="store_true", help="print time to first token, tokens/s, total time")
    parser.add_argument("--tokenizer", help="tokenizer dir, to count tokens if the server does not return counts")
    args = parser.parse_args(argv)
    args.prompt = args.prompt or args.text or "The future of AI is"
    args.url = args.url or DEFAULT_URLS[args.protocol]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    params = sampling_parameters(args.max_tokens, args.temperature, args.top_p, args.seed)
    stream = stream_grpc if args.protocol == "grpc" else stream_http
    try:
        result = stream(args.url, args.model, args.prompt, params, on_text=lambda t: print(t, end="", flush=True))
    except (RuntimeError, OSError) as e:  # the server's error (e.g. INVALID_ARG), or no server at --url
        print(f"\nstream.py: error: {args.url}: {e}", file=sys.stderr)
        return 1
    print()
    if args.stats:
        print(format_stats(result, count_tokens(result, args.tokenizer)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
