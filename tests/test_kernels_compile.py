"""Compile every kernel for sm_90 (H100/H200) in bf16 without a GPU, and check ptxas reports no spills.

The interpreter accepts programs the GPU compiler rejects (tl.dot shapes, layouts, types), so CI compiles
the real thing ahead of time. This needs triton's NVIDIA backend and its bundled ptxas, nothing else; the
compile runs in a subprocess because conftest.py turns on TRITON_INTERPRET for this process.
Run `python tests/test_kernels_compile.py` to see registers / shared memory / spills per kernel.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import pytest

ARCH = 90


def _compile(fn, types: dict, constexprs: dict, num_warps=4, num_stages=2):
    """triton.compile for sm_90 with the launcher's usual specialization (pointers and strides 16-aligned)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
               if sig[n].startswith("*") or (n.startswith("stride") and n != "stride_bt")}
    src = ASTSource(fn, sig, constexprs=dict(constexprs), attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", ARCH, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _ptxas_report(kernel) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    try:
        res = subprocess.run([get_ptxas(ARCH).path, f"-arch=sm_{ARCH}a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    return " ".join(res.stdout.split() + res.stderr.split())


def _kernels():
    """(label, kernel fn, arg types, constexprs, num_warps, num_stages) at Qwen3-like shapes; the
    constexprs and warps follow what the launchers in kernels/ pick for those shapes."""
    from nanoserve.kernels import (activation, decode_attention, kv_store, prefill_attention, quant_matmul, rmsnorm,
                                   rotary)

    bf16, f32, i32, i64 = "*bf16", "*fp32", "*i32", "*i64"
    attn = dict(q_ptr=bf16, k_cache_ptr=bf16, v_cache_ptr=bf16, out_ptr=bf16, block_tables_ptr=i32,
                seq_lens_ptr=i32, qsl_ptr=i32, scale_log2="fp32", v_scale="fp32", part_m_ptr=f32, part_l_ptr=f32,
                part_acc_ptr=f32)
    fp8_attn = attn | dict(k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv")  # kv_cache_dtype="fp8"
    for group, splits, use_qsl, page in [(2, 1, True, 16), (8, 4, False, 256)]:
        yield (f"decode group={group} splits={splits} page={page}", decode_attention._decode_kernel, attn,
               dict(GROUP=group, GROUP_PAD=16, HEAD_DIM=128, DIM_PAD=128, BLOCK_SIZE=page,
                    TILE=decode_attention.TILE_N, NUM_SPLITS=splits, USE_QSL=use_qsl, PRECISION="tf32"), 4, 2)
    yield ("decode reduce", decode_attention._reduce_kernel, attn,
           dict(HEAD_DIM=128, DIM_PAD=128, NUM_SPLITS=4, SPLITS_PAD=4, USE_QSL=True), 4, 2)
    yield ("decode fp8 cache", decode_attention._decode_kernel, fp8_attn,
           dict(GROUP=2, GROUP_PAD=16, HEAD_DIM=128, DIM_PAD=128, BLOCK_SIZE=16, TILE=decode_attention.TILE_N,
                NUM_SPLITS=1, USE_QSL=True, PRECISION="tf32"), 4, 2)
    for head_dim, page, types in [(128, 16, attn), (64, 256, attn), (128, 16, fp8_attn)]:
        yield (f"prefill head_dim={head_dim} page={page}{' fp8 cache' if types is fp8_attn else ''}",
               prefill_attention._prefill_kernel, types,
               dict(GROUP=2, HEAD_DIM=head_dim, DIM_PAD=head_dim, BLOCK_SIZE=page, BLOCK_M=prefill_attention.BLOCK_M,
                    BLOCK_N=prefill_attention.BLOCK_N, PRECISION="tf32"), 4, 2)
    for cache in (bf16, "*fp8e4nv"):
        yield (f"store_kvcache {cache[1:]} cache", kv_store._store_kvcache_kernel,
               dict(k_ptr=bf16, v_ptr=bf16, k_cache_ptr=cache, v_cache_ptr=cache, slot_ptr=i64, inv_k_scale="fp32",
                    inv_v_scale="fp32"),
               dict(BLOCK_SIZE=16, NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_PAD=8, DIM_PAD=128, FP8=cache != bf16,
                    FP8_MAX=448.0), 4, 3)
    norm = dict(x_ptr=bf16, res_ptr=bf16, w_ptr=bf16, out_ptr=bf16, sum_ptr=bf16, eps="fp32")
    yield ("fused_add_rms_norm", rmsnorm._rms_norm_kernel, norm,
           dict(N=1024, BLOCK=1024, ROWS=2, ADD_RESIDUAL=True), 8, 3)
    yield ("rms_norm per head", rmsnorm._rms_norm_kernel, norm,
           dict(N=128, BLOCK=128, ROWS=16, ADD_RESIDUAL=False), 8, 3)
    rope = {n: bf16 for n in ("q_ptr", "k_ptr", "qo_ptr", "ko_ptr")} | dict(cos_ptr=f32, sin_ptr=f32)
    yield ("rotary", rotary._rotary_kernel, rope,
           dict(Q_HEADS=16, K_HEADS=8, Q_HEADS_PAD=16, K_HEADS_PAD=8, HALF=64, HALF_PAD=64), 4, 3)
    yield ("silu_and_mul", activation._silu_and_mul_kernel, dict(x_ptr=bf16, out_ptr=bf16),
           dict(N=3072, BLOCK=1024), 4, 3)
    blocks = dict(BLOCK_N=quant_matmul.BLOCK_N)
    for x_type, block_m in [(bf16, 16), (bf16, 64), (f32, 16), (f32, 32)]:  # decode and prefill rows
        act = dict(x_ptr=x_type, y_ptr=x_type)
        yield (f"int8_matmul {x_type[1:]} block_m={block_m}", quant_matmul._quant_matmul_kernel,
               act | dict(w_ptr="*i8", scale_ptr=bf16, offset_ptr=bf16),
               blocks | dict(FOUR_BIT=False, DOT_FP32=x_type == f32, BLOCK_M=block_m,
                             BLOCK_K=quant_matmul.BLOCK_K_FP32 if x_type == f32 else quant_matmul.BLOCK_K), 4, 2)
        yield (f"int4_group_matmul {x_type[1:]} block_m={block_m}", quant_matmul._quant_matmul_kernel,
               act | dict(w_ptr="*u8", scale_ptr=f32, offset_ptr=f32),
               blocks | dict(FOUR_BIT=True, DOT_FP32=x_type == f32, BLOCK_M=block_m, BLOCK_K=32), 4, 2)


def main() -> int:
    failed = False
    for label, fn, types, constexprs, warps, stages in _kernels():
        report = _ptxas_report(_compile(fn, types, constexprs, warps, stages))
        regs = re.search(r"Used (\d+) registers", report)
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
        failed |= any(spills)
        print(f"{label:36s} registers={regs.group(1) if regs else '?':>4s} spill_bytes={sum(spills)}", flush=True)
    return 1 if failed else 0


def test_kernels_compile_for_sm90_without_spills():
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.exit(main())
