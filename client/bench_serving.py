"""Served vs in-process throughput: the same fixed workload through Triton (C concurrent gRPC streams) and
through nanoserve's engine in this process (the same requests, streaming every step's tokens and text, at most C
running); prints output tok/s for each and the ratio (target >= 0.95 at 64 streams). The ratio is what serving
through Triton costs; `--inprocess generate` compares with the offline `LLM.generate` instead, which also skips
the per-step detokenization that streaming needs.

Workload: N prompts of random token ids (fixed seed) decoded to text, so both sides get the same strings;
ignore_eos and a fixed max_tokens, so every request produces exactly that many tokens.

    nanoserve build-tiny-model tiny-qwen3     # what model_repository/nanoserve/1/model.json points at
    python client/bench_serving.py --model-repository model_repository          # launches tritonserver itself
    python client/bench_serving.py --url 127.0.0.1:8001 --model-repository DIR   # a server already running
    python client/bench_serving.py --model-repository DIR --rounds 4   # 4 rounds, the order alternating; median ratio
    python client/bench_serving.py --model-repository DIR --rounds 6 --max-steal 0.03   # median of quiet rounds
    python client/bench_serving.py --model-repository DIR --together --rounds 16   # both loaded, runs paired closely

After each run a `threads:` line (Linux) says what the engine side's threads used meanwhile: CPU seconds and
seconds runnable but waiting for a CPU. Served: tritonserver's and its stubs' threads (nanoserve's are named
ns-engine and ns-responses) of a launched server, or of the one whose pid --server-pid gives; in-process: the
engine's thread. Where a served engine thread's CPU + wait falls short of the run's time, it was blocked: waiting for
the GIL, or idle between steps for want of requests.

Launched servers are stopped before the in-process run (a GPU cannot hold two engines at 90% memory); with
--url the in-process engine shares the machine with that server, so stop it or pass --no-inprocess.
On a small, busy CPU machine torch's OpenMP threads spin against each other and both numbers swing several-fold:
set OMP_NUM_THREADS=1 (it reaches the launched server too).

Simulated device (what the host side lets a GPU do, measured without one): --simulated-device-ms X replaces the
model's forward and the sampler's tensor math by X ms of device time per step and random token ids, in both sides
(nanoserve/engine/simulated_device.py; it sets NANOSERVE_SIMULATED_DEVICE_MS, which a launched tritonserver's stubs
inherit: a server at --url must have been started with it). Each run then also gives its share of the
device-bound rate, rows * 1000 / X tok/s (rows: the streams running at once).

    python client/bench_serving.py --model-repository DIR --simulated-device-ms 8 --rounds 3
    python client/bench_serving.py --model-repository DIR --simulated-device-ms 8 --simulated-device-wait launch
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import random
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a script: make `client` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client import thread_times  # noqa: E402
from client.stream import grpc_inputs, sampling_parameters  # noqa: E402
from nanoserve.serving.shared.contracts.vllm_text import decode_response  # noqa: E402
from nanoserve.engine.simulated_device import ENV_STEP_MS, ENV_WAIT, WAITS  # noqa: E402


@dataclasses.dataclass
class RunResult:
    seconds: float
    output_tokens: int
    ttfts: list[float] = dataclasses.field(default_factory=list)
    responses: int = 0  # served: streamed responses received (the server merges steps under load)
    client_cpu: float = 0.0  # served: CPU seconds this client process spent meanwhile
    texts: list[str] = dataclasses.field(default_factory=list)  # in-process: each prompt's output text
    steal: float | None = None  # the host's steal share meanwhile (HostSteal)
    threads: dict = dataclasses.field(default_factory=dict)  # name -> ThreadTime: the engine side's threads meanwhile

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def describe(self, name: str, num_requests: int, device_bound: float | None = None) -> str:
        """device_bound: with a simulated device, its rate in tok/s, to which this run's is compared."""
        bound = f" ({self.tokens_per_s / device_bound:.3f} of the device-bound rate)" if device_bound else ""
        ttft = f", mean TTFT {1000 * sum(self.ttfts) / len(self.ttfts):.0f} ms" if self.ttfts else ""
        client = f" ({self.responses} responses, client CPU {self.client_cpu:.2f} s)" if self.responses else ""
        steal = f", host steal {self.steal:.0%}" if self.steal is not None else ""
        threads = f"\n{'':>12}threads: {thread_times.describe(self.threads)}" if self.threads else ""
        return (f"{name:>10}: {num_requests} requests, {self.output_tokens} output tokens in {self.seconds:.2f} s "
                f"= {self.tokens_per_s:.1f} tok/s{bound}{ttft}{client}{steal}{threads}")


