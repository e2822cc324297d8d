"""The tritonserver workarounds' registry (serving/workarounds.py) against the repository: every piece of code it
names exists, every test it names is collected, and every file that says it works around tritonserver 2.51 is
in it."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve.serving.workarounds import WORKAROUNDS

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = Path("backend/nanoserve/serving/workarounds.py")
MENTION = re.compile(r"\b(tritonserver|Triton|python_backend) 2\.51\b")


def defined_names(path: Path) -> set[str]:
    """A module's top-level classes, functions and assignments, and its classes' methods as Class.method."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            names.update(f"{node.name}.{item.name}" for item in node.body
                         if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
    return names


@pytest.mark.parametrize("name", sorted(WORKAROUNDS))
def test_each_workaround_names_its_version_and_code_that_exists(name):
    workaround = WORKAROUNDS[name]
    assert re.fullmatch(r"\d+\.\d+", workaround.tritonserver) and workaround.works_around and workaround.code
    for where in workaround.code:
        path, _, symbol = where.partition(":")
        assert (ROOT / path).is_file(), f"{name}: {path} does not exist"
        if symbol:
            assert symbol in defined_names(ROOT / path), f"{name}: {path} defines no {symbol}"


def test_each_named_test_is_collected():
    tests = sorted({workaround.test for workaround in WORKAROUNDS.values()})
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *tests],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    collected = result.stdout.splitlines()
    for test in tests:
        assert any(line == test or line.startswith(test + "[") for line in collected), f"{test}: not collected"


def test_every_file_that_works_around_tritonserver_2_51_is_listed():
    listed = {where.partition(":")[0] for workaround in WORKAROUNDS.values() for where in workaround.code}
    mentioning = {str(path.relative_to(ROOT)) for folder in ("backend", "model_repository", "client")
                  for path in (ROOT / folder).rglob("*.py") if MENTION.search(path.read_text())}
    assert mentioning - {str(REGISTRY)} <= listed, sorted(mentioning - {str(REGISTRY)} - listed)
