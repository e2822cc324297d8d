"""Triton-language kernels for nanoserve (installed as `nanoserve.kernels`).

`reference.py` holds the plain-torch version of every kernel: it is the CPU attention path and the
oracle that the kernel tests compare against. It must not import triton.
"""
