"""`nanoserve serve`: check the configuration, write a model repository for MODEL (or take --model-repository),
run tritonserver, and once its models are ready start the OpenAI-compatible API and print where everything is.

    nanoserve serve CHECKPOINT_DIR_OR_GGUF [--max-model-len N ...] [--served-model-name NAME] [--ensemble]
    nanoserve serve --model-repository DIR

A configuration mistake is one line on stderr and exit code 2, before tritonserver starts; a model that fails
to load is one line (its error, from tritonserver's log) and exit code 1. In a repository, as in tritonserver,
a model that fails to load leaves the others served: the banner names it and why (exit code 1 only when no model
loaded).
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from nanoserve.config import EngineConfig
from nanoserve.serving.serve import launcher, liveness, preflight, supervisor, triton_log
from nanoserve.serving.serve.engine_flags import add_engine_flags, given_engine_args
from nanoserve.serving.serve.preflight import ConfigError
from nanoserve.serving.shared.engine_model import MAX_DRAIN_SECONDS
from nanoserve.serving.shared.model_json import MULTI_LORA_JSON

ENSEMBLE_MODELS = ["nanoserve_tokens", "preprocessing", "postprocessing", "ensemble"]
DEFAULT_OPENAI_PORT = 9000


@dataclass
class Plan:
    """What to serve: a model repository, the models to wait for ([]: a repository's, whichever tritonserver
    loads), and what the banner says about them."""
    repository: Path
    models: list[str]
    description: str
    failing: dict[str, str] = field(default_factory=dict)  # a repository's models that cannot load, and why


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="a Hugging Face checkpoint directory or a .gguf file (or give --model-repository)")
    parser.add_argument("--model-repository", metavar="DIR", help="serve this Triton model repository as it is")
    parser.add_argument("--served-model-name", default="nanoserve", metavar="NAME",
                        help="the model's name in Triton and in the OpenAI API")
    parser.add_argument("--ensemble", action="store_true",
                        help="also serve the tokenizer -> engine -> detokenizer ensemble (a second engine)")
    parser.add_argument("--report-custom-metrics", action="store_true",
                        help="also publish the metrics under vLLM's names (vllm:*), as vllm_backend's "
                             "REPORT_CUSTOM_METRICS parameter does")
    parser.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                        help="LoRA adapters (PEFT directories) requests may pick by name (lora_name; the OpenAI "
                             "API's model); needs --enable-lora")
    parser.add_argument("--host", default="127.0.0.1", metavar="ADDRESS", help="address every port binds")
    parser.add_argument("--http-port", type=int, default=8000, metavar="PORT", help="Triton's HTTP/REST port")
    parser.add_argument("--grpc-port", type=int, default=8001, metavar="PORT", help="Triton's gRPC port")
    parser.add_argument("--metrics-port", type=int, default=8002, metavar="PORT",
                        help="Triton's Prometheus metrics port")
    parser.add_argument("--openai-port", type=int, default=DEFAULT_OPENAI_PORT, metavar="PORT",
                        help="the OpenAI-compatible API's port (0: no OpenAI API)")
    parser.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"),
                        help="how the OpenAI API reads tool calls out of the model's text for tool_choice \"auto\" "
                             "(hermes: <tool_call>{...}</tool_call>, as Qwen's templates ask; llama3_json: Llama 3's "
                             "JSON calls); without it, only \"required\" and named tool choices")
    parser.add_argument("--log-file", metavar="FILE", help="tritonserver's log ('-': this terminal) "
                                           "(default: tritonserver-HTTP_PORT.log in ~/.cache/nanoserve/serve, "
                                           "or in $NANOSERVE_CACHE/serve)")
    parser.add_argument("--log-verbose", type=int, default=0, metavar="LEVEL",
                        help="tritonserver's --log-verbose level")
    parser.add_argument("--exit-timeout-secs", type=int, default=10, metavar="SECONDS",
                        help="on SIGTERM, how long in-flight requests may take to finish before they are ended "
                             "(0-3600)")
    parser.add_argument("--liveness-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="restart tritonserver when a model gives no answer to a request within this many "
                             "seconds (asked every 5 s; 0: never)")
    parser.add_argument("--disable-auto-complete-config", action="store_true",
                        help="tritonserver's --disable-auto-complete-config")
    add_engine_flags(parser)


# Starts the OpenAI API on a thread of this process and returns it (.url, .stop()): given Triton's gRPC address,
# the model repository, the address and port to bind, Triton's metrics URL and the tool-call parser. The command
# line (nanoserve.cli) passes openai_api's, so that this side imports nothing of the API.
StartAPI = Callable[[str, Path, str, int, str, "str | None"], Any]


def run(args: argparse.Namespace, extra: list[str], start_api: StartAPI) -> int:
    with tempfile.TemporaryDirectory(prefix="nanoserve-serve-") as work_dir:
        try:
            plan = prepare(args, Path(work_dir))
        except ConfigError as e:
            print(f"nanoserve serve: error: {e}", file=sys.stderr)
            return 2
        return serve(args, plan, extra, start_api)


# ---- before tritonserver starts -------------------------------------------------------------------------
def prepare(args: argparse.Namespace, work_dir: Path) -> Plan:
    ports = {"--http-port": args.http_port, "--grpc-port": args.grpc_port, "--metrics-port": args.metrics_port}
    if args.openai_port:
        ports["--openai-port"] = args.openai_port
    preflight.check_ports(args.host, ports)
    if not 0 <= args.liveness_timeout <= 86400:
        raise ConfigError(f"--liveness-timeout: must be in [0, 86400] seconds, got {args.liveness_timeout:g}")
    if not 0 <= args.exit_timeout_secs <= MAX_DRAIN_SECONDS:  # the drain's too (serving/serve/drain.py)
        raise ConfigError(f"--exit-timeout-secs: must be in [0, {MAX_DRAIN_SECONDS:g}] seconds, "
                          f"got {args.exit_timeout_secs}")
    if args.model_repository:
        return _existing_repository(args)
    if not args.model:
        raise ConfigError("MODEL: give a checkpoint directory or a .gguf file, or --model-repository DIR")
    return _write_repository(args, work_dir / "model_repository")


def _existing_repository(args: argparse.Namespace) -> Plan:
    if args.model:
        raise ConfigError(f"MODEL: {args.model} and --model-repository exclude each other")
    given = [name for name, value in vars(args).items() if name in _engine_dests() and value is not None]
    if (given or args.ensemble or args.report_custom_metrics or args.lora_modules
            or args.served_model_name != "nanoserve"):
        raise ConfigError("--model-repository: engine arguments, --served-model-name, --ensemble, "
                          "--report-custom-metrics and --lora-modules are for MODEL; a repository sets them in its "
                          "model.json, multi_lora.json, config.pbtxt and folders")
    repository = Path(args.model_repository).resolve()
    failing = preflight.check_repository(repository)
    return Plan(repository, [], f"model repository {repository}", failing)


def _lora_modules(given: list[str] | None, config: EngineConfig) -> dict[str, str]:
    """--lora-modules NAME=PATH ... as multi_lora.json's object (absolute paths)."""
    if not given:
        return {}
    if not config.enable_lora:
        raise ConfigError("--lora-modules: needs --enable-lora")
    adapters = {}
    for item in given:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules: expected NAME=PATH, got {item!r}")
        adapters[name] = str(Path(path).expanduser().resolve())
    return adapters


