"""Soak in CI (client/soak.py): 16 clients over every protocol and model, with cancelled streams, closed SSE
connections, SIGKILLed client processes and bad input, on KV pools small enough to preempt. Nothing hangs, no valid
request fails, repeated deterministic requests give one text, the engines go back to idle, and after the drain
`nanoserve serve` does on SIGTERM (serving/serve/drain.py) tritonserver unloads every model and exits with code 0."""
import pytest
from triton_server import running_server, tiny_repository

from client import soak

pytestmark = [pytest.mark.triton_server, pytest.mark.slow]
REQUESTS_PER_CLIENT = 9  # each client sends every kind of request once


def test_soak(qwen3_dir, tmp_path):
    repository = tiny_repository(tmp_path / "model_repository", qwen3_dir, soak.MODELS, **soak.ENGINE_ARGS)
    with running_server(repository, tmp_path, soak.MODELS, exit_timeout_secs=30) as server:
        report = soak.Soak(server, clients=16, deadline=240.0).run(requests_per_client=REQUESTS_PER_CLIENT)
        print(report.summary())
        assert report.failures() == []
        valid = sum(report.sent[kind] for kind in ("preempt", "grpc", "sse", "generate", "ensemble", "ensemble_sse"))
        assert report.completed == valid and report.rejected == report.sent["bad"]
        assert report.cancelled == sum(report.sent[kind] for kind in ("cancel", "close_sse", "kill_client"))
        assert max(len(texts) for texts in report.texts.values()) == 1 and len(report.texts) < valid  # repeats
        assert report.preemptions > 0
        assert server.drain(server.exit_timeout_secs) == []
        assert server.stop() == 0
