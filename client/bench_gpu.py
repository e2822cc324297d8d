"""GPU benchmark (issue 33; not a test): one command that fits --budget-s seconds and prints one JSON summary,
also written to --out DIR/bench_gpu.json. Every figure is a ratio, or set against a floor measured in the same run.

    python client/bench_gpu.py --budget-s 420 --out DIR      # on a GPU: under 8 minutes
    python client/bench_gpu.py --dry-run --out DIR           # anywhere: every section on the CPU, tiny shapes
    python client/bench_gpu.py --model DIR ...               # another checkpoint than the random Qwen3-0.6B

Model: a Qwen3-0.6B-shaped checkpoint with random bf16 weights, built locally (once, under --model-cache).
Sections, in order (each skipped, with the reason, when the budget has no room left for it):
  ceilings   the device-to-device copy bandwidth (a 1 GiB torch copy, read + write counted) and a bf16 matmul's
             FLOP/s: the floors below divide by them
  decode     one decode step at batch 64 and 256 (contexts ~1024 +-25%, blocks shuffled): (weight bytes + KV bytes
             read) / copy bandwidth is its floor; the forward's device time with and without its CUDA graph, the
             LM head, the whole runner step (host work, forward, sampler) on the wall, each over the floor
  kernels    each Triton kernel of client/bench_kernels.py at Qwen3-0.6B shapes: bytes it must move / time,
             against the copy bandwidth
  host_wait  the share of an engine step the GPU waits for the host, at batch 8 and 256 (client/bench_gpu_idle.py)
  workload   nano-vllm's workload (256 sequences, prompt and output lengths uniform in [100, 1024], random token
             ids, ignore_eos, temperature 0.6), shortened to fit the budget and named as such: output tok/s with
             CUDA graphs and with enforce_eager, each against the workload's bandwidth floor (every decode step
             reading the weights and every running sequence's KV once); and its first --hf-subset sequences through
             nanoserve and HF transformers `generate` side by side
  served     the same engine through tritonserver, 64 gRPC streams, served / in-process (client/bench_serving.py);
             skipped with a note where no tritonserver is installed
"targets" holds issue 33's: the workload at >= 70% of its floor, the batch-256 step <= 1.3x its floor, the GPU
idle < 5% of a batch-256 step. Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import glob
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.model_runner import ModelRunner, pick_device
from nanoserve.engine.scheduler_output import NewSequence, SchedulerOutput
from nanoserve.layers.attention import AttentionBatch
from nanoserve.sampling_params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling bench scripts

# Qwen3-0.6B's config.json, except that the tokenizer is the small local one (token ids are random anyway)
QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.02)
QWEN3_0_6B_VOCAB = 151936


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_qwen3_0_6b(out_dir: str) -> str:
    from nanoserve.tiny_model import build_tiny_model

    if not os.path.exists(os.path.join(out_dir, "config.json")):
        log(f"building a random-weight Qwen3-0.6B-shaped checkpoint in {out_dir}")
        build_tiny_model(out_dir, "qwen3", vocab_size=QWEN3_0_6B_VOCAB, dtype="bfloat16", **QWEN3_0_6B)
    return out_dir


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- timing ----
def device_ms(fn, iters: int, device: torch.device) -> float:
    """Mean time of `iters` back-to-back calls, from CUDA events (CPU: wall time). When the host cannot keep
    the device busy, this includes the idle gaps, as a real step would."""
    fn()
    if device.type != "cuda":
        return wall_ms(fn, iters, device)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def wall_ms(fn, iters: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Bytes per second of a device-to-device torch copy of nbytes, counting the read and the write."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = device_ms(lambda: dst.copy_(src), iters, device)
    return 2 * nbytes / (ms * 1e-3)


def matmul_flops(device: torch.device, n: int = 8192, iters: int = 10) -> float:
    """FLOP/s of a square bf16 matmul: the compute ceiling the decode GEMMs approach at batch 256."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    ms = device_ms(lambda: a @ b, iters, device)
    return 2 * n ** 3 / (ms * 1e-3)


