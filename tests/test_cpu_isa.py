"""bf16 on every x86-64 CPU: the instruction set the C++ kernels are built for and the dtype oneDNN packs bf16
weights in follow what the CPU has, capped by torch's ATEN_CPU_CAPABILITY. The cap lets an AVX-512 machine run
what an AVX2-only one does: the last test reruns the kernel and layer tests so."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_reference import hf_logprobs

from nanoserve import SamplingParams
from nanoserve.kernels import cpu_ops
from nanoserve.layers import linear

AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}
AVX2 = {"avx2", "fma", "f16c"}


@pytest.mark.parametrize("cpu_flags, cap, isa, march", [
    (AVX512, "", "avx512", "-march=native"),
    (AVX512, "AVX512", "avx512", "-march=native"),
    (AVX512, "avx2", "avx2", "-march=x86-64-v3"),
    (AVX512, "default", "default", "-march=x86-64"),
    (AVX2, "", "avx2", "-march=native"),
    (AVX2, "avx512", "avx2", "-march=native"),  # a cap never adds what the CPU lacks
    ({"avx2", "fma"}, "", "default", "-march=native"),  # no F16C: at::vec's AVX2 bf16/fp16 conversions need it
    (set(), "", "default", "-march=native"),
])
def test_the_instruction_set_and_build_flags(monkeypatch, cpu_flags, cap, isa, march):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)
    assert cpu_ops.cpu_isa(frozenset(cpu_flags)) == isa
    flags = cpu_ops._build_flags(frozenset(cpu_flags))
    assert march in flags and f"-DCPU_CAPABILITY={isa.upper()}" in flags
    assert sum(flag.startswith("-march=") for flag in flags) == 1


def test_bf16_weights_pack_as_float32_below_avx512(monkeypatch):
    """oneDNN's bf16 matmul needs AVX-512 BW/VL/DQ (or AVX-NE-CONVERT): below that, the weight is packed as
    float32 and the activations are cast around the matmul, which still equals F.linear in bf16."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    weight, bias = torch.randn(24, 16).bfloat16(), torch.randn(24).bfloat16()
    packed = linear.pack_weight(weight)
    assert packed.dtype == torch.float32 and linear.packed_dtype(torch.float32) == torch.float32
    for rows in (1, 7, 600):
        x = torch.randn(rows, 16).bfloat16()
        out = linear.linear(x, weight, bias, packed)
        assert out.dtype == torch.bfloat16
        expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
        torch.testing.assert_close(out.double(), expected, atol=0.2, rtol=2e-2)


@pytest.mark.parametrize("cap", ["", "avx2"])
def test_a_bf16_engine_follows_hf(qwen3_dir, make_llm, monkeypatch, cap):
    """LLM(dtype="bfloat16") loads and runs on either path; each greedy token is the float32 reference's best
    or within bf16's rounding of it."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)
    llm = make_llm(qwen3_dir, dtype="bfloat16")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (3, 17)]
    for prompt, out in zip(prompts, llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8,
                                                                          ignore_eos=True), use_tqdm=False)):
        for token, reference in zip(out.token_ids, hf_logprobs(qwen3_dir, prompt, out.token_ids)):
            assert reference.max() - reference[token] < 0.15, (token, int(reference.argmax()))


@pytest.mark.slow
@pytest.mark.skipif(cpu_ops.cpu_isa() != "avx512", reason="this CPU runs the AVX2 path in the suite itself")
def test_the_avx2_path_passes_the_kernel_and_layer_tests():
    """The C++ kernels built for AVX2 (-march=x86-64-v3, 256-bit at::vec) and torch capped at AVX2 (its int8 and
    int4 weight kernels too) pass the same tests as this machine's own build."""
    tests = Path(__file__).parent
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                           str(tests / "test_cpu_ops.py"), str(tests / "test_layers.py"),
                           str(tests / "test_quantization.py"), "-k", "not tp2",  # sharding: no ISA of its own
                           f"{tests / 'test_cpu_isa.py'}::test_a_bf16_engine_follows_hf",
                           f"{tests / 'test_fp8_kv_cache.py'}::test_the_cpu_decode_kernel_reads_an_fp8_cache"],
                          env=env, capture_output=True, text=True, timeout=560)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
