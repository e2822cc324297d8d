"""docker/Dockerfile, built on a stand-in for the NGC base and served (docker/check_image.sh): needs buildah and
debootstrap, which .ci/run installs; skipped where they are missing.

The build takes minutes, most of them waiting on downloads and file copies, so when this test is collected the
check starts at once in the background (conftest.py), beside the rest of the suite, and the test runs last and
collects its result."""
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("buildah", "debootstrap")
WORK = Path("/tmp/nanoserve-image-check")  # the script's work directory: kept, so debootstrap runs once
TIMEOUT_S = 1800  # from the start of the check, which runs beside the rest of the suite
CAN_RUN = all(map(shutil.which, TOOLS)) and os.geteuid() == 0

_check: tuple[subprocess.Popen, object] | None = None  # the running check and the file its output goes to


def start_in_background() -> None:
    """Start docker/check_image.sh, once; its output goes to a temporary file."""
    global _check
    if _check is None and CAN_RUN:
        output = tempfile.TemporaryFile(mode="w+")
        process = subprocess.Popen(["bash", "docker/check_image.sh"], cwd=ROOT, env={**os.environ, "WORK": str(WORK)},
                                   stdout=output, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        _check = (process, output)


def stop_background() -> None:
    """End a check still running when the session ends early: SIGTERM lets the script remove its containers."""
    if _check is not None and _check[0].poll() is None:
        process = _check[0]
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.skipif(not CAN_RUN, reason="needs root with buildah and debootstrap (apt-get install buildah debootstrap)")
def test_the_image_streams_the_offline_engines_text():
    start_in_background()  # when run without conftest's start
    process, output = _check
    returncode = process.wait(timeout=TIMEOUT_S)
    output.seek(0)
    text = output.read()
    assert returncode == 0, text[-6000:]
    # the script asserts that both streams equal the offline engine's greedy text, run inside the image
    assert "image check: gRPC and HTTP streams equal the offline engine's greedy text" in text
    # stopped with SIGTERM, the image's tritonserver unloaded its model (and so removed its shared memory)
    log = (WORK / "tritonserver.log").read_text()
    assert "successfully unloaded 'nanoserve'" in log, log[-3000:]
