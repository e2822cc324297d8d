"""SmolLM2-135M-Instruct from its GGUF file, float32 vs bfloat16 vs int8 vs int4 weights (and int4 with an fp8 KV
cache), side by side (not a test).

    python client/bench_weight_formats.py [--concurrency 1 16 64] [--rounds 2] [--served [--llama-server PATH]]

Each format is one engine: float32 and bfloat16 with `quantization="none"` (the file's weights dequantized),
int8 and int4 (`quantization="int8"`; `"auto"`, which runs the file's Q4_1 codes as int4), and int4-fp8kv (int4
with `kv_cache_dtype="fp8"`: twice the KV blocks in the same memory). Offline, all the engines live in this
process; with --served each is a `nanoserve serve FILE.gguf` and requests stream through its OpenAI
`/v1/completions`, and with --llama-server llama.cpp's `llama-server` on the same file runs beside them as one
more format. Every round runs each format at each concurrency (that many requests at once, random
prompts of --prompt-len words, --max-tokens each with ignore_eos), the formats alternating and their order
reversed every other round. Prints per run: output tok/s, inter-token latency p50, and at the end the medians as
ratios to float32, with each format's weights' memory (the bytes of the model's weight tensors as the engine holds
them: parameters, oneDNN-packed and quantized weights, each counted once) and KV blocks (offline).

Offline, the engines compute on one thread (--threads) and the clock is that thread's CPU time, not wall time: on
a machine whose cores other processes share, wall time measures their load as much as the engine (tok/s is then
tokens per CPU-second of the engine's thread). Served, the clock is wall time.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # triton_server.nanoserve_serve

FORMATS = {"float32": dict(dtype="float32", quantization="none"),
           "bfloat16": dict(dtype="bfloat16", quantization="none"),
           "int8": dict(dtype="float32", quantization="int8"),
           "int4": dict(dtype="float32", quantization="auto"),
           "int4-fp8kv": dict(dtype="float32", quantization="auto", kv_cache_dtype="fp8")}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights as the engine holds them, each tensor once (a tied LM head shares its table)."""
    seen, total = set(), 0
    for module in model.modules():
        held = list(module.parameters(recurse=False))
        held += [getattr(module, name) for name in ("packed_weight", "quantized") if hasattr(module, name)]
        for weight in held:
            if weight is None or id(weight) in seen:
                continue
            seen.add(id(weight))
            total += weight.nbytes if isinstance(weight, torch.Tensor) else weight.nbytes
    return total


class Offline:
    def __init__(self, gguf_path: str, engine_args: dict):
        from nanoserve import LLM

        self.llm = LLM(gguf_path, device="cpu", max_model_len=512, **engine_args)
        self.weight_bytes = weight_bytes(self.llm.engine.executor.runner.model)
        self.kv_blocks = self.llm.stats()["num_total_blocks"]  # in the same cpu_kvcache_space_gib for every format

    def run(self, prompts, max_tokens: int) -> tuple[int, float, list[float]]:
        """(output tokens, wall seconds, inter-token gaps)."""
        from nanoserve import SamplingParams

        engine = self.llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        last, gaps, tokens = {}, [], 0
        start = time.thread_time()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"bench-{i}-{time.perf_counter()}", prompt, params, stream=True)
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.thread_time()
                if out.request_id in last:
                    gaps.append(now - last[out.request_id])
                last[out.request_id] = now
                tokens += len(out.new_token_ids)
        return tokens, time.thread_time() - start, gaps

    def close(self):
        self.llm.shutdown()


