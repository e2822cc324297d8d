"""The line that matters in a tritonserver log that ended before its models were ready: a model's load
error (without its Python frames), else the first error line that is not start-up noise."""
from __future__ import annotations

import re

LOAD_FAILURE = re.compile(r"failed to load '(?P<model>[^']+)' version \d+: (?P<message>.*)")
ERROR_LINE = re.compile(r'^E\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] "?(?P<message>.*?)"?$')
NOISE = ("CudaDriverHelper", "NVML", "DCGM", "Failed to initialize CUDA", "GPU metrics")
PREFIXES = ("Internal: ", "Invalid argument: ", "INVALID_ARG: ", "ERROR: ")


def failure(log: str) -> str | None:
    """One line saying why tritonserver did not come up, or None when the log does not tell."""
    for line in log.splitlines():
        found = LOAD_FAILURE.search(line)
        if found:
            return f"model '{found['model']}' did not load: {message(found['message'])}"
    for line in log.splitlines():
        found = ERROR_LINE.match(line)
        if found and not any(noise in line for noise in NOISE):
            return message(found["message"])
    last = [line for line in log.splitlines() if line.startswith("error: ")]
    return last[-1][len("error: "):] if last else None


def message(text: str) -> str:
    """The message without the Python traceback Triton appends ("\\n\\nAt:\\n  file(line): ...", escaped in
    the log) or quotes."""
    text = text.split("\\n")[0].split("\n")[0].rstrip('"').strip()
    for prefix in PREFIXES:
        text = text[len(prefix):] if text.startswith(prefix) else text
    return text
