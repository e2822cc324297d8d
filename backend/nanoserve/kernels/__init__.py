"""nanoserve's kernels (installed as `nanoserve.kernels`): Triton-language kernels for CUDA (`ops.py` and the
modules it imports) and C++ ones for the CPU (`cpu_ops.cpp`, built on first use by `cpu_ops.py`).

`reference.py` holds the plain-torch version of every kernel: the oracle that the kernel tests compare against,
and the path where no kernel runs. It must not import triton.
"""
