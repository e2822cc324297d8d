"""Soak: concurrent clients over every protocol against nanoserve in Triton, with cancellations, clients that go
away (a closed SSE connection, a SIGKILLed client process) and bad input; then the checks: no request hung, no
valid request failed, repeated deterministic requests (greedy, or seeded) gave one text across protocols and
models, and the engines went back to idle (no KV block held, nothing running or waiting).

    python client/soak.py --minutes 30      # starts its own tritonserver with the tiny model (scripts/soak.sh)

Models: `nanoserve` (gRPC stream, HTTP SSE, HTTP /generate) and the `ensemble` (gRPC stream, HTTP SSE), both
cancelled and abandoned too. Each engine's KV pool is small enough that requests get preempted. Cancellations come
far from a request's end: a gRPC stream cancelled just after its final response leaves tritonserver 2.51 unable to
unload the model (see docs/serving.md).
"""
from __future__ import annotations

import argparse
import itertools
import json
import queue
import random
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # run as a script: make `client` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.stream import first_sse_event, grpc_inputs, open_generate_stream  # noqa: E402
from nanoserve.serving.shared.contracts.vllm_text import TextRequest, decode_response  # noqa: E402

TEXT_MODEL, ENSEMBLE_MODEL = "nanoserve", "ensemble"
ENGINE_MODELS = ("nanoserve", "nanoserve_tokens")
MODELS = ["nanoserve", "nanoserve_tokens", "ensemble", "preprocessing", "postprocessing"]
# Small KV pools: 24 blocks of 16 tokens per engine, so that requests get preempted (three PREEMPT_TOKENS ones
# alone need 39 blocks).
ENGINE_ARGS = {"device": "cpu", "kvcache_block_size": 16, "num_kvcache_blocks": 24, "max_model_len": 384}
PROMPTS = ["Héllo wörld, naïve café — 你好 ", "The licence grants you", "  spaces   and\ttabs"]
MAX_TOKENS = [16, 32]
SEEDS = [None, 1]  # None: greedy; else sampled at temperature 0.8 with that seed
LONG_TOKENS = 300  # a request meant to be cancelled or abandoned: far from done when that happens
PREEMPT_TOKENS = 200
BAD_REQUESTS = [  # (HTTP /generate body, the field the error must name: the text model's, the ensemble's)
    ({"text_input": ""}, ("text_input", "text_input")),
    ({"text_input": "Hi", "parameters": {"top_p": 1.5}}, ("top_p", "top_p")),
    ({"text_input": "Hi", "parameters": {"max_tokens": -5}}, ("max_tokens", "max_tokens")),
    ({"text_input": "Hi", "parameters": {"unknown_knob": 1}}, ("unknown_knob", "unknown_knob")),
    ({"text_input": "Hi", "sampling_parameters": "{max_tokens: 3"}, ("sampling_parameters", "sampling_parameters")),
    ({"text_input": "x " * 600}, ("text_input", "input_ids")),  # longer than max_model_len
    ({"text_input": "Hi", "parameters": {"min_tokens": "lots"}}, ("min_tokens", "min_tokens")),
]
KILLED_CLIENT = """
import sys, queue, json
import tritonclient.grpc as grpcclient
sys.path.insert(0, sys.argv[3])
from client.stream import grpc_inputs
client = grpcclient.InferenceServerClient(sys.argv[1])
events = queue.Queue()
client.start_stream(callback=lambda result, error: events.put(error))
flags = {"stream": True} if sys.argv[2] != "nanoserve" else {"stream": True, "exclude_input_in_output": True}
client.async_stream_infer(sys.argv[2], grpc_inputs("Hi", json.loads(sys.argv[4]), flags), request_id=sys.argv[5])
assert events.get(timeout=300) is None
print("streaming", flush=True)
sys.stdin.read()  # until killed
"""


