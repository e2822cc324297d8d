"""Offline throughput, nanoserve vs vLLM-CPU, side by side on the same workload and checkpoint.

N sequences of random token ids, prompt and output lengths uniform in [min_len, max_len], ignore_eos (the
workload of bench_offline.py). Each engine runs in its own worker process, loaded and warmed up once per dtype;
vLLM's runs under --vllm-python (a separate venv: vLLM-CPU is never a nanoserve dependency). Every round and
temperature is a new workload (no prefix-cache hits), given to both engines, the two alternating (which goes
first alternates too).
Prints each run's output tok/s and ratio nanoserve / vLLM, then the median ratio per (dtype, temperature).

    python client/bench_vs_vllm.py --vllm-python /work/vllm-venv/bin/python --rounds 3

vLLM-CPU runs as /work/shared/VLLM_CPU.md describes (Intel OpenMP preloaded, cores bound by
VLLM_CPU_OMP_THREADS_BIND); nanoserve runs with its own defaults (the environment passes through to both).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

RESULT = "@@bench-result "
HERE = os.path.dirname(os.path.abspath(__file__))


def make_workload(num_seqs: int, min_len: int, max_len: int, vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_seqs)]
    return prompts, [rng.randint(min_len, max_len) for _ in range(num_seqs)]


# ---- workers: one engine each; only the standard library and that engine are imported ----
def nanoserve_engine(model: str, dtype: str, max_model_len: int):
    from nanoserve import LLM, SamplingParams

    llm = LLM(model, device="cpu", dtype=dtype, max_model_len=max_model_len)

    def generate(prompts, output_lens, temperature):
        params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for n in output_lens]
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return generate


def vllm_engine(model: str, dtype: str, max_model_len: int):
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_model_len=max_model_len, seed=0, skip_tokenizer_init=True)

    def generate(prompts, output_lens, temperature):
        params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, detokenize=False)
                  for n in output_lens]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    return generate


def worker(engine: str, model: str, dtype: str, max_model_len: int) -> None:
    """Reads one JSON job per stdin line ({prompts, output_lens, temperature}), prints a RESULT line per job."""
    generate = (nanoserve_engine if engine == "nanoserve" else vllm_engine)(model, dtype, max_model_len)
    print(RESULT + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        start = time.perf_counter()
        tokens = generate(job["prompts"], job["output_lens"], job["temperature"])
        seconds = time.perf_counter() - start
        print(RESULT + json.dumps({"seconds": seconds, "tokens": sum(map(len, tokens)), "token_ids": tokens}),
              flush=True)


# ---- driver ----
class Worker:
    def __init__(self, engine: str, python: str, env: dict, model: str, dtype: str, max_model_len: int, log):
        command = [python, os.path.abspath(__file__), "--worker", engine, "--model", model, "--dtype", dtype,
                   "--max-model-len", str(max_model_len)]
        self.engine = engine
        self.proc = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                     text=True, bufsize=1)
        self.read()

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
        raise RuntimeError(f"{self.engine} worker exited with {self.proc.wait()} (see the log)")

    def run(self, prompts, output_lens, temperature: float) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "output_lens": output_lens,
                                          "temperature": temperature}) + "\n")
        return self.read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def vllm_environment(vllm_python: str, cores: str, rpc_dir: str) -> dict:
    venv = os.path.dirname(os.path.dirname(vllm_python))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_RPC_BASE_PATH": rpc_dir,
           "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": cores}
    iomp = os.path.join(venv, "lib", "libiomp5.so")
    if os.path.exists(iomp):
        env["LD_PRELOAD"] = iomp
    return env


def start_workers(args, model: str, dtype: str, log) -> dict:
    max_model_len = 2 * args.max_len + 16
    workers = {
        "nanoserve": Worker("nanoserve", sys.executable, {**os.environ, "HF_HUB_OFFLINE": "1"}, model, dtype,
                            max_model_len, log),
        "vllm": Worker("vllm", args.vllm_python, vllm_environment(args.vllm_python, args.cores, args.rpc_dir),
                       model, dtype, max_model_len, log),
    }
    # warm-up: a workload of the same shape at each temperature, so that one-off costs (allocator growth,
    # compilation) are paid before timing
    for seed_offset, temperature in enumerate(args.temperatures):
        prompts, lens = make_workload(args.num_seqs, args.min_len, args.max_len, args.vocab,
                                      args.seed + 1 + seed_offset)
        for w in workers.values():
            w.run(prompts, lens, temperature)
    return workers


def bench_dtype(args, model: str, dtype: str, log) -> dict:
    """{temperature: [ratio per round]} for one dtype, printing every run."""
    workers = start_workers(args, model, dtype, log)
    ratios = {t: [] for t in args.temperatures}
    try:
        for round_ in range(args.rounds):
            for index, temperature in enumerate(args.temperatures):  # new prompts each time: no prefix-cache hits
                prompts, lens = make_workload(args.num_seqs, args.min_len, args.max_len, args.vocab,
                                              args.seed + 100 * (round_ + 1) + index)
                order = ["nanoserve", "vllm"] if round_ % 2 == 0 else ["vllm", "nanoserve"]
                rates = {}
                for name in order:
                    result = workers[name].run(prompts, lens, temperature)
                    rates[name] = result["tokens"] / result["seconds"]
                ratios[temperature].append(rates["nanoserve"] / rates["vllm"])
                print(f"{dtype} t={temperature} round {round_}: nanoserve {rates['nanoserve']:.0f} tok/s, "
                      f"vLLM {rates['vllm']:.0f} tok/s, ratio {ratios[temperature][-1]:.3f} "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        for w in workers.values():
            w.close()
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="the python of a venv with vllm-cpu installed")
    parser.add_argument("--model", help="checkpoint dir (default: build a random-weight Qwen3-shaped model)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.6, 0.0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cores", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: every core, 0-N)")
    parser.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "bench_vs_vllm.log"),
                        help="the workers' stderr")
    parser.add_argument("--worker", choices=["nanoserve", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--max-model-len", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.dtype, args.max_model_len)
    if not args.vllm_python:
        parser.error("--vllm-python is required")
    sys.path.insert(0, HERE)
    from bench_offline import build_bench_model
    from transformers import AutoConfig

    model = args.model or build_bench_model(args.hidden, args.layers)
    args.vocab = AutoConfig.from_pretrained(model).vocab_size
    args.cores = args.cores or f"0-{len(os.sched_getaffinity(0)) - 1}"
    print(f"model={model} seqs={args.num_seqs} lens=[{args.min_len},{args.max_len}] rounds={args.rounds} "
          f"vLLM cores={args.cores} log={args.log}", flush=True)
    summary = {}
    with tempfile.TemporaryDirectory() as rpc_dir, open(args.log, "a") as log:
        args.rpc_dir = rpc_dir
        for dtype in args.dtypes:
            for temperature, ratios in bench_dtype(args, model, dtype, log).items():
                summary[(dtype, temperature)] = ratios
    print("\n| dtype | temperature | ratio per round (nanoserve / vLLM) | median |\n| --- | ---: | --- | ---: |")
    for (dtype, temperature), ratios in summary.items():
        print(f"| {dtype} | {temperature:g} | {', '.join(f'{r:.3f}' for r in ratios)} | "
              f"**{statistics.median(ratios):.3f}** |")


if __name__ == "__main__":
    main()
