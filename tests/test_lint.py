"""The code checks CI runs with the suite: ruff, and the import contracts in pyproject.toml (layers, models and
kernels never import the engine or serving; imports point down; no cycles; serving's stub, serve and openai_api
sides import nothing of each other)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff():
    result = run(str(BIN / "ruff"), "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_contracts():
    result = run(str(BIN / "lint-imports"), "--no-cache")
    assert result.returncode == 0 and "0 broken" in result.stdout, result.stdout + result.stderr
