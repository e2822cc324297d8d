"""A/B benchmarks of two nanoserve checkouts on this machine: the same command, run by each checkout's own
client/ scripts and .venv, the two alternating (A B, then B A, ...) for --rounds rounds.

    python client/bench_ab.py /path/to/old /path/to/new --rounds 5                       # host overhead + offline
    python client/bench_ab.py OLD NEW --rounds 5 --benchmarks serving --model-repository REPO

Benchmarks (each checkout needs a .venv made by scripts/setup.sh):
- host: client/bench_host_overhead.py --num-seqs 64 256 --steps 50 --host-only: the engine's host overhead per
  decode step, generate and streamed (lower is better);
- offline: client/bench_offline.py --num-seqs 64 --min-len 16 --max-len 256 --skip-hf: output tok/s of
  LLM.generate (higher is better);
- serving: client/bench_serving.py --together: served / in-process output tok/s through a real tritonserver
  (higher is better; needs --model-repository);
- simulated: the same with a simulated device of --simulated-device-ms ms per step (8) at 64 rows, 128-token
  outputs: each side's share of the device-bound rate (higher is better; both checkouts need the option).
Every run records the load average and the host's steal share meanwhile (a shared VM's neighbours). The table
gives per figure each side's median over the rounds and B's median / A's median.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HOST = re.compile(r"^(generate|stream)\s+seqs=\s*(\d+).*host overhead=\s*(\d+) us", re.M)
OFFLINE = re.compile(r"^round \d+: nanoserve: .* = ([\d.]+) tok/s", re.M)
SERVING = re.compile(r"^served / in-process: ([\d.]+)", re.M)
DEVICE_SHARE = re.compile(r"^(served|in-process) / device-bound: ([\d.]+)", re.M)


def commands(args) -> dict[str, list[str]]:
    serving = ["client/bench_serving.py", "--model-repository", str(args.model_repository or ""), "--together",
               "--rounds", str(args.serving_rounds), "--concurrency", "64", "--num-prompts", "256", "--input-len", "64",
               "--output-len", "64"]
    return {
        "host": ["client/bench_host_overhead.py", "--num-seqs", "64", "256", "--steps", "50", "--host-only"],
        "offline": ["client/bench_offline.py", "--num-seqs", "64", "--min-len", "16", "--max-len", "256",
                    "--skip-hf"],
        "serving": serving,
        "simulated": ["client/bench_serving.py", "--model-repository", str(args.model_repository or ""), "--together",
                      "--rounds", str(args.serving_rounds), "--concurrency", "64", "--output-len", "128",
                      "--simulated-device-ms", str(args.simulated_device_ms)],
    }


def parse(benchmark: str, text: str) -> dict[str, float]:
    if benchmark == "host":
        return {f"host overhead {mode} {n} seqs (us)": float(us) for mode, n, us in HOST.findall(text)}
    if benchmark == "offline":
        return {"offline tok/s": float(value) for value in OFFLINE.findall(text)[-1:]}
    if benchmark == "simulated":
        return {f"{side} / device-bound": float(value) for side, value in DEVICE_SHARE.findall(text)}
    return {"served / in-process": float(value) for value in SERVING.findall(text)[-1:]}


def cpu_ticks() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return fields[7], sum(fields)


def run(checkout: Path, benchmark: str, argv: list[str], timeout: float) -> tuple[dict[str, float], str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}
    steal0, total0 = cpu_ticks()
    load0 = os.getloadavg()[0]
    proc = subprocess.run([str(checkout / ".venv/bin/python"), *argv], cwd=checkout, env=env, text=True,
                          capture_output=True, timeout=timeout)
    steal1, total1 = cpu_ticks()
    figures = parse(benchmark, proc.stdout)
    if proc.returncode or not figures:
        sys.exit(f"{checkout}: {' '.join(argv)} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}"
                 f"{proc.stderr[-3000:]}")
    steal = (steal1 - steal0) / max(total1 - total0, 1)
    return figures, f"load {load0:.1f}-{os.getloadavg()[0]:.1f}, steal {steal:.0%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path, help="checkout A (the baseline)")
    parser.add_argument("b", type=Path, help="checkout B")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--benchmarks", nargs="+", choices=["host", "offline", "serving", "simulated"],
                        default=["host", "offline"])
    parser.add_argument("--model-repository", type=Path, help="for serving: the served model's repository")
    parser.add_argument("--serving-rounds", type=int, default=4, help="bench_serving.py's own paired rounds per run")
    parser.add_argument("--simulated-device-ms", type=float, default=8.0, help="for simulated: ms per step")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    args = parser.parse_args()
    if {"serving", "simulated"} & set(args.benchmarks) and args.model_repository is None:
        parser.error("--benchmarks serving and simulated need --model-repository")
    results: dict[tuple[str, str], list[float]] = {}  # (figure, side) -> one value per round
    for round_ in range(args.rounds):
        order = [("A", args.a), ("B", args.b)] if round_ % 2 == 0 else [("B", args.b), ("A", args.a)]
        for benchmark in args.benchmarks:
            for side, checkout in order:
                started = time.monotonic()
                figures, conditions = run(checkout.resolve(), benchmark, commands(args)[benchmark], args.timeout)
                for figure, value in figures.items():
                    results.setdefault((figure, side), []).append(value)
                print(f"round {round_} {benchmark} {side}: {figures} ({conditions}, "
                      f"{time.monotonic() - started:.0f} s)", flush=True)
    print(f"\nA = {args.a}\nB = {args.b}\n{args.rounds} rounds, medians:")
    print("| figure | A | B | B / A |\n| --- | ---: | ---: | ---: |")
    for figure in dict.fromkeys(f for f, _ in results):
        a, b = statistics.median(results[figure, "A"]), statistics.median(results[figure, "B"])
        print(f"| {figure} | {a:.3g} | {b:.3g} | {b / a:.3f} |")


if __name__ == "__main__":
    main()