def _engine_dests() -> set[str]:
    return {field.name for field in EngineConfig.engine_args()}


def _write_repository(args: argparse.Namespace, dest: Path) -> Plan:
    name = args.served_model_name
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name in ENSEMBLE_MODELS:
        raise ConfigError(f"--served-model-name: {name!r} must be letters, digits, '_', '.' or '-' and not one "
                          f"of the ensemble's models ({', '.join(ENSEMBLE_MODELS)})")
    checkpoint = preflight.resolve_checkpoint(args.model)
    try:
        engine_args = given_engine_args(args)
    except ValueError as e:
        raise ConfigError(preflight.one_line(e)) from None
    config = preflight.check_engine_args(checkpoint, engine_args)
    adapters = _lora_modules(args.lora_modules, config)
    extra_models = ENSEMBLE_MODELS if args.ensemble else []
    try:
        launcher.make_model_repository(dest, checkpoint, models=["nanoserve", *extra_models],
                                       rename={"nanoserve": name}, **engine_args)
    except FileNotFoundError as e:  # no model_repository/ template: not a source checkout
        raise ConfigError(preflight.one_line(e)) from None
    engine_models = [name, *(["nanoserve_tokens"] if args.ensemble else [])]
    if args.report_custom_metrics:
        for model in engine_models:
            with open(dest / model / "config.pbtxt", "a") as config_pbtxt:
                config_pbtxt.write('parameters { key: "REPORT_CUSTOM_METRICS" value: { string_value: "true" } }\n')
    if adapters:
        for model in engine_models:
            (dest / model / "1" / MULTI_LORA_JSON).write_text(json.dumps(adapters, indent=2) + "\n")
        preflight.check_lora_modules(dest / name, "1", config)
    return Plan(dest, [name, *(["ensemble"] if args.ensemble else [])], f"{args.model}")


