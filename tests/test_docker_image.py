"""docker/Dockerfile, built on a stand-in for the NGC base and served (docker/check_image.sh): needs buildah and
debootstrap, which .ci/run installs; skipped where they are missing."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("buildah", "debootstrap")
WORK = Path("/tmp/nanoserve-image-check")  # the script's work directory: kept, so debootstrap runs once


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(not all(map(shutil.which, TOOLS)) or os.geteuid() != 0,
                    reason="needs root with buildah and debootstrap (apt-get install buildah debootstrap)")
def test_the_image_streams_the_offline_engines_text():
    result = subprocess.run(["bash", "docker/check_image.sh"], cwd=ROOT, env={**os.environ, "WORK": str(WORK)},
                            capture_output=True, text=True, timeout=1100)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # the script asserts that both streams equal the offline engine's greedy text, run inside the image
    assert "image check: gRPC and HTTP streams equal the offline engine's greedy text" in result.stdout
    # stopped with SIGTERM, the image's tritonserver unloaded its model (and so removed its shared memory)
    log = (WORK / "tritonserver.log").read_text()
    assert "successfully unloaded 'nanoserve'" in log, log[-3000:]