class OpenAIServer:
    """Streams completions from an OpenAI-compatible server at `url` serving model "bench"."""

    def connect(self, url: str) -> None:
        import openai

        self.client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        self.weight_bytes = self.kv_blocks = None

    def run(self, prompts, max_tokens: int) -> tuple[int, float, list[float]]:
        gaps, errors, lock = [], [], threading.Lock()

        def one(prompt):
            try:
                stream_one(prompt)
            except Exception as e:  # noqa: BLE001  (raised again below, in the calling thread)
                errors.append(e)

        def stream_one(prompt):
            stream = self.client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
            arrivals = [time.perf_counter() for chunk in stream if chunk.choices]
            with lock:
                gaps.extend(b - a for a, b in zip(arrivals, arrivals[1:]))

        start = time.perf_counter()
        threads = [threading.Thread(target=one, args=(prompt,)) for prompt in prompts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        # chunks carry text: a token that decodes to no text yet arrives with the next, so count tokens as asked
        return max_tokens * len(prompts), time.perf_counter() - start, gaps


class Served(OpenAIServer):
    """`nanoserve serve FILE.gguf` with engine_args as flags."""

    def __init__(self, gguf_path: str, engine_args: dict, log_dir: Path):
        from triton_server import nanoserve_serve

        flags = [f"--{name.replace('_', '-')}={value}" for name, value in engine_args.items()]
        self.context = nanoserve_serve(gguf_path, log_dir, "--served-model-name", "bench", "--max-model-len", "512",
                                       *flags)
        self.connect(self.context.__enter__().openai_url)

    def close(self):
        self.context.__exit__(None, None, None)


class LlamaServer(OpenAIServer):
    """llama.cpp's `llama-server` on the same file: one slot per concurrent request (-np), each of 512 tokens as
    nanoserve's --max-model-len, `threads` threads."""

    def __init__(self, binary: str, gguf_path: str, slots: int, threads: int, log_dir: Path):
        from nanoserve.serving.serve.launcher import free_ports

        (port,) = free_ports(1)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(log_dir / "llama-server.log", "w")
        self.process = subprocess.Popen([binary, "-m", gguf_path, "--host", "127.0.0.1", "--port", str(port),
                                         "-np", str(slots), "-c", str(512 * slots), "-t", str(threads),
                                         "--alias", "bench"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not self._healthy(port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"llama-server did not start: see {log_dir / 'llama-server.log'}")
            time.sleep(0.5)
        self.connect(f"http://127.0.0.1:{port}/v1")

    @staticmethod
    def _healthy(port: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def close(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


WORDS = ("the quick brown fox jumps over a lazy dog while seven red birds sing about rivers mountains cities "
         "music history science paper window garden engine coffee winter summer light shadow number story").split()


def random_prompts(count: int, length: int, seed: int) -> list[str]:
    """Text prompts of `length` random words (the OpenAI API takes text)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(length)) for _ in range(count)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=32, help="words per prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--served", action="store_true", help="through `nanoserve serve`'s OpenAI API")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the offline engines")
    p.add_argument("--llama-server", metavar="PATH", help="with --served: also llama.cpp's llama-server binary on "
                   "the same file, as the format 'llama.cpp' (threads: the CPU count)")
    args = p.parse_args(argv)
    if args.llama_server and not args.served:
        p.error("--llama-server needs --served")
    torch.set_num_threads(args.threads)
    from nanoserve.demo_model import smollm2_gguf

    path = str(smollm2_gguf())
    with tempfile.TemporaryDirectory() as tmp:
        engines = {}
        try:
            for name in args.formats:
                engines[name] = (Served(path, FORMATS[name], Path(tmp, name)) if args.served
                                 else Offline(path, FORMATS[name]))
                Path(tmp, name).mkdir(exist_ok=True)
            if args.llama_server:
                engines["llama.cpp"] = LlamaServer(args.llama_server, path, max(args.concurrency), os.cpu_count(),
                                                   Path(tmp, "llama.cpp"))
            results = bench(engines, args)
        finally:
            for engine in engines.values():
                engine.close()
    report(engines, results, args)


def bench(engines: dict, args) -> dict:
    results = {(name, c): [] for name in engines for c in args.concurrency}
    for name, engine in engines.items():  # warm-up: oneDNN primitives, page faults
        engine.run(random_prompts(2, args.prompt_len, seed=1), 4)
    for round_index in range(args.rounds):
        order = list(engines) if round_index % 2 == 0 else list(engines)[::-1]
        for c in args.concurrency:
            prompts = random_prompts(c, args.prompt_len, seed=100 * round_index + c)  # new prompts: no cache hits
            for name in order:
                tokens, wall, gaps = engines[name].run(prompts, args.max_tokens)
                results[name, c].append((tokens / wall, statistics.median(gaps) * 1e3))
                print(f"round {round_index} c={c:3d} {name:9s} {tokens / wall:8.1f} tok/s  "
                      f"ITL p50 {statistics.median(gaps) * 1e3:7.1f} ms", flush=True)
    return results


def report(engines: dict, results: dict, args) -> None:
    base = "float32" if "float32" in engines else next(iter(engines))
    print("\n| format | weights' memory | KV blocks | " + " | ".join(f"{c} req: tok/s (x {base}), ITL p50 ms"
                                                                    for c in args.concurrency) + " |")
    print("| --- | ---: | ---: |" + " ---: |" * len(args.concurrency))
    for name, engine in engines.items():
        memory = engine.weight_bytes
        base_memory = engines[base].weight_bytes
        cells = [f"{memory / 2 ** 20:.0f} MiB ({memory / base_memory:.2f})" if memory else "-",
                 str(engine.kv_blocks or "-")]
        for c in args.concurrency:
            tok_s = statistics.median(r[0] for r in results[name, c])
            base_tok_s = statistics.median(r[0] for r in results[base, c])
            itl = statistics.median(r[1] for r in results[name, c])
            cells.append(f"{tok_s:.1f} ({tok_s / base_tok_s:.2f}x), {itl:.0f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
