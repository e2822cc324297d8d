#!/usr/bin/env bash
# Makes Perf Analyzer 2.51 and genai-perf 0.0.16 runnable on a CPU-only machine, under $NANOSERVE_PERF_TOOLS
# (default .cache/perf-tools, git-ignored). Idempotent; needs the serving venv (.venv, extras "serve") and PyPI.
#   bin/perf_analyzer  wrapper around the binary inside the tritonclient==2.51.0 wheel (the PyPI perf-analyzer
#                      2.60 needs glibc 2.38); its libb64.so.0d / libcudart.so.12 come from nvidia_pytriton.libs
#   bin/genai-perf     from its own venv: it needs numpy 2, the serving venv pins numpy<2
# Use: export PATH="$PWD/.cache/perf-tools/bin:$PATH" HF_HUB_OFFLINE=1   (genai-perf calls perf_analyzer)
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS=${NANOSERVE_PERF_TOOLS:-$PWD/.cache/perf-tools}
SERVE_PYTHON=${SERVE_PYTHON:-.venv/bin/python}
PYTHON=${PYTHON:-python3}
GENAI_PERF_SPEC=${GENAI_PERF_SPEC:-genai-perf==0.0.16}
mkdir -p "$TOOLS/bin" "$TOOLS/lib"

# --- perf_analyzer --------------------------------------------------------------------------------------
read -r real libs < <("$SERVE_PYTHON" - <<'EOF'
import glob, os, sys, sysconfig
import pytriton
real = os.path.join(sysconfig.get_path("scripts"), "perf_analyzer")  # the wheel's data/bin lands here
libs = os.path.join(os.path.dirname(os.path.dirname(pytriton.__file__)), "nvidia_pytriton.libs")
if not os.path.isfile(real):
    sys.exit(f"no perf_analyzer binary at {real}: pip install tritonclient==2.51.0 into the serving venv")
print(real, libs)
EOF
)
ln -sfn "$(ls "$libs"/libb64-*.so.0d | head -n 1)" "$TOOLS/lib/libb64.so.0d"
ln -sfn "$(ls "$libs"/libcudart-*.so.12* | head -n 1)" "$TOOLS/lib/libcudart.so.12"
cat > "$TOOLS/bin/perf_analyzer" <<EOF
#!/usr/bin/env bash
export LD_LIBRARY_PATH="$TOOLS/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$real" "\$@"
EOF
chmod +x "$TOOLS/bin/perf_analyzer"
if LD_LIBRARY_PATH="$TOOLS/lib" ldd "$real" | grep "not found"; then
  echo "perf_analyzer: shared libraries missing (above)" >&2; exit 1
fi

# --- genai-perf ------------------------------------------------------------------------------------------
venv="$TOOLS/genai-perf-venv"
if [ "$(cat "$venv/.installed" 2>/dev/null)" != "$GENAI_PERF_SPEC" ]; then
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "$GENAI_PERF_SPEC"
  echo "$GENAI_PERF_SPEC" > "$venv/.installed"
fi
ln -sfn "$venv/bin/genai-perf" "$TOOLS/bin/genai-perf"
echo "perf tools ready in $TOOLS/bin (perf_analyzer, genai-perf)"
