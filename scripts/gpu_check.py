"""The steps of scripts/gpu_check.sh (read its header first): each a command with a time bound, run in order,
each printing one summary line; the log and a JSON summary go into --out DIR.

Modes: cuda (a GPU is there: install, then every step for real), cpu (--device cpu: the same test steps on the CPU,
kernels in the interpreter, the benchmark's dry run; what the header's GPU estimate is scaled from) and dry (no GPU,
or --dry-run: print each step's command and count the tests its selection collects, so a renamed test or file
fails here rather than on the GPU).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS_LIST = REPO / "scripts" / "gpu_wheels.txt"
WHEEL_PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                   "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]
CARRY_LIMIT = 64 * 2 ** 20  # what one device call carries: the working tree and the wheels together
CPU_SLOWDOWN = 20  # --device cpu: the bounds are the GPU's times this (the interpreter is that much slower)

# (pytest files, -k selection) of each test step; the engine step runs once per ENGINE_CONFIGS entry
KERNEL_TESTS = (["tests/test_kernels_elementwise.py", "tests/test_kernels_attention.py", "tests/test_kernels_lora.py",
                 "tests/test_kernels_quant.py", "tests/test_kernels_compile.py"], None)
ENGINE_TESTS = (["tests/test_llm.py", "tests/test_model_runner.py", "tests/test_cuda_graph.py",
                 "tests/test_spec_decode_draft.py"],
                "greedy_matches_hf or independent_of_batch or cumulative_logprob or batched_prefill_then_decode "
                "or mixed_prefill_chunks or execute_samples or triton_kernels_match or graph_replay_pads "
                "or replay_matches_hf or eager_fallbacks or never_syncs or engine_graphs or verify_steps_replay "
                "or graphs_replay_the_drafts")
# every section of client/bench_gpu.py once, at small sizes (issue 33's run measures at full size)
SMOKE_ARGS = ["--budget-s", "60", "--decode-batches", "8", "--idle-batches", "8", "--idle-steps", "10", "--iters", "5",
              "--hf-subset", "4"]
ENGINE_CONFIGS = {"triton-graphs": "attention_backend=triton,enforce_eager=false",
                  "triton-eager": "attention_backend=triton,enforce_eager=true",
                  "torch-eager": "attention_backend=torch"}
FEATURE_TESTS = (["tests/test_llm.py", "tests/test_parallel_sampling.py", "tests/test_lora.py",
                  "tests/test_structured_outputs.py", "tests/test_async_scheduling.py"],
                 "chunked_prefill or preemption or prefix_cache or fully_cached or prefix_caching_off "
                 "or samples_differ or seeded_samples or greedy_samples or prompt_logprobs "
                 "or mixed_adapter_batch or swaps_adapters or structured_outputs_run or follow_their_schema "
                 "or greedy_constrained or grammar_in_step or n_samples or async_outputs")


@dataclass
class Step:
    name: str
    title: str
    timeout_s: int
    argv: list[str]
    env: dict = field(default_factory=dict)
    tests: tuple | None = None  # (files, -k) of a pytest step
    status: str = "not run"
    rc: int | None = None
    seconds: float = 0.0
    counts: dict = field(default_factory=dict)  # passed / failed / skipped / errors, or selected (dry)
    failures: list[str] = field(default_factory=list)


def pytest_step(name: str, title: str, timeout_s: int, tests: tuple, env: dict, junit: Path,
                workers: int = 0) -> Step:
    """workers > 0: that many pytest-xdist processes, where xdist is installed (Triton compiles each kernel
    specialization on first use, single-threaded: the kernel tests' hundred or so compile in parallel)."""
    files, selection = tests
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
            f"--timeout={timeout_s}", f"--junitxml={junit / (name + '.xml')}", *files]
    if workers and importlib.util.find_spec("xdist") is not None:
        argv += ["-n", str(workers)]
    return Step(name, title, timeout_s, argv + (["-k", selection] if selection else []), env, tests)


