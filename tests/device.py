"""Where the tests run: NANOSERVE_TEST_DEVICE=cpu (the default: Triton kernels in the interpreter, float32) or
cuda (compiled Triton kernels, the kernel tests in bfloat16 and float16, the engine tests on the GPU), and
NANOSERVE_TEST_ENGINE_ARGS, engine arguments ("KEY=VALUE,KEY=VALUE") every make_llm engine starts from, so that
one test selection runs under several engine configurations (scripts/gpu_check.sh: attention_backend=torch,
enforce_eager=true). Read by conftest.py before triton is imported."""
from __future__ import annotations

import os

import pytest

TEST_DEVICE = os.environ.get("NANOSERVE_TEST_DEVICE", "cpu")
if TEST_DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"NANOSERVE_TEST_DEVICE: must be 'cpu' or 'cuda', got {TEST_DEVICE!r}")
ON_CUDA = TEST_DEVICE == "cuda"

# The dtype names of the kernel tests: the interpreter computes in float32; a GPU runs both 16-bit types.
KERNEL_DTYPES = ("bfloat16", "float16") if ON_CUDA else ("float32",)

# On CUDA, a fixed small KV cache: the default (gpu_memory_utilization of the whole GPU) would leave nothing to the
# second of two engines a test holds at once.
DEVICE_ENGINE_ARGS = {"device": "cuda", "num_kvcache_blocks": 1024} if ON_CUDA else {"device": "cpu"}

cuda_only = pytest.mark.skipif(not ON_CUDA, reason="runs with NANOSERVE_TEST_DEVICE=cuda (scripts/gpu_check.sh)")


def parse_engine_args(text: str) -> dict[str, str]:
    """"KEY=VALUE,KEY=VALUE" -> {KEY: VALUE} (the engine coerces the strings to its fields' types)."""
    pairs = [item.strip() for item in text.split(",") if item.strip()]
    bad = [item for item in pairs if "=" not in item]
    if bad:
        raise ValueError(f"NANOSERVE_TEST_ENGINE_ARGS: expected KEY=VALUE items, got {bad}")
    return dict(item.split("=", 1) for item in pairs)


def engine_defaults() -> dict:
    """The engine arguments a test's engine starts from: the device's, then NANOSERVE_TEST_ENGINE_ARGS."""
    return {**DEVICE_ENGINE_ARGS, **parse_engine_args(os.environ.get("NANOSERVE_TEST_ENGINE_ARGS", ""))}