class HostSteal:
    """The share of this machine's CPU time that its hypervisor gave to other guests (`steal` in /proc/stat)
    since creation. On a shared VM a run with a high share was slowed from outside; None where not Linux."""

    def __init__(self, stat_path: str = "/proc/stat"):
        self.stat_path = stat_path
        self.start = self.ticks()

    def ticks(self) -> tuple[int, int] | None:
        """(all CPU time, steal) in clock ticks since boot."""
        try:
            with open(self.stat_path) as stat:
                values = [int(v) for v in stat.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        return sum(values), values[7] if len(values) == 8 else 0

    def share(self) -> float | None:
        end = self.ticks()
        if self.start is None or end is None or end[0] == self.start[0]:
            return None
        return (end[1] - self.start[1]) / (end[0] - self.start[0])


def make_prompts(tokenizer_dir: str, num_prompts: int, input_len: int, seed: int) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(seed)
    return [tokenizer.decode([rng.choice(vocab) for _ in range(input_len)]) for _ in range(num_prompts)]


async def run_served(url: str, model: str, prompts: list[str], params: dict, concurrency: int) -> RunResult:
    """At most `concurrency` requests in flight on one bidirectional gRPC stream; a request ends with its
    final (possibly empty) response."""
    import tritonclient.grpc.aio as aioclient

    slots, all_done = asyncio.Semaphore(concurrency), asyncio.Event()
    sent: dict[str, float] = {}

    async def requests():
        for i, prompt in enumerate(prompts):
            await slots.acquire()
            sent[str(i)] = time.perf_counter()
            yield {"model_name": model, "inputs": grpc_inputs(prompt, params), "request_id": str(i),
                   "parameters": {"triton_enable_empty_final_response": True}}
        await all_done.wait()  # closing our side early could end the stream before the last responses

    client = aioclient.InferenceServerClient(url)
    result, first_seen, finished = RunResult(0.0, 0), set(), 0
    start, start_cpu, steal = time.perf_counter(), time.process_time(), HostSteal()
    try:
        async for response, error in client.stream_infer(requests()):
            if error is not None:
                raise RuntimeError(f"{model}: {error}")
            result.responses += 1
            request_id = response.get_response().id
            tokens = sum(decode_response(response.as_numpy).num_output_tokens)
            result.output_tokens += tokens
            if tokens and request_id not in first_seen:
                first_seen.add(request_id)
                result.ttfts.append(time.perf_counter() - sent[request_id])
            if response.get_response().parameters["triton_final_response"].bool_param:
                finished += 1
                slots.release()
                if finished == len(prompts):
                    break
        result.seconds, result.client_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        result.steal = steal.share()
    finally:
        all_done.set()
        await client.close()
    return result


def run_inprocess(model_dir: str, engine_args: dict, prompts: list[str], params: dict, concurrency: int,
                  warmup_prompts: list[str] = (), stream: bool = True) -> RunResult:
    """The same prompts in this process, with at most `concurrency` sequences running, like the server.
    stream: as engine requests that stream, every step's text delta joined per request as a client would
    (the served run's work); else through the offline `LLM.generate`, which detokenizes each output once."""
    with loaded_llm(model_dir, engine_args, concurrency) as llm:
        return time_inprocess(llm, prompts, params, warmup_prompts, stream)


@contextlib.contextmanager
def loaded_llm(model_dir: str, engine_args: dict, concurrency: int):
    """An LLM running at most `concurrency` sequences at once, like the server under that many streams."""
    from nanoserve import LLM
    from nanoserve.config import EngineConfig

    default_seqs = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "max_num_seqs")
    engine_args = {**engine_args, "max_num_seqs": min(engine_args.get("max_num_seqs", default_seqs), concurrency)}
    with LLM(model_dir, **engine_args) as llm:
        yield llm