@dataclass
class Report:
    sent: Counter = field(default_factory=Counter)  # request kind -> requests sent
    completed: int = 0  # valid requests that got their whole text
    cancelled: int = 0  # cancelled gRPC streams, closed SSE connections, killed client processes
    rejected: int = 0  # bad requests answered with an error naming the field
    hung: list[str] = field(default_factory=list)  # requests with no final response within the deadline
    errors: list[str] = field(default_factory=list)  # valid requests that failed, bad ones not rejected right
    texts: dict = field(default_factory=lambda: defaultdict(set))  # deterministic request -> texts seen
    preemptions: float = 0.0
    idle: dict = field(default_factory=dict)  # engine model -> its gauges once idle
    rss: dict = field(default_factory=dict)  # "start"/"end" -> {process: RSS bytes}

    @property
    def mismatches(self) -> dict:
        return {key: texts for key, texts in self.texts.items() if len(texts) > 1}

    def failures(self) -> list[str]:
        found = [f"hung: {h}" for h in self.hung] + [f"error: {e}" for e in self.errors]
        found += [f"different texts for {key}: {sorted(texts)}" for key, texts in self.mismatches.items()]
        found += [f"{model} not idle: {gauges}" for model, gauges in self.idle.items() if any(gauges.values())]
        return found

    def summary(self) -> str:
        rss = {when: ", ".join(f"{name} {size / 2**20:.0f} MiB" for name, size in sizes.items())
               for when, sizes in self.rss.items()}
        return (f"sent {sum(self.sent.values())} ({', '.join(f'{k} {v}' for k, v in sorted(self.sent.items()))})\n"
                f"completed {self.completed}, cancelled {self.cancelled}, rejected {self.rejected}, "
                f"hung {len(self.hung)}, errors {len(self.errors)}, different texts {len(self.mismatches)}\n"
                f"preemptions {self.preemptions:.0f}\n" + "".join(f"RSS at {when}: {line}\n"
                                                             for when, line in rss.items()))


