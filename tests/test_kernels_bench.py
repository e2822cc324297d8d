"""The GPU bench scripts on CPU: they refuse to run without CUDA, bench_gpu.py's dry run goes through every section
end to end on the tiny model (device "cpu", tiny sizes) so a GPU session does not find its bugs first, and its
floors, budget and targets against hand-computed values."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

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
def test_scripts_need_cuda(script, tmp_path):
    done = subprocess.run([sys.executable, os.path.join(REPO, "client", script), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "needs a CUDA GPU" in done.stderr


def cpu_args(*extra):
    return bench_gpu.parse_args(["--dry-run", "--out", "unused", *extra])


def test_dry_run_writes_every_section_to_the_json_summary(qwen3_dir, tmp_path, capsys):
    bench_gpu.main(["--dry-run", "--out", str(tmp_path), "--model", qwen3_dir])
    printed = json.loads(capsys.readouterr().out)
    summary = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert printed == summary and summary["dry_run"] and summary["device"] == "cpu"
    assert [d["batch"] for d in summary["decode"]] == [2, 4]
    assert [h["batch"] for h in summary["host_wait"]] == [2, 4]
    assert all(h["step_ms"] > 0 and h["gpu_idle_share"] is None for h in summary["host_wait"])  # no device
    workload = summary["workload"]
    assert workload["name"].startswith("nano-vllm's workload, shortened: 3 sequences")
    expected_tokens = sum(make_workload(3, 4, 12, AutoConfig.from_pretrained(qwen3_dir).vocab_size, 0)[1])
    assert workload["output_tokens"] == expected_tokens
    assert [r["engine"] for r in workload["runs"]] == ["nanoserve, CUDA graphs", "nanoserve, enforce_eager"]
    assert all(r["output_tokens"] == expected_tokens and 0 < r["vs_floor"] for r in workload["runs"])
    hf = workload["hf_subset"]["runs"]
    assert hf[0]["output_tokens"] == hf[1]["output_tokens"] > 0  # ignore_eos: the same tokens on both sides
    assert summary["served"] == {"skipped": "dry run: tritonserver is not launched"}
    assert set(summary["targets"]) == {"workload_vs_floor >= 0.70", "decode_step_256_over_floor <= 1.3",
                                       "gpu_idle_share_256 < 0.05"}
    assert "kernels" not in summary and summary["skipped"] == {}


def test_decode_section_on_cpu(qwen3_dir):
    r = bench_gpu.run_decode(qwen3_dir, cpu_args(), "cpu", 3)
    assert r.batch == 3 and 12 <= r.mean_ctx <= 20
    # tiny qwen3: 2 layers x (k, v) x 2 kv heads x head_dim 16 x 4 bytes (float32 on CPU) per context token
    assert r.kv_bytes == round(r.mean_ctx * 3) * 2 * 2 * 2 * 16 * 4
    assert r.forward_graph_ms is None and r.step_graph_ms is None  # no graphs on CPU
    assert r.forward_eager_ms > 0 and r.step_eager_ms > 0 and r.logits_ms > 0
    out = bench_gpu.decode_json(r, copy_bps=1e9, peak_flops=1e12)
    floor_ms = (r.weight_bytes + r.kv_bytes) / 1e9 * 1e3
    assert out["floor_ms"] == round(floor_ms, 4)
    assert out["step_eager_over_floor"] == round(r.step_eager_ms / floor_ms, 3)
    assert out["step_graph_over_floor"] is None


def test_kernels_against_copy_bandwidth():
    results = [bench_kernels.KernelResult("decode", ms=0.5, nbytes=10 ** 9),
               bench_kernels.KernelResult("gemm", ms=1.0, nbytes=10 ** 9, flops=10 ** 12)]
    decode, gemm = bench_gpu.kernels_json(results, copy_bps=4e12)
    assert decode == {"kernel": "decode", "us": 500.0, "gbps": 2000.0, "vs_copy_bandwidth": 0.5, "tflops": None}
    assert gemm["vs_copy_bandwidth"] == 0.25 and gemm["tflops"] == 1000.0  # 1 GB in 0.5 ms = 2 TB/s, half of 4


def test_workload_floor_reads_weights_and_running_kv_each_step():
    # steps 0, 1, 2: both sequences (10 + 20 tokens of KV), then the second alone (21, then 22)
    floor = bench_gpu.workload_floor_s([10, 20], [1, 3], weight_bytes=100, kv_per_token=2, copy_bps=1.0)
    assert floor == 3 * 100 + (30 + 21 + 22) * 2


@pytest.mark.parametrize("budget, shape", [(900, (256, 100, 1024)), (420, (256, 100, 477)), (60, (51, 17, 68))])
def test_workload_shortened_to_the_budget(budget, shape):
    assert bench_gpu.workload_shape(budget) == shape
    args = bench_gpu.parse_args(["--out", "x", "--budget-s", str(budget)])
    assert (args.num_seqs, args.min_len, args.max_len) == shape
    assert ("shortened" in bench_gpu.workload_name(args)) == (budget < 900)


def test_model_bytes_from_the_checkpoint(qwen3_dir):
    weights, kv_per_token = bench_gpu.model_bytes(qwen3_dir)
    config = AutoConfig.from_pretrained(qwen3_dir)
    stored = sum(os.path.getsize(f) for f in glob.glob(os.path.join(qwen3_dir, "*.safetensors")))
    assert weights == stored - config.vocab_size * 64 * 4  # the untied input embedding is not read whole
    assert kv_per_token == 2 * 2 * 2 * 16 * 4


def test_budget_skips_a_section_with_its_reason():
    budget = bench_gpu.Budget(10.0)
    assert budget.allows("decode", 5) and not budget.allows("workload", 60)
    assert list(budget.skipped) == ["workload"] and "60 s needed" in budget.skipped["workload"]


def test_targets_read_each_section():
    result = {"workload": {"runs": [{"vs_floor": 0.75}, {"vs_floor": 0.3}]},
              "decode": [{"batch": 64, "step_graph_over_floor": 2.0}, {"batch": 256, "step_graph_over_floor": 1.4}],
              "host_wait": [{"batch": 256, "gpu_idle_share": 0.02}]}
    assert bench_gpu.targets(result) == {"workload_vs_floor >= 0.70": True, "decode_step_256_over_floor <= 1.3": False,
                                         "gpu_idle_share_256 < 0.05": True}
    assert set(bench_gpu.targets({}).values()) == {None}


def test_merged_device_intervals():
    from bench_gpu_idle import IdleResult, merged_length

    assert merged_length([(5, 6), (0, 2), (1, 3), (5.5, 5.8)]) == 4
    assert IdleResult(8, step_ms=2.0, busy_ms=1.5).idle_share == 0.25
    assert IdleResult(8, step_ms=2.0, busy_ms=2.5).idle_share == 0.0  # profiled steps can run longer


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
