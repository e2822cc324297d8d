"""nanoserve/openmp.py: `import nanoserve` before torch puts Intel OpenMP under torch, and only then."""
import os
import subprocess
import sys

import pytest

from nanoserve import openmp
from nanoserve.openmp import intel_openmp_path

PROBE = ("import {first}, {second}, torch\n"
         "a = torch.randn(300, 300, dtype=torch.float64)\n"
         "torch.set_num_threads(2)\n"
         "assert torch.allclose(torch.mm(a, a), (a[:, :, None] * a[None]).sum(1))\n"
         "assert abs(float(a.exp().sum()) - float(sum(a.exp().flatten().tolist()))) < 1e-6 * a.numel()\n"
         "print('libiomp5' in open('/proc/self/maps').read())")


def _loads_iomp(first: str, second: str, **env) -> bool:
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first, second=second)], capture_output=True,
                         text=True, check=True, env={**os.environ, **env})
    return out.stdout.strip() == "True"


@pytest.mark.skipif(intel_openmp_path() is None, reason="the intel-openmp package is not installed")
def test_intel_openmp_only_when_nanoserve_comes_first():
    assert _loads_iomp("nanoserve", "sys")  # and torch's parallel ops still compute right under it
    assert not _loads_iomp("nanoserve", "sys", NANOSERVE_INTEL_OPENMP="0")
    assert not _loads_iomp("torch", "nanoserve")  # torch already holds libgomp: never two runtimes


def test_registrations_of_processes_that_are_gone_are_removed(tmp_path, monkeypatch):
    """libiomp5's files in /dev/shm: a forked-and-exec'd or killed process leaves its own; the launcher removes
    them when a server stops."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    monkeypatch.setattr(openmp, "REGISTRATION_DIR", str(tmp_path))
    names = [f"__KMP_REGISTERED_LIB_{gone.pid}_0", f"__KMP_REGISTERED_LIB_{os.getpid()}_0", "__KMP_other", "x_1"]
    for name in names:
        (tmp_path / name).write_text("0x1-cafe-libiomp5.so")
    openmp.remove_stale_registrations()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])


BLOCKTIME_PROBE = ("import ctypes, nanoserve, torch\n"
                   "torch.randn(300, 300).exp().sum()\n"
                   "print(ctypes.CDLL(nanoserve.openmp.intel_openmp_path()).kmp_get_blocktime())")


@pytest.mark.skipif(intel_openmp_path() is None, reason="the intel-openmp package is not installed")
@pytest.mark.parametrize("given,expected", [(None, "5"), ("7", "7")])
def test_intel_openmp_threads_spin_briefly(given, expected):
    """5 ms of spinning after a parallel region (not Intel's 200 ms), unless KMP_BLOCKTIME says otherwise."""
    env = {k: v for k, v in os.environ.items() if k != "KMP_BLOCKTIME"}
    if given is not None:
        env["KMP_BLOCKTIME"] = given
    out = subprocess.run([sys.executable, "-c", BLOCKTIME_PROBE], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == expected
