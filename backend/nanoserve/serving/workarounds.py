"""Every piece of nanoserve that exists only because of how a tritonserver release behaves, in one list.

Each entry names the tritonserver release (and its python_backend, released with it) that needs it, what it works
around, where the code is (repository paths; `path:Name` or `path:Class.method` when it is one part of a larger
file), and the test that fails without it. On a newer tritonserver, take the code out and run that test: if it
passes, the workaround can go, and its entry with it. tests/test_workarounds.py checks that every path and name
exists, that every test is collected, and that every file saying it works around tritonserver 2.51 is listed here.

This module is a record for maintainers: nothing imports it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workaround:
    tritonserver: str  # the release that needs it (nvidia-pytriton's tritonserver and python_backend)
    works_around: str
    code: tuple[str, ...]  # "path" or "path:Name", relative to the repository root
    test: str  # tests/FILE.py::test_name: fails once the code is taken out


WORKAROUNDS = {
    "shutdown-cuts-streams-silently": Workaround(
        "2.51",
        "On SIGTERM tritonserver drains HTTP for the exit timeout, then cuts whatever still streams without telling "
        "the model (no cancel, no finalize()): an SSE stream just stops. The stub watches the HTTP front end for the "
        "drain and ends its streams with UNAVAILABLE before the cut.",
        ("backend/nanoserve/serving/stub/shutdown.py",
         "backend/nanoserve/serving/stub/responses.py:ResponseThread._check_shutdown"),
        "tests/test_fault_tolerance.py::test_a_stream_cut_by_shutdown_ends_with_an_error_event"),
    "ensemble-never-released-at-stop": Workaround(
        "2.51",
        "Once tritonserver is stopping, its composing models take no new request, so an ensemble whose token stream "
        "still runs is never released and tritonserver exits at its exit timeout with code 1. `nanoserve serve` "
        "drains every engine model (the drain_seconds control) before it forwards the signal.",
        ("backend/nanoserve/serving/serve/drain.py", "backend/nanoserve/serving/stub/control.py:Drain",
         "backend/nanoserve/serving/serve/launcher.py:TritonServer.drain"),
        "tests/test_serve_stop.py::test_sigterm_lets_the_streams_end_then_exits_cleanly"),
    "ensemble-step-error-never-released": Workaround(
        "2.51",
        "The ensemble never releases a request one of whose steps failed while a postprocessing of an earlier "
        "response still ran. A token-model stream that already responded ends early with a final response "
        "(finish_reason \"abort\"), never an error; the postprocessing does the same for a cancelled stream.",
        ("backend/nanoserve/serving/stub/ensemble.py:ended_token_arrays",
         "backend/nanoserve/serving/stub/responses.py:Stream",
         "model_repository/postprocessing/1/model.py:TritonPythonModel"),
        "tests/test_serving_request.py::test_a_token_stream_that_responded_ends_early_with_abort_not_an_error"),
    "dead-stub-unnoticed": Workaround(
        "2.51",
        "tritonserver does not notice a Python backend stub that died (SIGKILL, the OOM killer, a crash) or hangs "
        "whole: the model stays ready, new requests fail, those in flight never end, and python_backend restarts "
        "no stub of a decoupled model. `nanoserve serve` restarts tritonserver.",
        ("backend/nanoserve/serving/serve/supervisor.py",),
        "tests/test_supervisor.py::test_a_killed_or_hung_stub_or_core_fails_its_streams_and_the_model_serves_again"),
    "tritonserver-crashes": Workaround(
        "2.51",
        "tritonserver itself crashes now and then: python_backend aborts (boost::interprocess::lock_exception) when "
        "a stub dies holding the lock of their shared memory, and the HTTP front end crashes (SIGSEGV) on a body of "
        "a few MB sent without Content-Type: application/json. `nanoserve serve` restarts a tritonserver that ends "
        "with an error or a signal.",
        ("backend/nanoserve/serving/serve/supervisor.py:Supervisor._crashed",),
        "tests/test_supervisor.py::test_a_killed_or_hung_stub_or_core_fails_its_streams_and_the_model_serves_again"),
    "grpc-frontend-deadlock": Workaround(
        "2.51",
        "Under many gRPC stream cancellations on a starved CPU the gRPC frontend can deadlock: the stub's response "
        "thread blocks in ResponseSender.send, the model answers nothing, and /v2/health/ready stays 200. "
        "`nanoserve serve` asks each text model a cheap question and restarts tritonserver when none comes.",
        ("backend/nanoserve/serving/serve/liveness.py", "backend/nanoserve/serving/serve/supervisor.py:Supervisor"),
        "tests/test_supervisor.py::test_a_model_that_stops_answering_is_restarted"),
    "custom-metrics-from-one-thread": Workaround(
        "2.51",
        "tritonserver crashes when custom metrics are updated from several threads at once: every metric call "
        "(and every send) happens on the response thread.",
        ("backend/nanoserve/serving/stub/metrics.py", "backend/nanoserve/serving/stub/responses.py:ResponseThread"),
        "tests/test_metrics.py::test_counters_and_histograms_match_the_traffic"),
    "metric-families-closed-in-finalize": Workaround(
        "2.51",
        "python_backend deletes a collected metric family through IPC to tritonserver; a family still alive when "
        "the stub tears the model down is collected after that IPC is gone, and the stub segfaults. finalize() "
        "closes the Metrics first.",
        ("backend/nanoserve/serving/stub/metrics.py:Metrics.close", "backend/model.py:TritonPythonModel.finalize"),
        "tests/test_serving_request.py::test_closed_metrics_hold_no_family_or_metric"),
    "self-unload-only-under-explicit-model-control": Workaround(
        "2.51",
        "python_backend crashes the stub of a model that unloads itself unless tritonserver runs with "
        "--model-control-mode=explicit: a failed engine unloads its model only then, and otherwise answers every "
        "request with UNAVAILABLE (which the supervisor sees).",
        ("backend/model.py:TritonPythonModel._unload_failed_model",
         "backend/nanoserve/serving/stub/shutdown.py:ServerArgs"),
        "tests/test_supervisor.py::test_a_killed_or_hung_stub_or_core_fails_its_streams_and_the_model_serves_again"),
    "killed-server-leaves-stubs-and-shm": Workaround(
        "2.51",
        "A tritonserver that is killed (a crash, or an exit timeout that passed) leaves its Python backend stubs "
        "orphaned and their shared-memory regions in /dev/shm. The launcher gives each server its own region "
        "prefix, kills its whole process group and removes the regions.",
        ("backend/nanoserve/serving/serve/launcher.py:TritonServer.command",
         "backend/nanoserve/serving/serve/launcher.py:TritonServer._kill_group",
         "backend/nanoserve/serving/serve/launcher.py:TritonServer._cleanup"),
        "tests/test_launcher.py::test_killed_server_leaves_no_stub_or_shm"),
    "late-grpc-cancel-blocks-unload": Workaround(
        "2.51",
        "A cancel that arrives after a gRPC stream's final response, before the server ended the stream, cancels "
        "the stream's first request again and waits for a response that never comes: the model never unloads "
        "(SIGTERM ends in the exit timeout). nanoserve's clients cancel only a request still running.",
        ("client/stream.py:stream_grpc", "client/soak.py:Soak._cancel"),
        "tests/test_soak.py::test_soak"),
}
