#!/usr/bin/env bash
# Builds docker/Dockerfile and streams a completion from the image, on a Linux machine with no Docker engine and
# no access to nvcr.io. The NGC base is stood in for by an image with its layout: Debian 12 (debootstrap) with
# the tritonserver 2.51 (NGC 24.10) binary, Python backend and stub that the nvidia-pytriton wheel in .venv ships,
# under /opt/tritonserver, and NGC's TRITON_SERVER_VERSION. buildah builds and runs it without a daemon.
#   apt-get install -y buildah debootstrap && bash scripts/setup.sh serve && bash docker/check_image.sh
# The build takes torch from TORCH_WHEEL (a CPU wheel for the base's Python 3.11) and the rest from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/nanoserve-image-check}
TORCH_WHEEL=${TORCH_WHEEL:-$(ls /opt/wheels/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -n 1)}
[ -n "$TORCH_WHEEL" ] || { echo "set TORCH_WHEEL to a CPU torch wheel for Python 3.11" >&2; exit 2; }
for port in 8000 8001 8002; do
  if (exec 3<> "/dev/tcp/127.0.0.1/$port") 2> /dev/null; then
    echo "port $port is in use: the image's tritonserver needs 8000-8002" >&2
    exit 2
  fi
done
BASE=nvcr.io/nvidia/tritonserver:25.10-py3  # the Dockerfile's default FROM, stood in for locally
buildah() { command buildah --storage-driver vfs "$@"; }
site=$(.venv/bin/python -c "import pytriton, pathlib; print(pathlib.Path(pytriton.__file__).parent.parent)")
mkdir -p "$WORK"

if [ ! -x "$WORK/rootfs/usr/bin/python3" ]; then
  debootstrap --variant=minbase --include=python3,python3-pip,libpython3.11,ca-certificates bookworm \
    "$WORK/rootfs" http://deb.debian.org/debian
fi
triton="$WORK/rootfs/opt/tritonserver"
mkdir -p "$triton/bin" "$triton/lib" "$triton/backends/python"
cp "$site/pytriton/tritonserver/bin/tritonserver" "$triton/bin/"
cp "$site/pytriton/tritonserver/backends/python/"{libtriton_python.so,triton_python_backend_utils.py} \
   "$site/pytriton/tritonserver/python_backend_stubs/3.11/triton_python_backend_stub" "$triton/backends/python/"
cp -a "$site/nvidia_pytriton.libs/." "$triton/lib/"
cat > "$WORK/Containerfile" <<'EOF'
FROM scratch
COPY rootfs/ /
ENV PATH=/opt/tritonserver/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LD_LIBRARY_PATH=/opt/tritonserver/lib TRITON_SERVER_VERSION=2.51.0 NVIDIA_TRITON_SERVER_VERSION=24.10
EOF
printf 'rootfs/dev\nrootfs/proc\nrootfs/sys\ncontext\n' > "$WORK/.containerignore"  # buildah makes its own
buildah bud --isolation chroot -f "$WORK/Containerfile" -t "$BASE" "$WORK"

# The build context: the work tree's files that git tracks or would track, without .venv, caches and models.
rm -rf "$WORK/context" && mkdir "$WORK/context"
git ls-files -co --exclude-standard -z | tar -c --null -T - -f - | tar -x -f - -C "$WORK/context"
buildah bud --isolation chroot -v "$TORCH_WHEEL:/tmp/$(basename "$TORCH_WHEEL"):ro" \
  -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro \
  --build-arg TORCH_SPEC="/tmp/$(basename "$TORCH_WHEEL")" --build-arg TORCH_INDEX_URL=https://pypi.org/simple \
  -f docker/Dockerfile -t nanoserve "$WORK/context"

# Run the image's CMD (chroot isolation shares this machine's network, hence the port check). Our two
# images are removed at exit: vfs storage keeps a full copy of each (~2 GB).
container=$(buildah from nanoserve)
read -r -a cmd <<< "$(buildah inspect --format '{{range .OCIv1.Config.Cmd}}{{.}} {{end}}' "$container")"
command buildah --storage-driver vfs run --isolation chroot "$container" -- "${cmd[@]}" \
  > "$WORK/tritonserver.log" 2>&1 &
run=$!
descendants() {
  local child
  for child in $(pgrep -P "$1"); do echo "$child"; descendants "$child"; done
}
cleanup() {
  # SIGTERM to tritonserver itself, which unloads the model and removes its shared memory; killing `buildah run`
  # would SIGKILL it.
  for pid in $(descendants "$run"); do
    [ "$(cat "/proc/$pid/comm" 2> /dev/null)" != tritonserver ] || kill -TERM "$pid"
  done
  wait "$run" || true
  buildah rm "$container" > /dev/null
  buildah rmi -f nanoserve "$BASE" > /dev/null
}
trap cleanup EXIT
for _ in $(seq "${READY_TIMEOUT_S:-600}"); do  # a busy machine (the test suite runs beside it) starts slowly
  curl -sf localhost:8000/v2/health/ready > /dev/null && break
  kill -0 "$run" 2> /dev/null || break  # the server exited
  sleep 1
done
curl -sf localhost:8000/v2/health/ready > /dev/null || { tail -n 30 "$WORK/tritonserver.log" >&2; exit 1; }
.venv/bin/python client/stream.py --prompt "Hello" --max-tokens 16 --temperature 0 --stats

# The reference: the same greedy completion from the offline engine inside the image.
offline=$(buildah run --isolation chroot "$container" -- python3 -c '
import json
from nanoserve import LLM, SamplingParams
with LLM("/opt/nanoserve/tiny-qwen3", device="cpu") as llm:
    print(json.dumps(llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))[0].text))')
OFFLINE="$offline" .venv/bin/python - <<'EOF'
import json, os
from client.stream import sampling_parameters, stream_grpc, stream_http
offline = json.loads(os.environ["OFFLINE"])
params = sampling_parameters(16, 0.0)
served = {"gRPC": stream_grpc("127.0.0.1:8001", "nanoserve", "Hello", params).text,
          "HTTP": stream_http("127.0.0.1:8000", "nanoserve", "Hello", params).text}
for protocol, text in served.items():
    assert text == offline, f"{protocol} streamed {text!r}, the offline engine gives {offline!r}"
print(f"image check: gRPC and HTTP streams equal the offline engine's greedy text {offline!r}")
EOF