def make_steps(args, junit: Path) -> list[Step]:
    """Every step, in order; their timeouts add up to the 8 minutes the whole check may take on a GPU."""
    device = "cpu" if args.device == "cpu" else "cuda"
    bound = CPU_SLOWDOWN if device == "cpu" else 1
    env = {"NANOSERVE_TEST_DEVICE": device, "HF_HUB_OFFLINE": "1"}
    steps = [Step("install", "nanoserve and the wheels it needs, without its CPU-only pins", 40,
                  install_command(args.wheels))] if device == "cuda" else []
    steps.append(pytest_step("kernels", "Triton kernels in bf16 and fp16 against kernels/reference.py, compiled",
                             80 * bound, KERNEL_TESTS, env, junit, workers=8 if device == "cuda" else 0))
    for i, (config, engine_args) in enumerate(ENGINE_CONFIGS.items()):  # the first compiles the model's kernels
        steps.append(pytest_step(f"engine-{config}", f"the engine equal to HF greedy, {engine_args}",
                                 (70 if i == 0 else 50) * bound, ENGINE_TESTS,
                                 {**env, "NANOSERVE_TEST_ENGINE_ARGS": engine_args}, junit))
    steps.append(pytest_step("features", "prefix caching, chunked prefill, preemption, n, LoRA, structured "
                             "outputs, prompt logprobs, async scheduling", 90 * bound, FEATURE_TESTS, env, junit))
    bench = [sys.executable, "client/bench_gpu.py", "--out", str(Path(args.out) / "bench")]
    bench += SMOKE_ARGS if device == "cuda" else ["--dry-run"]
    steps.append(Step("bench", "a 60-second smoke of client/bench_gpu.py", 90 * bound, bench,
                      {"HF_HUB_OFFLINE": "1"}))
    return steps


def install_command(wheels: str) -> list[str]:
    """The wheels' packages where the machine lacks them (or holds too old a version), then nanoserve itself
    without its dependencies: its CPU-only pins (intel-openmp, the serve extra's numpy<2) stay out."""
    names = wheel_names()
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheels]
    return ["bash", "-c", f"{' '.join(pip)} {' '.join(names)} && {' '.join(pip)} --no-deps -e . && "
                          f"{sys.executable} -c 'import nanoserve, xgrammar, gguf, jsonschema'"]


def wheel_names() -> list[str]:
    lines = [line.split("#")[0].strip() for line in WHEELS_LIST.read_text().splitlines()]
    return [line.split("==")[0] for line in lines if line]


def download_wheels(dest: str) -> int:
    """pip download of scripts/gpu_wheels.txt for CPython 3.12 on manylinux x86_64; prints each size and the
    total against what one device call carries."""
    platforms = [arg for p in WHEEL_PLATFORMS for arg in ("--platform", p)]
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", dest,
                           "-r", str(WHEELS_LIST)])
    if done.returncode:
        return done.returncode
    wheels = sorted(Path(dest).glob("*.whl"))
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 1e6:8.2f} MB  {wheel.name}")
    total = sum(w.stat().st_size for w in wheels)
    print(f"{total / 1e6:8.2f} MB  in all ({total / CARRY_LIMIT:.0%} of the 64 MiB a device call carries)")
    return 0 if total < CARRY_LIMIT else 1