def time_inprocess(llm, prompts: list[str], params: dict, warmup_prompts: list[str] = (),
                   stream: bool = True) -> RunResult:
    from nanoserve import SamplingParams

    run = stream_requests if stream else generate_requests
    sampling = SamplingParams(**params)
    if warmup_prompts:
        run(llm, list(warmup_prompts), sampling, "warmup")
    before, start, steal = thread_times.this_thread(), time.perf_counter(), HostSteal()
    output_tokens, texts = run(llm, prompts, sampling, f"timed-{start}")  # request ids new on a reused engine
    after = thread_times.this_thread()
    return RunResult(time.perf_counter() - start, output_tokens, texts=texts, steal=steal.share(),
                     threads={} if before is None or after is None else {"engine": after - before})


def generate_requests(llm, prompts: list[str], sampling, name: str) -> tuple[int, list[str]]:
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    return sum(len(o.token_ids) for o in outputs), [o.text for o in outputs]


def stream_requests(llm, prompts: list[str], sampling, name: str) -> tuple[int, list[str]]:
    engine, deltas, output_tokens = llm.engine, {}, 0
    for i, prompt in enumerate(prompts):
        deltas[f"{name}-{i}"] = []
        engine.add_request(f"{name}-{i}", prompt, sampling, stream=True)
    while engine.has_unfinished_requests():
        for output in engine.step():
            deltas[output.request_id].append(output.text_delta)
            output_tokens += len(output.new_token_ids)
    return output_tokens, ["".join(pieces) for pieces in deltas.values()]


def timed_served(url: str, server_pid: int | None, args, prompts: list[str], params: dict) -> RunResult:
    """run_served, with what the server's threads (tritonserver's and its stubs') used meanwhile where its
    pid is known."""
    before = thread_times.snapshot(process_group(server_pid))
    result = asyncio.run(run_served(url, args.model, prompts, params, args.concurrency))
    result.threads = thread_times.usage(before, thread_times.snapshot(process_group(server_pid)))
    return result


def process_group(pid: int | None) -> list[int]:
    """The processes in pid's process group (tritonserver and its stubs share one); [] for None or gone."""
    from nanoserve.serving.serve.launcher import group_members

    try:
        return group_members(os.getpgid(pid)) if pid else []
    except ProcessLookupError:
        return []


def served_with_warmup(served: tuple[str, int | None], args, prompts: list[str], warmup_prompts: list[str],
                       params: dict) -> RunResult:
    if warmup_prompts:
        asyncio.run(run_served(served[0], args.model, warmup_prompts, params, args.concurrency))
    return timed_served(*served, args, prompts, params)


def bench_served(args, prompts: list[str], warmup_prompts: list[str], params: dict) -> RunResult:
    """One served run: on the server at --url, or on a tritonserver launched for this run and stopped after it
    (a GPU cannot hold two engines at 90% memory, so the in-process run comes after)."""
    with served_url(args) as served:
        return served_with_warmup(served, args, prompts, warmup_prompts, params)


@contextlib.contextmanager
def served_url(args):
    """(gRPC url, tritonserver's pid or None): the server at --url (--server-pid), or a tritonserver launched
    for the block and stopped after it."""
    if args.url:
        yield args.url, args.server_pid
        return
    from nanoserve.serving.serve.launcher import TritonServer, free_ports

    log = Path(args.log_file).resolve()
    with TritonServer(args.model_repository, *free_ports(3), log_file=log) as server:
        print(f"starting tritonserver (log: {log})", file=sys.stderr, flush=True)
        server.wait_ready(args.timeout, models=[args.model])
        yield server.url_grpc, server.process.pid


def separate_sides(args, model_dir: str, engine_args: dict, params: dict) -> dict:
    """{side: run(prompts, warmup_prompts)}: each run launches or loads its side, warms it up and stops it."""
    stream = args.inprocess == "stream"
    return {"served": lambda prompts, warmup: bench_served(args, prompts, warmup, params),
            "in-process": lambda prompts, warmup: run_inprocess(model_dir, engine_args, prompts, params,
                                                                args.concurrency, warmup, stream)}


