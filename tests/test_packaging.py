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
    for folder in ("backend/nanoserve", "client", "model_repository"):
        (checkout / folder).mkdir(parents=True)
    (checkout / "README.md").write_text("# nanoserve\n")
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    package_file, model_spec = done.stdout.splitlines()
    assert Path(package_file).resolve() == Path(nanoserve.__file__).resolve()
    assert model_spec == "None", "the install exposes backend/model.py as a top-level module `model`"


IMPORT_BACKEND = """
import importlib.util, sys
sys.path.insert(0, sys.argv[1])  # triton_python_backend_utils, as the stub finds it
spec = importlib.util.spec_from_file_location("backend_model", sys.argv[2])
spec.loader.exec_module(importlib.util.module_from_spec(spec))
print(sorted(name for name in ("torch", "transformers") if name in sys.modules))
"""


def test_the_backend_file_imports_no_torch():
    """tritonserver first runs auto_complete_config in a stub process of its own, then starts the model's
    instances: importing backend/model.py loads no torch or transformers, so that first stub takes no seconds."""
    import pytriton

    utils_dir = Path(pytriton.__file__).parent / "tritonserver" / "backends" / "python"
    backend = Path(__file__).resolve().parents[1] / "backend" / "model.py"
    done = subprocess.run([sys.executable, "-c", IMPORT_BACKEND, str(utils_dir), str(backend)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_no_package_at_the_repository_root_shadows_an_installed_one():
    """Python run from the checkout (`python -m ...`, the image's build steps) puts the root on sys.path first: a
    package there would shadow an installed one of the same name (transformers 5.25 imports the Hub's `kernels`)."""
    from importlib.metadata import packages_distributions

    root = Path(__file__).resolve().parents[1]
    installed = packages_distributions()
    assert [folder.name for folder in root.iterdir()
            if (folder / "__init__.py").exists() and folder.name in installed] == []
    done = subprocess.run([sys.executable, "-c", "from transformers import LlamaConfig"], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