# ---- tritonserver and the OpenAI API --------------------------------------------------------------------
def serve(args: argparse.Namespace, plan: Plan, extra: list[str], start_api: StartAPI) -> int:
    log_file = _log_file(args)
    if not plan.models:  # a repository: a model that fails to load must not stop the others (the user's flag wins)
        extra = ["--exit-on-error=false", *extra]
    server = launcher.TritonServer(plan.repository, args.http_port, args.grpc_port, args.metrics_port,
                                   host=args.host, log_verbose=args.log_verbose,
                                   exit_timeout_secs=args.exit_timeout_secs,
                                   disable_auto_complete_config=args.disable_auto_complete_config,
                                   extra_args=extra, log_file=log_file)
    with launcher.SignalWatcher() as signals:
        launcher.say(f"loading {plan.description} (tritonserver log: {log_file or 'below'})")
        server.start()
        if not _wait_ready(server, plan.models, signals.received):
            return _stopped(server, signals.received)
        failed = _load_failures(server, plan)
        if failed is None:  # none of the repository's models loaded
            return _stopped(server, signals.received)
        try:
            api = _start_openai_api(args, server, plan, start_api)
        except RuntimeError as e:
            server.stop()
            print(f"nanoserve serve: error: --openai-port: {e}", file=sys.stderr)
            return 1
        supervision = supervisor.Supervisor(server, plan.models or liveness.text_models(server.url_http),
                                            args.liveness_timeout)
        _banner(args, server, plan, api, log_file, failed)
        healthy = supervision.run(signals.received)
        if healthy and signals.received and server.poll() is None:
            _drain(server, args.exit_timeout_secs, signals.received)
        if api is not None:
            api.stop()
        if not healthy:  # stubs died too often: the orchestrator's turn
            server.stop(signal.SIGTERM, timeout=supervisor.RESTART_GRACE)
            return 1
        code = server.stop(signals.received[0] if signals.received else signal.SIGTERM)
    return launcher.exit_code(code, signals.received)


def _drain(server: launcher.TritonServer, seconds: float, received: list[int]) -> None:
    """Let the requests in flight finish (up to `seconds`) before tritonserver stops (serving/serve/drain.py)."""
    launcher.say(f"stopping: the requests in flight get up to {seconds:g} s to finish (again: stop now)")
    for failure in server.drain(seconds, received):
        launcher.say(f"drain: {failure}")


def _log_file(args: argparse.Namespace) -> Path | None:
    if args.log_file == "-":
        return None
    if args.log_file:
        return Path(args.log_file)
    return launcher.default_cache_dir() / "serve" / f"tritonserver-{args.http_port}.log"


def _wait_ready(server: launcher.TritonServer, models: list[str], received: list[int]) -> bool:
    """Until the models are ready, or for a repository ([]) until tritonserver has loaded what it loads at startup
    (True), or tritonserver exited or a signal came (False)."""
    while not received:
        if server.poll() is not None:
            return False
        if server.is_ready(models) if models else server.is_live():
            return True
        time.sleep(0.2)
    return False


def _load_failures(server: launcher.TritonServer, plan: Plan) -> dict[str, str] | None:
    """A repository's models that failed to load, and why (the preflight's reason where it found one); None when
    some failed and none loaded."""
    if plan.models:
        return {}
    states = server.model_states()
    failed = {name: plan.failing.get(name, reason) for name, (state, reason) in states.items()
              if state == "UNAVAILABLE"}
    if failed and not any(state == "READY" for state, _ in states.values()):
        return None
    return failed


def _stopped(server: launcher.TritonServer, received: list[int]) -> int:
    """Triton ended (or was stopped) before its models were ready: say why in one line."""
    code = server.stop(received[0] if received else signal.SIGTERM)
    if received:
        return launcher.exit_code(code, received)
    reason = triton_log.failure(server.log_tail(200_000)) if server.log_path else None
    where = f" (log: {server.log_path})" if server.log_path else ""
    print(f"nanoserve serve: error: {reason or f'tritonserver exited with code {code}'}{where}", file=sys.stderr)
    return 1


def _start_openai_api(args, server: launcher.TritonServer, plan: Plan, start_api: StartAPI):
    if not args.openai_port:
        return None
    return start_api(server.url_grpc, plan.repository, args.host, args.openai_port, server.url_metrics,
                     args.tool_call_parser)


def _banner(args, server: launcher.TritonServer, plan: Plan, api, log_file: Path | None,
            failed: dict[str, str]) -> None:
    models = ", ".join(plan.models) or ("the repository's other models" if failed else "every model in the repository")
    lines = [f"nanoserve: ready: {models} ({plan.description})"]
    lines += [f"  failed to load  {name}: {reason}" for name, reason in failed.items()]
    if api is not None:
        lines.append(f"  OpenAI API    {api.url}")
    lines += [f"  Triton HTTP   http://{server.url_http}    gRPC {server.url_grpc}",
              f"  metrics       {server.url_metrics}"]
    if log_file is not None:
        lines.append(f"  log           {log_file}")
    lines.append("Ctrl-C stops the server")
    print("\n".join(lines), file=sys.stderr, flush=True)
