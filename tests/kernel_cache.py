"""A cache directory of a test's own (where it converts GGUF files) that holds the CPU kernels the suite has already
built into its cache, so that the processes the test starts (tritonserver's stubs, tensor-parallel workers) load
them instead of compiling them again, about 15 s each."""
import os
from pathlib import Path

SUITE_CACHE = Path(os.environ["NANOSERVE_CACHE"])  # set by conftest.py before any test module is imported


def cache_with_kernels(path) -> str:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for built in SUITE_CACHE.glob("cpu_ops-*"):
        link = path / built.name
        if not link.exists():
            link.symlink_to(built, target_is_directory=True)
    return str(path)
