"""The GPU bench scripts on CPU: they refuse to run without CUDA, and every section's code runs end to end on
the tiny model (device "cpu", tiny sizes), so a GPU session does not find its bugs first."""
from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "client"))

import bench_gpu  # noqa: E402
import bench_kernels  # noqa: E402
from bench_offline import make_workload  # noqa: E402
from transformers import AutoConfig  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
@pytest.mark.parametrize("script", ["bench_gpu.py", "bench_kernels.py"])
def test_scripts_need_cuda(script):
    done = subprocess.run([sys.executable, os.path.join(REPO, "client", script)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert "needs a CUDA GPU" in done.stderr


def cpu_args(**overrides):
    args = bench_gpu.parse_args(["--num-seqs", "3", "--min-len", "4", "--max-len", "12", "--max-model-len", "64",
                                 "--hf-batch-size", "2", "--decode-batch", "3", "--decode-ctx", "16",
                                 "--iters", "2"])
    return types.SimpleNamespace(**{**vars(args), **overrides})


def test_offline_section_on_cpu(qwen3_dir):
    results = bench_gpu.run_offline(qwen3_dir, cpu_args(), "cpu")
    assert [r.label.split(",")[0].split(" (")[0] for r in results] == ["nanoserve", "nanoserve",
                                                                       "HF transformers generate"]
    expected_tokens = sum(make_workload(3, 4, 12, AutoConfig.from_pretrained(qwen3_dir).vocab_size, 0)[1])
    assert all(r.tokens == expected_tokens and r.seconds > 0 for r in results)  # ignore_eos: every token asked for
    table = bench_gpu.offline_table(results, cpu_args())
    assert "| nanoserve, CUDA graphs |" in table and "| engine | output tokens |" in table


def test_decode_section_on_cpu(qwen3_dir):
    r = bench_gpu.run_decode(qwen3_dir, cpu_args(), "cpu")
    assert r.batch == 3 and 12 <= r.mean_ctx <= 20
    # tiny qwen3: 2 layers x (k, v) x 2 kv heads x head_dim 16 x 4 bytes (float32 on CPU) per context token
    assert r.kv_bytes == round(r.mean_ctx * 3) * 2 * 2 * 2 * 16 * 4
    assert r.forward_graph_ms is None and r.step_graph_ms is None  # no graphs on CPU
    assert r.forward_eager_ms > 0 and r.step_eager_ms > 0 and r.logits_ms > 0
    table = bench_gpu.decode_table(r, copy_bps=bench_gpu.copy_bandwidth(torch.device("cpu"), 1 << 20, 2),
                                   peak_flops=bench_gpu.matmul_flops(torch.device("cpu"), 64, 2))
    assert "memory-bandwidth floor" in table and "not run (no graph for this batch)" in table


def test_kernels_table_against_copy_bandwidth():
    results = [bench_kernels.KernelResult("decode", ms=0.5, nbytes=10 ** 9),
               bench_kernels.KernelResult("gemm", ms=1.0, nbytes=10 ** 9, flops=10 ** 12)]
    table = bench_gpu.kernels_table(results, copy_bps=4e12)
    assert "| decode | 500.0 | 2000 | 50% | - |" in table  # 1 GB in 0.5 ms = 2 TB/s, half of 4 TB/s
    assert "| gemm | 1000.0 | 1000 | 25% | 1000 |" in table


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_read_counts_the_lm_head_once(tied):
    from nanoserve.models.qwen3 import Qwen3ForCausalLM
    from nanoserve.tiny_model import hf_config

    model = Qwen3ForCausalLM(hf_config("qwen3", 1000, tie_word_embeddings=tied), "torch")
    embedding = 1000 * 64 * 4
    every_param = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: counted once already
    assert bench_gpu.weight_bytes_read(model) == every_param - (0 if tied else embedding)


def test_bench_model_has_qwen3_0_6b_shape():
    """0.6B parameters of which 0.44B outside the (tied) embedding, as on the Qwen3-0.6B model card."""
    from transformers import AutoModelForCausalLM

    from nanoserve.tiny_model import hf_config

    config = hf_config("qwen3", bench_gpu.QWEN3_0_6B_VOCAB, **bench_gpu.QWEN3_0_6B)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    assert round(total / 1e9, 1) == 0.6 and round((total - embedding) / 1e9, 2) == 0.44
