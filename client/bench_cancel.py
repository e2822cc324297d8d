"""Time from a client's cancel to the engine's abort: a gRPC stream cancelled, or an HTTP SSE connection closed, for
the text model and the ensemble; the abort is seen in /metrics (nanoserve_requests_finished_total{reason="abort"}
one higher, the request's KV blocks back). Prints the median and the longest of --trials runs of each.

    python client/bench_cancel.py --trials 10      # starts its own tritonserver with the tiny model
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a script: make `client` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.soak import engine_metrics  # noqa: E402
from client.stream import grpc_inputs, open_generate_stream  # noqa: E402
from nanoserve.serving.shared.contracts.vllm_text import TextRequest  # noqa: E402

MODELS = ["nanoserve", "nanoserve_tokens", "ensemble", "preprocessing", "postprocessing"]
ENGINES = {"nanoserve": "nanoserve", "ensemble": "nanoserve_tokens"}  # served model -> its engine model
PARAMS = {"max_tokens": 1500, "ignore_eos": True}  # far from done when it is cancelled


def wait_for(server, engine: str, condition, timeout: float = 120.0, **labels: str) -> dict:
    deadline = time.monotonic() + timeout
    while not condition(values := engine_metrics(server, engine, **labels)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{engine}: {values}")
        time.sleep(0.005)
    return values


def start_grpc(server, model: str):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.url_grpc)
    client.start_stream(callback=lambda result, error: None)
    flags = {"stream": True, **({"exclude_input_in_output": True} if model == "nanoserve" else {})}
    client.async_stream_infer(model, grpc_inputs("Hi", PARAMS, flags))
    return lambda: (client.stop_stream(cancel_requests=True), client.close())


def start_sse(server, model: str):
    body = TextRequest("Hi", PARAMS, {"stream": True}).generate_body()
    return open_generate_stream(server.url_http, model, body).close


def cancel_to_abort(server, model: str, start) -> float:
    engine = ENGINES[model]
    aborted = engine_metrics(server, engine, reason="abort").get("nanoserve_requests_finished_total", 0.0)
    cancel = start(server, model)
    wait_for(server, engine, lambda values: values.get("nanoserve_requests_running") == 1)
    started = time.monotonic()
    cancel()
    wait_for(server, engine, lambda values: values.get("nanoserve_requests_finished_total", 0.0) > aborted,
             reason="abort")
    seconds = time.monotonic() - started
    values = engine_metrics(server, engine)
    if values.get("nanoserve_kv_blocks_used") or values.get("nanoserve_requests_running"):
        raise RuntimeError(f"{engine}: not idle after the abort: {values}")
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args(argv)
    from nanoserve.serving.serve import launcher

    work = Path(tempfile.mkdtemp(prefix="nanoserve-bench-cancel-"))
    repository = launcher.make_model_repository(work / "model_repository", launcher.tiny_model(), models=MODELS,
                                                device="cpu")
    with launcher.TritonServer(repository, *launcher.free_ports(3), log_file=work / "tritonserver.log") as server:
        server.wait_ready(600, models=MODELS)
        for model in ENGINES:
            for how, start in (("gRPC cancel", start_grpc), ("SSE close", start_sse)):
                times = [cancel_to_abort(server, model, start) for _ in range(args.trials)]
                print(f"{model:9s} {how:11s} cancel -> abort: median {statistics.median(times):.2f} s, "
                      f"max {max(times):.2f} s ({args.trials} trials)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
