"""scripts/gpu_check.sh in dry mode (what a machine without CUDA runs): the steps in order, each test step's
selection collecting tests, and the JSON summary's shape; and the wheel list's install names."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check  # noqa: E402

STEPS = ["install", "kernels", "engine-triton-graphs", "engine-triton-eager", "engine-torch-eager", "features",
         "bench"]
STEP_KEYS = {"name", "title", "timeout_s", "env", "status", "rc", "seconds", "counts", "failures", "command"}


@pytest.mark.slow
def test_dry_run_lists_every_step_in_order_and_writes_the_summary(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # python3: this one
    done = subprocess.run([str(REPO / "scripts" / "gpu_check.sh"), "--out", str(tmp_path), "--dry-run"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    summary_lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    assert [line.split("]")[1].split(":")[0].strip() for line in summary_lines] == STEPS
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["status"] == "dry" and summary["mode"] == "dry"
    assert {"device", "started", "seconds", "versions"} <= set(summary)
    assert [s["name"] for s in summary["steps"]] == STEPS
    for step in summary["steps"]:
        assert set(step) == STEP_KEYS and step["status"] == "dry"
        if step["env"].get("NANOSERVE_TEST_DEVICE") == "cuda":  # a pytest step: its selection finds tests
            assert step["counts"]["selected"] > 0, step
    kernels = next(s for s in summary["steps"] if s["name"] == "kernels")
    assert kernels["counts"]["selected"] >= 100  # bf16 and fp16 cases
    assert sum(s["timeout_s"] for s in summary["steps"]) <= 8 * 60
    assert (tmp_path / "gpu_check.log").exists()


def test_engine_steps_set_each_configuration():
    args = gpu_check.parse_args(["--out", "unused"])
    steps = {s.name: s for s in gpu_check.make_steps(args, Path("/tmp"))}
    assert steps["engine-torch-eager"].env["NANOSERVE_TEST_ENGINE_ARGS"] == "attention_backend=torch"
    assert "enforce_eager=false" in steps["engine-triton-graphs"].env["NANOSERVE_TEST_ENGINE_ARGS"]
    assert steps["bench"].argv[1:5] == ["client/bench_gpu.py", "--out", str(Path("unused") / "bench"),
                                        "--budget-s"]
    bench_args = steps["bench"].argv[2:]
    sys.path.insert(0, str(REPO / "client"))
    import bench_gpu

    assert bench_gpu.parse_args(bench_args).budget_s == 60  # the smoke's arguments are bench_gpu.py's
    cpu = {s.name for s in gpu_check.make_steps(gpu_check.parse_args(["--out", "x", "--device", "cpu"]), Path("/"))}
    assert "install" not in cpu and "kernels" in cpu


def test_wheel_list_names_what_nanoserve_needs_and_no_torch():
    names = gpu_check.wheel_names()
    assert {"xgrammar", "gguf", "jsonschema", "pydantic", "apache-tvm-ffi", "setuptools"} <= set(names)
    assert not {"torch", "triton", "transformers", "numpy"} & set(names)  # the machine's own builds stay
    lines = [line for line in gpu_check.WHEELS_LIST.read_text().splitlines() if line and not line.startswith("#")]
    assert all("==" in line for line in lines)  # pinned: what is downloaded is what was sized


def test_junit_counts_and_failure_ids(tmp_path):
    (tmp_path / "k.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_a" name="test_ok"/>'
        '<testcase classname="tests.test_a" name="test_bad"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_b" name="test_skip"><skipped/></testcase></testsuite></testsuites>')
    step = gpu_check.Step("k", "title", 1, [])
    gpu_check.read_junit(step, tmp_path)
    assert step.counts == {"passed": 1, "failed": 1, "skipped": 1, "errors": 0}
    assert step.failures == ["tests.test_a::test_bad"]
    assert "1 passed, 1 failed, 1 skipped" in gpu_check.summary_line(2, 7, step)


def test_a_step_past_its_bound_is_killed(tmp_path):
    step = gpu_check.Step("sleepy", "title", 1, [sys.executable, "-c", "import time; time.sleep(60)"])
    with open(tmp_path / "log", "w") as log:
        gpu_check.run_step(step, log)
    assert step.status == "timed out" and step.rc != 0