# ---- the budget ----
class Budget:
    """Seconds left of --budget-s; a section that needs more than is left is skipped, with the reason."""

    def __init__(self, budget_s: float):
        self.budget_s, self.start = budget_s, time.monotonic()
        self.skipped: dict[str, str] = {}

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def allows(self, section: str, need_s: float) -> bool:
        if self.left() >= need_s:
            return True
        self.skipped[section] = f"budget: {self.left():.0f} s left, about {need_s:.0f} s needed"
        log(f"skipping {section}: {self.skipped[section]}")
        return False


def workload_shape(budget_s: float) -> tuple[int, int, int]:
    """(sequences, min_len, max_len) of the nano-vllm workload shortened to fit the budget: the whole of it
    (256, 100, 1024) from 900 s; below, shorter lengths, and below 300 s fewer sequences too."""
    if budget_s >= 900:
        return 256, 100, 1024
    max_len = max(32, int(1024 * budget_s / 900))
    return (256 if budget_s >= 300 else max(16, int(256 * budget_s / 300))), min(100, max_len // 4), max_len


def workload_name(args) -> str:
    full = (args.num_seqs, args.min_len, args.max_len) == (256, 100, 1024)
    return (f"nano-vllm's workload{'' if full else ', shortened'}: {args.num_seqs} sequences, prompt and output "
            f"lengths uniform in [{args.min_len}, {args.max_len}], random token ids, ignore_eos, temperature "
            f"{args.temperature}")


# ---- memory-bandwidth floors ----
def model_bytes(model_dir: str) -> tuple[int, int]:
    """(weight bytes a decode step reads, KV bytes per context token) from the checkpoint: every stored tensor
    once, less an input embedding the LM head does not share (a step reads only its rows); k and v of every
    layer."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    elem = getattr(torch, str(getattr(config, "dtype", None) or "bfloat16").replace("torch.", "")).itemsize
    stored = sum(os.path.getsize(f) for f in glob.glob(os.path.join(model_dir, "*.safetensors")))
    untied_embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size * elem
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * elem
    return stored - untied_embedding, kv_per_token


def workload_floor_s(prompt_lens, output_lens, weight_bytes: int, kv_per_token: int, copy_bps: float) -> float:
    """Seconds the workload's decode steps need at least, every sequence running from the start: step t reads
    the weights and the KV of every sequence still decoding (prompt + t tokens) once."""
    prompt, output = np.asarray(prompt_lens, np.int64), np.asarray(output_lens, np.int64)
    steps = np.arange(int(output.max()))
    running = output[None, :] > steps[:, None]  # [step, sequence]
    kv_tokens = (running * (prompt[None, :] + steps[:, None])).sum()
    return (len(steps) * weight_bytes + int(kv_tokens) * kv_per_token) / copy_bps


# ---- the workload: nanoserve with and without CUDA graphs, HF generate on a subset ----
@dataclass
class OfflineResult:
    label: str
    seconds: float
    tokens: int
    preemptions: int | None = None

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds

    def as_json(self, floor_tok_s: float | None = None) -> dict:
        out = {"engine": self.label, "output_tokens": self.tokens, "seconds": round(self.seconds, 3),
               "tok_s": round(self.tok_per_s, 1), "preemptions": self.preemptions}
        if floor_tok_s:
            out["vs_floor"] = round(self.tok_per_s / floor_tok_s, 3)
        return out


def time_nanoserve(label: str, model: str, prompts, output_lens, engine_args: dict, temperature: float,
                   warmup_prompts) -> OfflineResult:
    from bench_offline import bench_nanoserve

    log(f"{label}: engine_args={engine_args}")
    try:
        seconds, tokens, stats = bench_nanoserve(model, prompts, output_lens, engine_args, temperature,
                                                 warmup_prompts)
    finally:
        release_memory()
    return OfflineResult(label, seconds, tokens, stats.get("num_preemptions"))


def offline_engine_args(args, device: str, num_seqs: int) -> dict:
    return {"device": device, "max_model_len": args.max_model_len, "max_num_seqs": num_seqs,
            **dict(kv.split("=", 1) for kv in args.engine_arg)}


def run_offline(model: str, args, device: str, budget: Budget) -> list[OfflineResult]:
    """nanoserve on the workload with CUDA graphs, then with enforce_eager (each after a short warm-up)."""
    from bench_offline import make_workload
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    prompts, output_lens = make_workload(args.num_seqs, args.min_len, args.max_len, vocab, args.seed)
    warmup_prompts, _ = make_workload(4, args.min_len, args.max_len, vocab, args.seed + 1)
    engine_args = offline_engine_args(args, device, args.num_seqs)
    results = []
    for label, eager in (("nanoserve, CUDA graphs", False), ("nanoserve, enforce_eager", True)):
        if results and not budget.allows(f"workload: {label}", 2.5 * results[0].seconds):
            break
        results.append(time_nanoserve(label, model, prompts, output_lens, {**engine_args, "enforce_eager": eager},
                                      args.temperature, warmup_prompts))
        log(f"{label}: {results[-1].tok_per_s:.0f} tok/s")
    return results


def run_hf_subset(model: str, args, device: str) -> dict:
    """The first --hf-subset sequences of the workload through nanoserve (CUDA graphs) and through HF
    generate (one static left-padded batch), side by side."""
    from bench_offline import bench_hf, make_workload
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    prompts, output_lens = make_workload(args.num_seqs, args.min_len, args.max_len, vocab, args.seed)
    k = min(args.hf_subset, args.num_seqs)
    prompts, output_lens = prompts[:k], output_lens[:k]
    ours = time_nanoserve(f"nanoserve, CUDA graphs, first {k} sequences", model, prompts, output_lens,
                          offline_engine_args(args, device, k), args.temperature, prompts[:2])
    log(f"HF generate, {k} sequences in one batch")
    seconds, tokens = bench_hf(model, prompts, output_lens, device, k, args.temperature)
    release_memory()
    hf = OfflineResult(f"HF transformers generate, first {k} sequences in one batch", seconds, tokens)
    return {"num_seqs": k, "runs": [ours.as_json(), hf.as_json()],
            "nanoserve_vs_hf": round(ours.tok_per_s / hf.tok_per_s, 3)}


def workload_json(model: str, args, results: list[OfflineResult], copy_bps: float | None) -> dict:
    from bench_offline import make_workload
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    prompts, output_lens = make_workload(args.num_seqs, args.min_len, args.max_len, vocab, args.seed)
    floor_tok_s = None
    if copy_bps:
        weights, kv_per_token = model_bytes(model)
        floor_s = workload_floor_s([len(p) for p in prompts], output_lens, weights, kv_per_token, copy_bps)
        floor_tok_s = sum(output_lens) / floor_s
    out = {"name": workload_name(args), "output_tokens": sum(output_lens),
           "floor_tok_s": None if floor_tok_s is None else round(floor_tok_s, 1),
           "runs": [r.as_json(floor_tok_s) for r in results]}
    if len(results) == 2:
        out["graphs_vs_eager"] = round(results[0].tok_per_s / results[1].tok_per_s, 3)
    return out


# ---- (b) the decode step against its floors ----
@dataclass
class DecodeResult:
    batch: int
    mean_ctx: float
    weight_bytes: int
    kv_bytes: int
    flops: int
    forward_graph_ms: float | None
    forward_eager_ms: float
    logits_ms: float
    step_graph_ms: float | None
    step_eager_ms: float


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Weight bytes one decode step reads: every parameter once (tied ones once), except an input embedding
    the LM head does not share, of which a step reads only its batch's rows."""
    from nanoserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding

    params = {p.data_ptr(): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    heads = {m.weight.data_ptr() for m in model.modules() if isinstance(m, ParallelLMHead)}
    for m in model.modules():
        if type(m) is VocabParallelEmbedding and m.weight.data_ptr() not in heads:
            total -= m.weight.numel() * m.weight.element_size()
    return total


def decode_flops(hf_config, weight_params: int, batch: int, total_ctx: int) -> int:
    """2 FLOPs per weight per row (the GEMMs), plus QK and PV over every context token of every layer."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    attention = 4 * total_ctx * hf_config.num_attention_heads * head_dim * hf_config.num_hidden_layers
    return 2 * weight_params * batch + attention


def decode_step(runner, batch: int, ctx: int, seed: int):
    """A decode step of `batch` sequences with contexts uniform in ctx +- 25%, blocks shuffled over the cache
    as after some serving, as the scheduler would send it; -> (SchedulerOutput, seq_lens)."""
    rng = random.Random(seed)
    block_size, vocab = runner.block_size, runner.config.hf_config.vocab_size
    seq_lens = [rng.randint(ctx - ctx // 4, ctx + ctx // 4) for _ in range(batch)]
    free = list(range(runner.kv_cache.shape[2]))
    rng.shuffle(free)
    params = SamplingParams(temperature=0.6, ignore_eos=True)
    new_seqs = [NewSequence(f"decode-{i}", [rng.randrange(vocab) for _ in range(n)], n, params,
                            [free.pop() for _ in range(-(-n // block_size))]) for i, n in enumerate(seq_lens)]
    out = SchedulerOutput(new_seqs=new_seqs, num_computed_tokens=np.array(seq_lens) - 1,  # the last position
                          num_scheduled_tokens=np.ones(batch, np.int64), samples=np.ones(batch, bool),
                          num_batched_tokens=batch)
    return out, seq_lens


def make_decode_runner(model: str, args, device: str, batch: int, seq_lens_bound: int):
    block_size = 16
    blocks = batch * -(-seq_lens_bound // block_size)
    config = EngineConfig.from_kwargs(model, device=device, max_num_seqs=batch,
                                      max_model_len=args.max_model_len, kvcache_block_size=block_size,
                                      num_kvcache_blocks=blocks)
    runner = ModelRunner(config, pick_device(config, 0))
    runner.init_kv_cache()
    return runner


def measure_decode(runner, out, seq_lens: list[int], iters: int) -> DecodeResult:
    """The forward (graphed and eager), the LM head, and a whole step (inputs, forward, sampling), each run
    again and again on the same decode step (it recomputes the rows' last positions)."""
    device = runner.device
    runner.batch.update(out)  # the rows join the runner's batch once
    inputs = runner.batch.prepare(out)
    with torch.inference_mode():
        input_ids, positions, slot_mapping, _, query_start_loc, seq_lens_t, block_tables = runner._upload(
            inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.logits_indices, inputs.query_start_loc,
            inputs.seq_lens, inputs.block_tables)
        batch = AttentionBatch(slot_mapping, query_start_loc, seq_lens_t, block_tables, 1, inputs.max_seq_len)
        forward_eager = device_ms(lambda: runner.model(input_ids, positions, runner.backend.build(batch)), iters,
                                  device)
        graphs, forward_graph = runner.graphs, None
        if graphs is not None and graphs.can_run(len(seq_lens), block_tables.shape[1], 1):
            forward_graph = device_ms(lambda: graphs.run(input_ids, positions, batch), iters, device)
        hidden = runner.model(input_ids, positions, runner.backend.build(batch))
        logits = device_ms(lambda: runner.model.compute_logits(hidden).float(), iters, device)

    @torch.inference_mode()
    def step():
        runner.sample(runner.forward(runner.batch.prepare(out)))
    step_graph = wall_ms(step, iters, device) if forward_graph is not None else None
    runner.graphs = None
    try:
        step_eager = wall_ms(step, iters, device)
    finally:
        runner.graphs = graphs
    kv = runner.kv_cache
    kv_bytes_per_token = kv[:, :, 0, 0].numel() * kv.element_size()  # k and v, every layer
    weights = weight_bytes_read(runner.model)
    flops = decode_flops(runner.config.hf_config, weights // runner.dtype.itemsize, len(seq_lens), sum(seq_lens))
    return DecodeResult(len(seq_lens), sum(seq_lens) / len(seq_lens), weights, sum(seq_lens) * kv_bytes_per_token,
                        flops, forward_graph, forward_eager, logits, step_graph, step_eager)


def run_decode(model: str, args, device: str, batch: int) -> DecodeResult:
    ctx_bound = args.decode_ctx + args.decode_ctx // 4
    if ctx_bound > args.max_model_len:
        raise SystemExit(f"--decode-ctx {args.decode_ctx} (+25%) exceeds --max-model-len {args.max_model_len}")
    log(f"decode step: batch {batch}, context ~{args.decode_ctx}")
    runner = make_decode_runner(model, args, device, batch, ctx_bound)
    try:
        out, seq_lens = decode_step(runner, batch, args.decode_ctx, args.seed)
        return measure_decode(runner, out, seq_lens, args.iters)
    finally:
        runner.shutdown()
        del runner
        release_memory()


def decode_json(r: DecodeResult, copy_bps: float, peak_flops: float) -> dict:
    floor_ms = (r.weight_bytes + r.kv_bytes) / copy_bps * 1e3

    def over_floor(ms: float | None) -> float | None:
        return None if ms is None else round(ms / floor_ms, 3)
    rounded = {k: None if v is None else round(v, 4) for k, v in vars(r).items() if k.endswith("_ms")}
    return {"batch": r.batch, "mean_ctx": round(r.mean_ctx, 1), "weight_bytes": r.weight_bytes,
            "kv_bytes": r.kv_bytes, "floor_ms": round(floor_ms, 4),
            "compute_floor_ms": round(r.flops / peak_flops * 1e3, 4), **rounded,
            "forward_graph_over_floor": over_floor(r.forward_graph_ms),
            "step_graph_over_floor": over_floor(r.step_graph_ms),
            "step_eager_over_floor": over_floor(r.step_eager_ms)}


# ---- kernels (client/bench_kernels.py) against the copy bandwidth ----
def run_kernels(args) -> list:
    import bench_kernels

    kernel_args = bench_kernels.parse_args(["--batch", str(max(args.decode_batches)), "--ctx",
                                            str(args.decode_ctx)])
    log("kernels (client/bench_kernels.py):")
    return bench_kernels.run_all(kernel_args, verbose=False)


def kernels_json(results: list, copy_bps: float) -> list[dict]:
    return [{"kernel": r.name, "us": round(r.ms * 1e3, 2), "gbps": round(r.gbps, 1),
             "vs_copy_bandwidth": round(r.nbytes / (r.ms * 1e-3) / copy_bps, 3),
             "tflops": round(r.flops / r.ms / 1e9, 1) if r.flops else None} for r in results]


# ---- through tritonserver ----
def served_skip_reason(args) -> str | None:
    """Why the served comparison cannot run here, or None."""
    from nanoserve.serving.serve.launcher import find_tritonserver

    if args.dry_run:
        return "dry run: tritonserver is not launched"
    try:
        find_tritonserver()
    except FileNotFoundError as e:
        return f"no tritonserver here ({e}); its wheel (nvidia-pytriton, 55 MB) does not fit in one device call"
    return None


def run_served(model: str, args, out_dir: str, device: str = "cuda") -> dict:
    """client/bench_serving.py at 64 gRPC streams: served / in-process output tok/s on the same requests."""
    from nanoserve.serving.serve.launcher import make_model_repository

    repo = make_model_repository(os.path.join(out_dir, "served-repository"), model, models=["nanoserve"],
                                 device=device, max_num_seqs=64)
    command = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_serving.py"),
               "--model-repository", str(repo), "--concurrency", "64", "--input-len", "128", "--output-len",
               str(args.served_output_len), "--log-file", os.path.join(out_dir, "tritonserver.log")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=max(60.0, args.budget_s / 2))
    lines = [line for line in done.stdout.splitlines() if line.startswith("served / in-process:")]
    ratio = float(lines[-1].split(":")[1].split()[0]) if lines else None
    return {"command": shlex.join(command), "returncode": done.returncode, "served_vs_inprocess": ratio,
            "streams": 64, "output": done.stdout[-2000:]}


# ---- main ----
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds the whole run may take")
    p.add_argument("--out", required=True, help="folder for bench_gpu.json (and the served run's logs)")
    p.add_argument("--dry-run", action="store_true", help="every section on the CPU at tiny shapes (seconds)")
    p.add_argument("--model", help="checkpoint dir (default: a random-weight Qwen3-0.6B-shaped one, built once)")
    p.add_argument("--model-cache", default=os.path.join(tempfile.gettempdir(), "nanoserve-bench-qwen3-0.6b-random"),
                   help="where the default checkpoint is built")
    p.add_argument("--num-seqs", type=int, help="workload sequences (default: from --budget-s)")
    p.add_argument("--min-len", type=int, help="default: from --budget-s")
    p.add_argument("--max-len", type=int, help="default: from --budget-s")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra engine argument for the workload's nanoserve runs (repeatable)")
    p.add_argument("--hf-subset", type=int, default=32, help="workload sequences HF generate runs")
    p.add_argument("--decode-batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--decode-ctx", type=int, default=1024, help="mean context of the decode step")
    p.add_argument("--idle-batches", type=int, nargs="+", default=[8, 256])
    p.add_argument("--idle-steps", type=int, default=50, help="engine steps timed, and as many profiled")
    p.add_argument("--iters", type=int, default=20, help="timed repetitions of the decode step")
    p.add_argument("--served-output-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    for section in SECTIONS:
        p.add_argument(f"--skip-{section.replace('_', '-')}", action="store_true")
    args = p.parse_args(argv)
    return dry_run_shapes(args) if args.dry_run else with_workload_shape(args)


SECTIONS = ("decode", "kernels", "host_wait", "workload", "hf", "served")


def with_workload_shape(args):
    num_seqs, min_len, max_len = workload_shape(args.budget_s)
    args.num_seqs = args.num_seqs or num_seqs
    args.min_len = args.min_len or min_len
    args.max_len = args.max_len or max_len
    return args


def dry_run_shapes(args):
    """Tiny shapes for the CPU: the tests' tiny Qwen3 (float32), a handful of short sequences."""
    args.num_seqs, args.min_len, args.max_len, args.max_model_len = 3, 4, 12, 64
    args.hf_subset, args.decode_batches, args.decode_ctx, args.iters = 2, [2, 4], 16, 2
    args.idle_batches, args.idle_steps, args.skip_kernels = [2, 4], 3, True
    return args


def ceilings(device: torch.device, dry_run: bool) -> tuple[float, float]:
    """(copy bandwidth in bytes/s, bf16 matmul FLOP/s)."""
    copy_bps = copy_bandwidth(device, 1 << 20, 2) if dry_run else copy_bandwidth(device)
    peak = matmul_flops(device, 64, 2) if dry_run else matmul_flops(device)
    release_memory()
    return copy_bps, peak


def run_sections(model: str, args, device: str, budget: Budget) -> dict:
    """Every section that is not skipped and fits the budget, in the order of the docstring."""
    copy_bps, peak = ceilings(torch.device(device), args.dry_run)
    result: dict = {"ceilings": {"copy_gbps": round(copy_bps / 1e9, 3), "matmul_tflops": round(peak / 1e12, 4)}}
    if not args.skip_decode:
        result["decode"] = [decode_json(run_decode(model, args, device, batch), copy_bps, peak)
                            for batch in args.decode_batches if budget.allows(f"decode at batch {batch}", 20)]
    if not args.skip_kernels and budget.allows("kernels", 30):
        result["kernels"] = kernels_json(run_kernels(args), copy_bps)
    if not args.skip_host_wait:
        result["host_wait"] = [run_idle(model, args, device, batch).as_json()
                               for batch in args.idle_batches if budget.allows(f"host_wait at batch {batch}", 20)]
    if not args.skip_workload and budget.allows("workload", 40):
        result["workload"] = workload_json(model, args, run_offline(model, args, device, budget), copy_bps)
        if not args.skip_hf and budget.allows("workload: HF subset", 40):
            result["workload"]["hf_subset"] = run_hf_subset(model, args, device)
    if not args.skip_served:
        reason = served_skip_reason(args)
        result["served"] = {"skipped": reason} if reason else run_served(model, args, args.out)
    return result


def run_idle(model: str, args, device: str, batch: int):
    from bench_gpu_idle import measure_idle

    log(f"host wait: batch {batch}")
    try:
        return measure_idle(model, batch, args.decode_ctx, args.idle_steps,
                            {"device": device, "max_model_len": args.max_model_len})
    finally:
        release_memory()


def targets(result: dict) -> dict:
    """Issue 33's targets, each True / False, or None where its section did not run."""
    graphs = next((r for r in result.get("workload", {}).get("runs", []) if "vs_floor" in r), None)
    decode = {d["batch"]: d for d in result.get("decode", [])}
    idle = {h["batch"]: h for h in result.get("host_wait", [])}
    step256 = decode.get(256, {}).get("step_graph_over_floor")
    idle256 = idle.get(256, {}).get("gpu_idle_share")
    return {"workload_vs_floor >= 0.70": None if graphs is None else graphs["vs_floor"] >= 0.70,
            "decode_step_256_over_floor <= 1.3": None if step256 is None else step256 <= 1.3,
            "gpu_idle_share_256 < 0.05": None if idle256 is None else idle256 < 0.05}


def run_header(args, device: str) -> dict:
    import transformers
    import triton

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {"command": "python " + shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
            "device": name, "date": datetime.date.today().isoformat(), "dry_run": args.dry_run,
            "budget_s": args.budget_s, "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                                                    "triton": triton.__version__,
                                                    "transformers": transformers.__version__}}


def bench_model(args) -> tuple[str, str]:
    """(checkpoint dir, its description)."""
    if args.model:
        return args.model, args.model
    if args.dry_run:
        from nanoserve.tiny_model import build_tiny_model

        out = os.path.join(args.out, "tiny-qwen3")
        if not os.path.exists(os.path.join(out, "config.json")):
            build_tiny_model(out, "qwen3")
        return out, "the tests' tiny random-weight Qwen3 (float32)"
    return build_qwen3_0_6b(args.model_cache), "random-weight Qwen3-0.6B shape (bf16)"


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA GPU: torch.cuda.is_available() is False on this machine "
                 "(--dry-run runs every section on the CPU at tiny shapes).")
    os.makedirs(args.out, exist_ok=True)
    budget = Budget(args.budget_s)
    device = "cpu" if args.dry_run else "cuda"
    summary = run_header(args, device)
    model, summary["model"] = bench_model(args)
    summary.update(run_sections(model, args, device, budget))
    summary["targets"] = targets(summary)
    summary["skipped"] = budget.skipped
    summary["seconds"] = round(budget.budget_s - budget.left(), 1)
    text = json.dumps(summary, indent=2)
    with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
        f.write(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