def together_sides(args, model_dir: str, engine_args: dict, params: dict, warmup_prompts: list[str],
                   stack: contextlib.ExitStack) -> dict:
    """--together: tritonserver and the in-process engine loaded side by side until `stack` closes, each warmed
    up once, so that a round's two runs follow each other within seconds (rounds bring no warmup prompts)."""
    served = stack.enter_context(served_url(args))
    sides = {"served": lambda prompts, _: timed_served(*served, args, prompts, params)}
    if not args.no_inprocess:
        llm = stack.enter_context(loaded_llm(model_dir, engine_args, args.concurrency))
        stream = args.inprocess == "stream"
        sides["in-process"] = lambda prompts, _: time_inprocess(llm, prompts, params, stream=stream)
    if warmup_prompts:
        for run in sides.values():
            run(warmup_prompts, None)
    return sides


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", required=True, help="the served model's repository (engine args "
                        "come from <repository>/<model>/1/model.json)")
    parser.add_argument("--url", help="gRPC host:port of a running server (default: launch tritonserver)")
    parser.add_argument("--server-pid", type=int, help="with --url: tritonserver's pid, to print what its threads "
                        "and its stubs' used during each run (Linux; a launched server's are printed anyway)")
    parser.add_argument("--model", default="nanoserve")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, help="default: --concurrency")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, help="requests (other prompts, same shape) run before each timed "
                        "run (default: --concurrency)")
    parser.add_argument("--no-inprocess", action="store_true")
    parser.add_argument("--inprocess", choices=("stream", "generate"), default="stream",
                        help="stream: engine requests streaming every step, as the server's are (default); "
                             "generate: the offline LLM.generate, which streams nothing")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run both sides this many times, each round on new prompts, odd rounds in-process "
                             "first; on a shared machine whose speed drifts, the median ratio is the steadier figure")
    parser.add_argument("--max-steal", type=float,
                        help="leave out of the median the rounds in which either side's host steal share (/proc/stat, "
                             "printed with each run) was above this, e.g. 0.03: on a shared VM the served side, "
                             "using more cores, is hit harder when the host is busy")
    parser.add_argument("--together", action="store_true",
                        help="keep tritonserver and the in-process engine loaded side by side for every round, each "
                             "warmed up once (a CPU model, or a GPU with memory for both engines): a round's two runs "
                             "then come seconds apart, the closest pairing on a host whose speed drifts")
    parser.add_argument("--simulated-device-ms", type=float,
                        help="a simulated device taking this many ms per step instead of the model's forward and "
                             "sampler math, in both sides; prints each run's share of the device-bound rate")
    parser.add_argument("--simulated-device-wait", choices=WAITS, default="sync",
                        help="sync: waited for where the host reads the sampled ids (default); launch: at the "
                             "step's launch, nothing of the step's host work overlapping; spin: as sync, polling")
    parser.add_argument("--min-ratio", type=float, help="exit 1 when served/in-process is below this")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the model to load")
    parser.add_argument("--log-file", default="bench_serving_tritonserver.log")
    args = parser.parse_args(argv)
    args.num_prompts = args.num_prompts or args.concurrency
    args.warmup = args.concurrency if args.warmup is None else args.warmup
    if args.simulated_device_ms is not None and not args.simulated_device_ms > 0:
        parser.error("--simulated-device-ms: expected a positive number")
    return args


def simulate_device(args) -> float | None:
    """With --simulated-device-ms: set the environment that the in-process engine and a launched tritonserver's
    stubs build their simulated device from; returns the device-bound rate in tok/s (else None)."""
    if args.simulated_device_ms is None:
        return None
    os.environ[ENV_STEP_MS] = str(args.simulated_device_ms)
    os.environ[ENV_WAIT] = args.simulated_device_wait
    if args.url:
        print(f"note: the server at --url simulates a device only if it was started with {ENV_STEP_MS}="
              f"{args.simulated_device_ms} {ENV_WAIT}={args.simulated_device_wait}", file=sys.stderr)
    return min(args.concurrency, args.num_prompts) * 1000 / args.simulated_device_ms


def round_order(round_: int, no_inprocess: bool) -> tuple[str, ...]:
    """Odd rounds run the in-process side first: on a machine whose speed drifts, a fixed order would favour
    one side in every round."""
    if no_inprocess:
        return ("served",)
    return ("served", "in-process") if round_ % 2 == 0 else ("in-process", "served")


def check_output_tokens(run: RunResult, expected: int) -> None:
    if run.output_tokens != expected:
        print(f"warning: the server reported {run.output_tokens} output tokens, expected {expected}",
              file=sys.stderr)


