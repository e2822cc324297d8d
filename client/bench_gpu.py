"""GPU benchmark for docs/benchmarks.md (not a test): prints markdown tables headed by the command, device
and date. Needs a CUDA GPU.

    python client/bench_gpu.py                                # everything
    python client/bench_gpu.py --skip-hf --skip-kernels       # nanoserve only
    python client/bench_gpu.py --model DIR                    # another checkpoint than the random Qwen3-0.6B

(a) Offline throughput on nano-vllm's workload: 256 sequences of random token ids, prompt and output lengths
    uniform in [100, 1024], ignore_eos, temperature 0.6, on a Qwen3-0.6B-shaped checkpoint with random bf16
    weights built locally (once, under the temp dir). Output tok/s of nanoserve with CUDA graphs and with
    enforce_eager, and of HF transformers `generate` (static left-padded batches) on the same GPU.
(b) One decode step at batch 256 against its memory-bandwidth floor: (weight bytes + KV bytes read per step)
    / the device's copy bandwidth (a large torch copy, read + write counted). Device time of the forward with
    and without its CUDA graph, and wall time of the whole engine step (host work, LM head, sampler). Then the
    kernels of client/bench_kernels.py, each against the same copy bandwidth.
Progress goes to stderr, the tables to stdout.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import random
import shlex
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


# ---- markdown ----
def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def header(command: str, device_name: str) -> str:
    import transformers
    import triton

    return (f"### nanoserve GPU benchmark: {device_name}, {datetime.date.today().isoformat()}\n\n"
            f"`{command}`  \ntorch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
            f"transformers {transformers.__version__}\n")


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB"


# ---- (a) offline throughput ----
@dataclass
class OfflineResult:
    label: str
    seconds: float
    tokens: int
    preemptions: int | None = None

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds


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


def run_offline(model: str, args, device: str) -> list[OfflineResult]:
    from bench_offline import bench_hf, make_workload
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    prompts, output_lens = make_workload(args.num_seqs, args.min_len, args.max_len, vocab, args.seed)
    warmup_prompts, _ = make_workload(4, args.min_len, args.max_len, vocab, args.seed + 1)
    engine_args = {"device": device, "max_model_len": args.max_model_len, "max_num_seqs": args.num_seqs,
                   **dict(kv.split("=", 1) for kv in args.engine_arg)}
    results = []
    for label, eager in (("nanoserve, CUDA graphs", False), ("nanoserve, enforce_eager", True)):
        results.append(time_nanoserve(label, model, prompts, output_lens, {**engine_args, "enforce_eager": eager},
                                      args.temperature, warmup_prompts))
        log(f"{label}: {results[-1].tok_per_s:.0f} tok/s")
    if not args.skip_hf:
        batch = min(args.hf_batch_size, args.num_seqs)
        log(f"HF generate, batches of {batch}")
        seconds, tokens = bench_hf(model, prompts, output_lens, device, batch, args.temperature)
        release_memory()
        results.append(OfflineResult(f"HF transformers generate (batches of {batch})", seconds, tokens))
    return results


def offline_table(results: list[OfflineResult], args) -> str:
    hf = next((r for r in results if r.label.startswith("HF")), None)
    rows = [[r.label, r.tokens, f"{r.seconds:.1f}", f"{r.tok_per_s:.0f}",
             f"{r.tok_per_s / hf.tok_per_s:.2f}x" if hf else "-", "-" if r.preemptions is None else r.preemptions]
            for r in results]
    title = (f"#### Offline throughput: {args.num_seqs} sequences, prompt and output lengths uniform in "
             f"[{args.min_len}, {args.max_len}], ignore_eos, temperature {args.temperature}\n\n")
    return title + markdown_table(["engine", "output tokens", "time (s)", "output tok/s", "vs HF", "preemptions"],
                                  rows)


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


def make_decode_runner(model: str, args, device: str, seq_lens_bound: int):
    block_size = 16
    blocks = args.decode_batch * -(-seq_lens_bound // block_size)
    config = EngineConfig.from_kwargs(model, device=device, max_num_seqs=args.decode_batch,
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
        if graphs is not None and graphs.can_run(len(seq_lens), block_tables.shape[1], True):
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


def run_decode(model: str, args, device: str) -> DecodeResult:
    ctx_bound = args.decode_ctx + args.decode_ctx // 4
    if ctx_bound > args.max_model_len:
        raise SystemExit(f"--decode-ctx {args.decode_ctx} (+25%) exceeds --max-model-len {args.max_model_len}")
    log(f"decode step: batch {args.decode_batch}, context ~{args.decode_ctx}")
    runner = make_decode_runner(model, args, device, ctx_bound)
    try:
        out, seq_lens = decode_step(runner, args.decode_batch, args.decode_ctx, args.seed)
        return measure_decode(runner, out, seq_lens, args.iters)
    finally:
        runner.shutdown()
        del runner
        release_memory()


def decode_table(r: DecodeResult, copy_bps: float, peak_flops: float) -> str:
    bw_floor = (r.weight_bytes + r.kv_bytes) / copy_bps * 1e3
    compute_floor = r.flops / peak_flops * 1e3

    def vs_floor(ms: float | None) -> list[str]:
        if ms is None:
            return ["not run (no graph for this batch)", "-"]
        return [f"{ms:.3f} ms", f"{bw_floor / ms:.0%}"]
    rows = [
        ["weight bytes read per step", gb(r.weight_bytes), ""],
        ["KV bytes read per step", gb(r.kv_bytes), ""],
        ["device copy bandwidth (read + write, 1 GiB copy)", f"{copy_bps / 1e9:.0f} GB/s", ""],
        ["**memory-bandwidth floor** (weights + KV) / copy bandwidth", f"{bw_floor:.3f} ms", "100%"],
        ["bf16 matmul peak (8192^3)", f"{peak_flops / 1e12:.0f} TFLOP/s", ""],
        ["compute floor (GEMMs + attention FLOPs) / matmul peak", f"{compute_floor:.3f} ms", ""],
        ["forward, CUDA graph replay (device time)", *vs_floor(r.forward_graph_ms)],
        ["forward, eager (device time incl. launch gaps)", *vs_floor(r.forward_eager_ms)],
        ["LM head + float32 logits (eager, not graphed)", f"{r.logits_ms:.3f} ms", ""],
        ["engine step with CUDA graphs (wall: host prep, forward, LM head, sampler)", *vs_floor(r.step_graph_ms)],
        ["engine step, enforce_eager (wall)", *vs_floor(r.step_eager_ms)],
    ]
    title = (f"#### Decode step: batch {r.batch}, mean context {r.mean_ctx:.0f} tokens (uniform +-25%), "
             "block size 16\n\n")
    return title + markdown_table(["", "value", "bandwidth floor / time"], rows)


# ---- kernels (client/bench_kernels.py) against the copy bandwidth ----
def run_kernels(args) -> list:
    import bench_kernels

    kernel_args = bench_kernels.parse_args(["--batch", str(args.decode_batch), "--ctx", str(args.decode_ctx)])
    log("kernels (client/bench_kernels.py):")
    return bench_kernels.run_all(kernel_args, verbose=True)


def kernels_table(results: list, copy_bps: float) -> str:
    rows = [[r.name, f"{r.ms * 1e3:.1f}", f"{r.gbps:.0f}", f"{r.nbytes / (r.ms * 1e-3) / copy_bps:.0%}",
             f"{r.flops / r.ms / 1e9:.0f}" if r.flops else "-"] for r in results]
    title = ("#### Kernels at Qwen3-0.6B shapes (client/bench_kernels.py): bytes each must move / time, against "
             f"the copy bandwidth ({copy_bps / 1e9:.0f} GB/s)\n\n")
    return title + markdown_table(["kernel", "time (us)", "GB/s", "% of copy bandwidth", "TFLOP/s"], rows)


# ---- main ----
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint dir (default: a random-weight Qwen3-0.6B-shaped one, built once)")
    p.add_argument("--model-cache", default=os.path.join(tempfile.gettempdir(), "nanoserve-bench-qwen3-0.6b-random"),
                   help="where the default checkpoint is built")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra engine argument for the offline nanoserve runs (repeatable)")
    p.add_argument("--hf-batch-size", type=int, default=64, help="HF generate's static batch size")
    p.add_argument("--decode-batch", type=int, default=256)
    p.add_argument("--decode-ctx", type=int, default=1024, help="mean context of the decode step")
    p.add_argument("--iters", type=int, default=20, help="timed repetitions of the decode step")
    p.add_argument("--seed", type=int, default=0)
    for section in ("offline", "hf", "decode", "kernels"):
        p.add_argument(f"--skip-{section}", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA GPU: torch.cuda.is_available() is False on this machine "
                 "(for CPU numbers see client/bench_offline.py).")
    args = parse_args(argv)
    device = torch.device("cuda")
    model = args.model or build_qwen3_0_6b(args.model_cache)
    command = "python " + shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    print(header(command, torch.cuda.get_device_name()), flush=True)
    print(f"Model: {'random-weight Qwen3-0.6B shape (bf16)' if args.model is None else model}\n", flush=True)
    if not args.skip_offline:
        print(offline_table(run_offline(model, args, "cuda"), args) + "\n", flush=True)
    if args.skip_decode and args.skip_kernels:
        return
    copy_bps = copy_bandwidth(device)
    if not args.skip_decode:
        peak = matmul_flops(device)
        release_memory()
        print(decode_table(run_decode(model, args, "cuda"), copy_bps, peak) + "\n", flush=True)
    if not args.skip_kernels:
        print(kernels_table(run_kernels(args), copy_bps) + "\n", flush=True)


if __name__ == "__main__":
    main()
