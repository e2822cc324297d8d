"""The CPU kernels of cpu_ops.cpp as torch.ops.nanoserve_cpu: paged decode attention, the KV store, RMSNorm (with
the residual add), rotary embedding, SiLU-and-mul and the quantized linear layers, each one op where the plain-torch
reference takes 3 to 12; and decode_layer, a decode step's whole decoder layer (layers/decode_layer.py).

They are compiled for this machine's CPU on first use (torch.utils.cpp_extension with ninja and the system C++
compiler, ~10 s), once per source, torch and CPU, into NANOSERVE_CACHE (default ~/.cache/nanoserve). Where they
cannot be built, `cpu_op` returns None, after one warning, and the layers use the references.
NANOSERVE_CPU_KERNELS=0 turns them off. torch's ATEN_CPU_CAPABILITY (avx2, default) caps the instruction set they
are built for, as it caps torch's own kernels: an AVX-512 machine can build and test what an AVX2-only one runs.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

from nanoserve.cache import build_once, default_cache_dir

SOURCE = Path(__file__).resolve().with_name("cpu_ops.cpp")
# -ffast-math lets the compiler vectorize exp and reorder sums; -fno-finite-math-only keeps NaN and inf working.
# -fopenmp for at::parallel_for: the libgomp.so.1 it links is torch's own by that soname (and where nanoserve
# loaded Intel OpenMP first, the calls go there, as torch's do).
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]
logger = logging.getLogger(__name__)
_lock = threading.Lock()


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


ISAS = ("avx512", "avx2", "default")  # widest first
ISA_FLAGS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx2": {"avx2", "fma", "f16c"},
             "default": set()}
MARCH = {"avx512": "-march=x86-64-v4", "avx2": "-march=x86-64-v3", "default": "-march=x86-64"}


def cpu_isa(cpu_flags: set[str] | None = None, capped: bool = True) -> str:
    """The widest of ISAS that this CPU has and (if capped) torch's ATEN_CPU_CAPABILITY allows."""
    cpu_flags = _cpu_flags() if cpu_flags is None else cpu_flags
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").lower() if capped else ""
    allowed = ISAS[ISAS.index(cap):] if cap in ISAS else ISAS
    return next(isa for isa in allowed if ISA_FLAGS[isa] <= cpu_flags)


def int8_dot_products() -> bool:
    """Whether this CPU has AVX-512 VNNI's int8 dot products (which oneDNN's int8 GEMM needs to sum exactly, for
    cpu_ops.cpp's w8a8_linear) and ATEN_CPU_CAPABILITY does not cap the build below AVX-512."""
    return cpu_isa() == "avx512" and "avx512_vnni" in _cpu_flags()


def _build_flags(cpu_flags: set[str]) -> list[str]:
    """FLAGS for the instruction set cpu_isa picks (this CPU's own, -march=native, unless capped), with the matching
    vector width of ATen's Vectorized<float> (at::vec)."""
    isa = cpu_isa(cpu_flags)
    march = "-march=native" if isa == cpu_isa(cpu_flags, capped=False) else MARCH[isa]
    return [flag if flag != "-march=native" else march for flag in FLAGS] + \
        [f"-DCPU_CAPABILITY={isa.upper()}", f"-DCPU_CAPABILITY_{isa.upper()}"]


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the ninja wheel puts it beside the venv's python, which a process
    started by tritonserver may not have on its PATH."""
    if shutil.which("ninja") is None:
        try:
            import ninja
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass


def _build(out: Path, flags: list[str]) -> None:
    from torch.utils.cpp_extension import load

    _ninja_on_path()
    load(name="nanoserve_cpu", sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
         build_directory=str(out), is_python_module=False)


@functools.cache
def library():
    """torch.ops.nanoserve_cpu, built if needed, then loaded; None where disabled or not buildable."""
    if os.environ.get("NANOSERVE_CPU_KERNELS", "1") == "0":
        return None
    cpu_flags = _cpu_flags()
    flags = _build_flags(cpu_flags)
    key = hashlib.sha1("\n".join([SOURCE.read_text(), " ".join(flags), torch.__version__,
                                   " ".join(sorted(cpu_flags))]).encode()).hexdigest()[:16]
    try:
        with _lock:
            built = build_once(default_cache_dir() / f"cpu_ops-{key}", lambda out: _build(out, flags))
            torch.ops.load_library(str(built / "nanoserve_cpu.so"))  # once per process: dlopen knows the file
    except Exception as e:  # no compiler, no ninja, or a failed build: the references still work
        logger.warning("nanoserve's CPU kernels could not be built, so the CPU runs the slower plain-torch "
                       "references (needs a C++ compiler and ninja): %s", e)
        return None
    return torch.ops.nanoserve_cpu


def cpu_op(name: str):
    """torch.ops.nanoserve_cpu.<name>, or None when the CPU kernels are unavailable or have no such kernel."""
    ops = library()
    return None if ops is None else getattr(ops, name, None)