def too_much_steal(runs, max_steal: float | None) -> bool:
    return max_steal is not None and any(run.steal is not None and run.steal > max_steal for run in runs)


def run_round(args, round_: int, sides: dict, tokenizer: str, device_bound: float | None = None) -> dict:
    """{side: RunResult}: each round on new prompts (no prefix-cache hits), the same for both sides."""
    prompts = make_prompts(tokenizer, args.num_prompts, args.input_len, args.seed + 100 * round_)
    warmup_prompts = [] if args.together else make_warmup_prompts(args, round_, tokenizer)  # --together: once
    runs = {}
    for side in round_order(round_, args.no_inprocess):
        runs[side] = sides[side](prompts, warmup_prompts)
        if side == "served":
            check_output_tokens(runs[side], args.num_prompts * args.output_len)
        print(runs[side].describe(f"{round_}: {side}", args.num_prompts, device_bound), flush=True)
    return runs


def make_warmup_prompts(args, round_: int, tokenizer: str) -> list[str]:
    """Others than the round's, so that its timed prompts are not prefix-cached."""
    return make_prompts(tokenizer, args.warmup, args.input_len, args.seed + 100 * round_ + 1)


def run_rounds(args, sides: dict, tokenizer: str,
               device_bound: float | None = None) -> tuple[list[float], list[float], list[dict]]:
    """(ratios kept, ratios left out for host steal), a round each, and each round's {side: RunResult}."""
    ratios, left_out, rounds = [], [], []
    for round_ in range(args.rounds):
        runs = run_round(args, round_, sides, tokenizer, device_bound)
        rounds.append(runs)
        if "in-process" in runs:
            ratio = runs["served"].tokens_per_s / runs["in-process"].tokens_per_s
            stolen = too_much_steal(runs.values(), args.max_steal)
            (left_out if stolen else ratios).append(ratio)
            print(f"{round_}: served / in-process: {ratio:.3f}{' (left out: host steal)' if stolen else ''}",
                  flush=True)
    return ratios, left_out, rounds


def print_device_shares(rounds: list[dict], device_bound: float, args) -> None:
    """Each side's median share of the simulated device's rate over the rounds, and their range."""
    print(f"device-bound rate: {device_bound:.0f} tok/s ({min(args.concurrency, args.num_prompts)} rows, "
          f"{args.simulated_device_ms:g} ms per step, wait: {args.simulated_device_wait})")
    for side in rounds[0]:
        shares = sorted(runs[side].tokens_per_s / device_bound for runs in rounds)
        print(f"{side} / device-bound: {statistics.median(shares):.3f} (median of {len(shares)} round(s), "
              f"range {shares[0]:.3f}-{shares[-1]:.3f})")


def main(argv=None) -> int:
    from nanoserve.serving.shared.model_json import load_engine_args

    args = parse_args(argv)
    device_bound = simulate_device(args)
    engine_args = load_engine_args(str(Path(args.model_repository) / args.model))
    model_dir = engine_args.pop("model")
    tokenizer = engine_args.get("tokenizer") or model_dir
    params = sampling_parameters(args.output_len, args.temperature, ignore_eos=True)
    with contextlib.ExitStack() as stack:
        if args.together:
            sides = together_sides(args, model_dir, engine_args, params, make_warmup_prompts(args, -1, tokenizer),
                                   stack)
        else:
            sides = separate_sides(args, model_dir, engine_args, params)
        ratios, left_out, rounds = run_rounds(args, sides, tokenizer, device_bound)
    if device_bound:
        print_device_shares(rounds, device_bound, args)
    if not ratios:
        if left_out:
            print(f"no round within --max-steal {args.max_steal}: {len(left_out)} left out")
            return 1
        return 0
    ratio = statistics.median(ratios)
    print(f"served / in-process: {ratio:.3f} at {args.concurrency} streams (median of {len(ratios)} round(s): "
          f"{', '.join(f'{r:.3f}' for r in ratios)}"
          f"{f'; {len(left_out)} left out for host steal' if left_out else ''}; target >= 0.95)")
    return 1 if args.min_ratio is not None and ratio < args.min_ratio else 0


if __name__ == "__main__":
    sys.exit(main())