# ---- running ----
def run_step(step: Step, log) -> None:
    log.write(f"\n===== {step.name}: {' '.join(step.argv)}\n")
    log.flush()
    env = {**os.environ, **step.env}
    if step.env.get("NANOSERVE_TEST_DEVICE") == "cuda":
        env.pop("TRITON_INTERPRET", None)
    start = time.monotonic()
    proc = subprocess.Popen(step.argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        step.rc = proc.wait(timeout=step.timeout_s)
        step.status = "passed" if step.rc == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        step.rc, step.status = proc.wait(), "timed out"
    step.seconds = time.monotonic() - start


def read_junit(step: Step, junit: Path) -> None:
    path = junit / f"{step.name}.xml"
    if not path.exists():
        return
    cases = ElementTree.parse(path).getroot().iter("testcase")
    counts = dict(passed=0, failed=0, skipped=0, errors=0)
    for case in cases:
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        counts[{"failure": "failed", "error": "errors"}.get(kind, kind)] += 1
        if kind in ("failure", "error"):
            step.failures.append(f"{case.get('classname')}::{case.get('name')}")
    step.counts = counts


def collect(step: Step, cache: dict) -> None:
    """Dry mode: the number of tests the step's selection collects (0 fails the dry run)."""
    key = repr(step.tests)
    if key not in cache:
        argv = [a for a in step.argv if not a.startswith(("--junitxml", "--timeout"))] + ["--collect-only"]
        if "-n" in argv:  # xdist workers print no test ids
            del argv[argv.index("-n"):argv.index("-n") + 2]
        env = {**os.environ, **step.env}
        env.pop("TRITON_INTERPRET", None)
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        cache[key] = sum(1 for line in done.stdout.splitlines() if "::" in line)
    step.counts = {"selected": cache[key]}
    step.status = "dry" if cache[key] else "failed"


def summary_line(i: int, total: int, step: Step) -> str:
    counts = ", ".join(f"{v} {k}" for k, v in step.counts.items() if v or k in ("passed", "selected"))
    return (f"[{i}/{total}] {step.name}: {step.status} in {step.seconds:.0f} s (bound {step.timeout_s} s)"
            f"{'; ' + counts if counts else ''}; {step.title}")


def dry_line(step: Step) -> str:
    env = " ".join(f"{k}={v}" for k, v in step.env.items())
    return f"    would run (timeout {step.timeout_s} s): {env + ' ' if env else ''}{' '.join(step.argv)}"


# ---- summary ----
def versions() -> dict:
    import importlib.metadata as metadata

    found = {"python": sys.version.split()[0]}
    for name in ("torch", "triton", "transformers", "xgrammar"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def device_name(mode: str) -> str:
    if mode != "cuda":
        return "none (CPU only)" if mode == "dry" else "cpu"
    import torch

    return torch.cuda.get_device_name()


def write_summary(out: Path, mode: str, steps: list[Step], started: str, seconds: float) -> dict:
    failed = any(s.status not in ("passed", "dry") for s in steps)
    summary = {"status": "failed" if failed else "dry" if mode == "dry" else "passed", "mode": mode,
               "device": device_name(mode), "started": started, "seconds": round(seconds, 1),
               "versions": versions(), "steps": [step_json(s) for s in steps]}
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def step_json(step: Step) -> dict:
    data = asdict(step)
    data["command"] = data.pop("argv")
    data["seconds"] = round(step.seconds, 1)
    data.pop("tests")
    return data


def pick_mode(args) -> str:
    if args.dry_run:
        return "dry"
    if args.device == "cpu":
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "dry"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="nanoserve's GPU check (scripts/gpu_check.sh)")
    p.add_argument("--out", help="folder for gpu_check.log, gpu_check.json and bench/")
    p.add_argument("--dry-run", action="store_true", help="print the steps and check their test selections")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: run the same test steps on the CPU (the timing the header's estimate scales)")
    p.add_argument("--wheels", default=str(REPO / ".whl"), help="the wheels --download-wheels fetched")
    p.add_argument("--download-wheels", metavar="DIR", help="download scripts/gpu_wheels.txt into DIR and exit")
    args = p.parse_args(argv)
    if not args.download_wheels and not args.out:
        p.error("--out DIR is required")
    return args


def run_all(steps: list[Step], mode: str, log, junit: Path) -> None:
    cache: dict = {}
    for i, step in enumerate(steps, 1):
        if mode == "dry":
            print(dry_line(step), flush=True)
            if step.tests:
                collect(step, cache)
            else:
                step.status = "dry"
        else:
            run_step(step, log)
            read_junit(step, junit)
        print(summary_line(i, len(steps), step), flush=True)
        log.write(summary_line(i, len(steps), step) + "\n")
        if step.name == "install" and step.status not in ("passed", "dry"):
            break  # nothing after it can run


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.download_wheels:
        return download_wheels(args.download_wheels)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mode = pick_mode(args)
    started, start = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), time.monotonic()
    with tempfile.TemporaryDirectory() as junit, open(out / "gpu_check.log", "w") as log:
        steps = make_steps(args, Path(junit))
        print(f"gpu_check: mode {mode}, {len(steps)} steps, out {out}", flush=True)
        run_all(steps, mode, log, Path(junit))
    summary = write_summary(out, mode, steps, started, time.monotonic() - start)
    print(f"gpu_check: {summary['status']} in {summary['seconds']:.0f} s; {out / 'gpu_check.json'}")
    return 0 if summary["status"] in ("passed", "dry") else 1


if __name__ == "__main__":
    sys.exit(main())
