"""The cache directory (NANOSERVE_CACHE, default ~/.cache/nanoserve) and directories built in it once."""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def default_cache_dir() -> Path:
    return Path(os.environ.get("NANOSERVE_CACHE", Path.home() / ".cache" / "nanoserve"))


def build_once(out, build: Callable[[Path], None]) -> Path:
    """out, after build(tmp) has filled a temporary sibling that is then renamed to out, unless out exists.
    A lock file serializes concurrent callers (the second finds out done); an interrupted build leaves no out."""
    out = Path(out)
    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed, or when this process dies
        if out.is_dir():
            return out
        building = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            building.chmod(0o755)  # mkdtemp's 0700 would keep out private
            build(building)
            os.rename(building, out)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
    return out
