"""`import nanoserve` finds the installed package from any working directory, also from the folder that holds a
checkout named nanoserve (a folder without __init__.py that Python would take for a namespace package)."""
import subprocess
import sys
from pathlib import Path

import nanoserve

PROBE = """
import importlib.util, nanoserve
from nanoserve import LLM, SamplingParams
print(nanoserve.__file__)
print(importlib.util.find_spec("model"))
"""


def test_a_checkout_folder_named_nanoserve_does_not_shadow_the_package(tmp_path):
    checkout = tmp_path / "nanoserve"
    for folder in ("backend/nanoserve", "kernels", "client", "model_repository"):
        (checkout / folder).mkdir(parents=True)
    (checkout / "README.md").write_text("# nanoserve\n")
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    package_file, model_spec = done.stdout.splitlines()
    assert Path(package_file).resolve() == Path(nanoserve.__file__).resolve()
    assert model_spec == "None", "the install exposes backend/model.py as a top-level module `model`"