class Soak:
    """server: url_grpc, url_http, url_metrics and process.pid (a launcher.TritonServer)."""

    def __init__(self, server, clients: int = 16, seed: int = 0, deadline: float = 300.0):
        self.server = server
        self.clients = clients
        self.seed = seed
        self.deadline = deadline  # seconds a request may take before it counts as hung
        self.report = Report()
        self._lock = threading.Lock()
        self._request_ids = itertools.count()  # every request gets an id, so tritonserver's log names it
        self.kinds = {"grpc": self._grpc, "sse": self._sse, "generate": self._generate, "ensemble": self._ensemble,
                      "ensemble_sse": self._ensemble_sse, "cancel": self._cancel, "close_sse": self._close_sse,
                      "kill_client": self._kill_client, "bad": self._bad}

    def run(self, requests_per_client: int | None = None, seconds: float | None = None) -> Report:
        """Three long greedy requests to each engine at once (they preempt each other), then each client sends
        requests_per_client requests (every kind in turn, then at random), or for seconds."""
        self.report.rss["start"] = process_rss(self.server.process.pid)
        preempted = self._preemptions()
        self._preempt()
        stop_at = time.monotonic() + seconds if seconds is not None else None
        threads = [threading.Thread(target=self._client, args=(i, requests_per_client, stop_at), daemon=True)
                   for i in range(self.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.report.idle = self._wait_idle()
        self.report.preemptions = self._preemptions() - preempted
        self.report.rss["end"] = process_rss(self.server.process.pid)
        return self.report

    def _client(self, index: int, count: int | None, stop_at: float | None) -> None:
        rng = random.Random(self.seed * 1000 + index)
        names = list(self.kinds)
        sent = 0
        while (count is None or sent < count) and (stop_at is None or time.monotonic() < stop_at):
            kind = names[(index + sent) % len(names)] if sent < len(names) else rng.choice(names)
            with self._lock:
                self.report.sent[kind] += 1
            try:
                self.kinds[kind](rng)
            except Exception as e:  # a client bug or an unexpected server answer: never silent
                self._note("errors", f"{kind}: {type(e).__name__}: {e}")
            sent += 1

    def _request_id(self) -> str:
        return f"soak-{self.seed}-{next(self._request_ids)}"

    def _note(self, what: str, value=None) -> None:
        with self._lock:
            if value is None:
                setattr(self.report, what, getattr(self.report, what) + 1)
            else:
                getattr(self.report, what).append(value)

    # ---- valid requests: their text is compared across protocols and repeats -----------------------
    def _params(self, rng) -> tuple[dict, tuple]:
        prompt, max_tokens, seed = rng.choice(PROMPTS), rng.choice(MAX_TOKENS), rng.choice(SEEDS)
        params = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0 if seed is None else 0.8}
        if seed is not None:
            params["seed"] = seed
        return params, (prompt, max_tokens, seed)

    def _record(self, key: tuple, text: str | None) -> None:
        if text is not None:
            with self._lock:
                self.report.texts[key].add(text)
                self.report.completed += 1

    def _grpc(self, rng) -> None:
        params, key = self._params(rng)
        self._record(key, self._grpc_stream(TEXT_MODEL, key[0], params))

    def _ensemble(self, rng) -> None:
        params, key = self._params(rng)
        self._record(key, self._grpc_stream(ENSEMBLE_MODEL, key[0], params))

    def _sse(self, rng, model: str = TEXT_MODEL) -> None:
        params, key = self._params(rng)
        flags = {"stream": True, **({"exclude_input_in_output": True} if model == TEXT_MODEL else {})}
        body = TextRequest(key[0], params, flags).generate_body()
        events = self._http("generate_stream", model, body, f"{model} sse {key}")
        if events is not None:
            self._record(key, "".join("".join(decode_response(e.get).texts) for e in events))

    def _ensemble_sse(self, rng) -> None:
        self._sse(rng, ENSEMBLE_MODEL)

    def _generate(self, rng) -> None:
        params, key = self._params(rng)
        body = TextRequest(key[0], params, {"exclude_input_in_output": True}).generate_body()
        events = self._http("generate", TEXT_MODEL, body, f"generate {key}")
        if events is not None:
            self._record(key, "".join(decode_response(events[0].get).texts))

    def _preempt(self) -> None:
        params = {"max_tokens": PREEMPT_TOKENS, "ignore_eos": True, "temperature": 0.0}
        key = (PROMPTS[0], PREEMPT_TOKENS, None)
        def one(model: str) -> None:
            self._record(key, self._grpc_stream(model, key[0], params))

        threads = [threading.Thread(target=one, args=(model,)) for model in (TEXT_MODEL, ENSEMBLE_MODEL)
                   for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with self._lock:
            self.report.sent["preempt"] += len(threads)

    def _grpc_stream(self, model: str, prompt: str, params: dict, cancel_after: int | None = None) -> str | None:
        """The streamed text; None when the request failed (noted) or was cancelled: after cancel_after responses,
        unless it finished first."""
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(self.server.url_grpc)
        events: queue.Queue = queue.Queue()
        flags = {"stream": True, **({"exclude_input_in_output": True} if model == TEXT_MODEL else {})}
        client.start_stream(callback=lambda result, error: events.put((result, error)))
        text, finished, responses = "", False, 0
        try:
            client.async_stream_infer(model, grpc_inputs(prompt, params, flags), request_id=self._request_id(),
                                      enable_empty_final_response=True)
            while not finished and (cancel_after is None or responses < cancel_after):
                try:
                    result, error = events.get(timeout=self.deadline)
                except queue.Empty:
                    self._note("hung", f"{model} gRPC stream {params}")
                    return None
                if error is not None:
                    finished = True  # nanoserve's errors are final responses
                    self._note("errors", f"{model} gRPC stream {params}: {error}")
                    return None
                responses += 1
                text += "".join(decode_response(result.as_numpy).texts)
                finished = result.get_response().parameters["triton_final_response"].bool_param
            return text if finished else None
        finally:
            client.stop_stream(cancel_requests=not finished)
            client.close()

    def _http(self, route: str, model: str, body: dict, what: str) -> list[dict] | None:
        """The response's JSON object(s) (SSE: one per event); None when the request failed (noted)."""
        request = urllib.request.Request(f"http://{self.server.url_http}/v2/models/{model}/{route}",
                                         json.dumps({**body, "id": self._request_id()}).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.deadline) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            self._note("errors", f"{what}: HTTP {e.code}: {e.read()[:200]!r}")
            return None
        except (TimeoutError, urllib.error.URLError) as e:
            timed_out = isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)
            self._note("hung" if timed_out else "errors", f"{what}: {e}")
            return None
        events = ([json.loads(line[5:]) for line in raw.splitlines() if line.startswith(b"data:")]
                  if route == "generate_stream" else [json.loads(raw)])
        failed = [e["error"] for e in events if "error" in e]
        if failed:
            self._note("errors", f"{what}: {failed[0]}")
            return None
        return events

    # ---- requests that go away -------------------------------------------------------------------------
    def _long_params(self, rng) -> dict:
        return {"max_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": rng.choice([0.0, 1.0])}

    def _cancel(self, rng) -> None:
        """Cancelled after its first response (sent at once, long before the last: a cancel that comes after the last
        response is tritonserver 2.51's race)."""
        model = rng.choice([TEXT_MODEL, ENSEMBLE_MODEL])
        self._grpc_stream(model, rng.choice(PROMPTS), self._long_params(rng), cancel_after=1)
        self._note("cancelled")

    def _close_sse(self, rng) -> None:
        model = rng.choice([TEXT_MODEL, ENSEMBLE_MODEL])
        request = TextRequest(rng.choice(PROMPTS), self._long_params(rng), {"stream": True})
        body = {**request.generate_body(), "id": self._request_id()}
        with open_generate_stream(self.server.url_http, model, body, timeout=self.deadline) as connection:
            first = first_sse_event(connection)
        if b"data:" not in first:
            self._note("errors", f"{model} SSE: {first[:200]!r}")
        else:
            self._note("cancelled")

    def _kill_client(self, rng) -> None:
        model = rng.choice([TEXT_MODEL, ENSEMBLE_MODEL])
        client = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, self.server.url_grpc, model,
                                   str(Path(__file__).resolve().parents[1]), json.dumps(self._long_params(rng)),
                                   self._request_id()],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            line = client.stdout.readline().strip()
        finally:
            client.kill()
            client.wait()
            client.stdin.close()
            client.stdout.close()
        if line == "streaming":
            self._note("cancelled")
        else:
            self._note("errors", f"{model} killed client: it never streamed")

    # ---- bad input ---------------------------------------------------------------------------------------
    def _bad(self, rng) -> None:
        body, names = rng.choice(BAD_REQUESTS)
        model = rng.choice([TEXT_MODEL, ENSEMBLE_MODEL])
        name = names[model == ENSEMBLE_MODEL]
        request = urllib.request.Request(f"http://{self.server.url_http}/v2/models/{model}/generate",
                                         json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.deadline) as response:
                self._note("errors", f"{model} bad input {body}: accepted ({response.status})")
        except urllib.error.HTTPError as e:
            message = json.loads(e.read()).get("error", "")
            if e.code == 400 and name in message:
                self._note("rejected")
            else:
                self._note("errors", f"{model} bad input {body}: HTTP {e.code} {message!r}")
        except TimeoutError:
            self._note("hung", f"{model} bad input {body}")

    # ---- the server's side ---------------------------------------------------------------------------------
    def _preemptions(self) -> float:
        return sum(engine_metrics(self.server, model).get("nanoserve_preemptions_total", 0.0)
                   for model in ENGINE_MODELS)

    def _wait_idle(self, timeout: float = 120.0) -> dict:
        """Each engine model's running/waiting/KV-block gauges, once all are 0 (or as they are at the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            gauges = {model: {name: engine_metrics(self.server, model).get(f"nanoserve_{name}", 0.0)
                              for name in ("requests_running", "requests_waiting", "kv_blocks_used")}
                      for model in ENGINE_MODELS}
            if not any(value for model in gauges.values() for value in model.values()) \
                    or time.monotonic() > deadline:
                return gauges
            time.sleep(0.2)


_SAMPLE = re.compile(r'^(nanoserve_\w+)\{([^}]*)\} (\S+)$')


def engine_metrics(server, model: str, **labels: str) -> dict:
    """nanoserve_* samples of one model (and the other labels given), summed over their other labels."""
    with urllib.request.urlopen(server.url_metrics, timeout=30) as response:
        text = response.read().decode()
    wanted = [f'{name}="{value}"' for name, value in {"model": model, **labels}.items()]
    values: dict = defaultdict(float)
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and all(label in match.group(2).split(",") for label in wanted):
            values[match.group(1)] += float(match.group(3))
    return dict(values)


def process_rss(pgid: int) -> dict:
    """RSS in bytes of tritonserver (the group leader) and each of its stubs, named by model instance."""
    from nanoserve.serving.serve.launcher import processes
    from nanoserve.serving.serve.supervisor import stub_instance

    sizes = {}
    for pid, state, _, group in processes():
        if group != pgid or state == "Z":
            continue
        name = "tritonserver" if pid == pgid else stub_instance(pid) or f"pid {pid}"
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        sizes[name] = kib * 1024
    return dict(sorted(sizes.items()))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds before a request counts as hung")
    parser.add_argument("--work-dir", help="where the model repository and tritonserver's log go (default: a temp dir)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    import tempfile

    from nanoserve.serving.serve import launcher

    args = parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="nanoserve-soak-"))
    repository = launcher.make_model_repository(work / "model_repository", launcher.tiny_model(), models=MODELS,
                                                **ENGINE_ARGS)
    with launcher.TritonServer(repository, *launcher.free_ports(3), log_file=work / "tritonserver.log",
                               exit_timeout_secs=30) as server:
        server.wait_ready(600, models=MODELS)
        print(f"soak: {args.clients} clients for {args.minutes:g} min; tritonserver log {server.log_path}",
              flush=True)
        report = Soak(server, args.clients, args.seed, args.deadline).run(seconds=args.minutes * 60)
        undrained = server.drain(server.exit_timeout_secs)  # as `nanoserve serve` stops (serving/serve/drain.py)
        code = server.stop()
    print(report.summary() + f"tritonserver exit code {code} after the drain and SIGTERM")
    failures = report.failures() + [f"drain: {line}" for line in undrained]
    failures += [] if code == 0 else [f"tritonserver exited with {code}"]
    for failure in failures:
        print(f"FAIL {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
