"""Intel OpenMP (libiomp5, the `intel-openmp` package) as torch's OpenMP runtime on the CPU.

torch's CPU build calls OpenMP through GNU libgomp. With two threads on cores that other processes also use,
libgomp's barriers stall whenever one thread loses its time slice: a decode step gets 2-4x slower as soon as the
machine has any other load, where Intel's runtime (which vLLM-CPU preloads too) keeps most of its speed.
Loading libiomp5 with RTLD_GLOBAL before torch's libraries makes torch's GOMP_* and omp_* calls resolve to it,
as LD_PRELOAD would. `import nanoserve` does it; once torch is imported it is too late, and nothing is loaded.
NANOSERVE_INTEL_OPENMP=0 keeps libgomp.

Its threads spin for KMP_BLOCKTIME after a parallel region before they sleep, 200 ms by default. On a machine
whose cores other processes share, that spinning takes the cores from the thread still working and from the
processes it waits on: nanoserve sets 5 ms, as vLLM-CPU does (an explicit KMP_BLOCKTIME is kept).
"""
from __future__ import annotations

import ctypes
import os
import site
import sys

LIBRARY = "libiomp5.so"
BLOCKTIME_MS = "5"


def intel_openmp_path() -> str | None:
    """libiomp5.so as the intel-openmp wheel installs it (under the environment's or the user's lib/)."""
    for prefix in (sys.prefix, site.USER_BASE or ""):
        path = os.path.join(prefix, "lib", LIBRARY)
        if os.path.isfile(path):
            return path
    return None


def load_intel_openmp() -> str | None:
    """Load libiomp5 globally unless torch is already imported or NANOSERVE_INTEL_OPENMP=0; its path or None."""
    if os.environ.get("NANOSERVE_INTEL_OPENMP", "1") == "0" or "torch" in sys.modules:
        return None
    path = intel_openmp_path()
    if path is not None:
        os.environ.setdefault("KMP_BLOCKTIME", BLOCKTIME_MS)  # read once, when the runtime starts
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return path


REGISTRATION_DIR = "/dev/shm"
REGISTRATION_PREFIX = "__KMP_REGISTERED_LIB_"  # then the process id


def remove_stale_registrations() -> None:
    """libiomp5 registers every process it runs in, and every child forked from one (tritonserver started from
    here), with a file in /dev/shm that only a normal exit removes: exec'd or killed processes leave theirs.
    Remove those whose process is gone."""
    for name in os.listdir(REGISTRATION_DIR) if os.path.isdir(REGISTRATION_DIR) else []:
        pid = name[len(REGISTRATION_PREFIX):].split("_")[0] if name.startswith(REGISTRATION_PREFIX) else ""
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.unlink(os.path.join(REGISTRATION_DIR, name))
            except OSError:  # another process's cleanup got there first, or it is not ours to remove
                pass
