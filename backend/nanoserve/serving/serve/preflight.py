"""Checks `nanoserve serve` runs before it starts tritonserver: the engine arguments, the checkpoint, the model
repository and the ports. Each failure is a ConfigError whose one-line message names the field or the file.

Nothing here loads weights: EngineConfig reads config.json only, the tokenizer is loaded once to prove it loads.
"""
from __future__ import annotations

import json
import socket
from pathlib import Path

from google.protobuf import text_format
from transformers import AutoTokenizer
from tritonclient.grpc import model_config_pb2

from nanoserve.config import EngineConfig
from nanoserve.models import MODELS
from nanoserve.models.gguf import as_checkpoint_dir
from nanoserve.models.lora import check_peft_adapter
from nanoserve.serving.shared.model_json import MULTI_LORA_JSON, load_engine_args, lora_modules

EXPECTED_MODEL = "expected a Hugging Face checkpoint directory or a .gguf file"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class ConfigError(ValueError):
    """A mistake in the configuration, told in one line."""


def one_line(message: str) -> str:
    return " ".join(str(message).split())


def resolve_checkpoint(model: str) -> str:
    """A checkpoint directory for model: itself, or for a .gguf file the directory it is converted into (once)."""
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigError(f"model: {model} does not exist ({EXPECTED_MODEL})")
    if path.is_file() and path.suffix == ".gguf":
        try:
            return as_checkpoint_dir(str(path))
        except (ValueError, OSError) as e:
            raise ConfigError(f"model: {path}: {one_line(e)}") from None
    if not path.is_dir():
        raise ConfigError(f"model: {model} is not a directory ({EXPECTED_MODEL})")
    return str(path)


def check_engine_args(model: str, engine_args: dict) -> EngineConfig:
    """The engine's own validation (no weights loaded), then what only loading would find: config.json, a
    supported architecture, safetensors weights and a tokenizer that loads."""
    checkpoint = Path(model)
    if not (checkpoint / "config.json").is_file():
        raise ConfigError(f"{checkpoint / 'config.json'}: not found (a Hugging Face checkpoint directory holds "
                          "config.json, *.safetensors and a tokenizer)")
    try:
        config = EngineConfig.from_kwargs(model, **engine_args)
    except (ValueError, OSError) as e:
        raise ConfigError(one_line(e)) from None
    _check_architecture(checkpoint / "config.json")
    if not any(checkpoint.glob("*.safetensors")):
        raise ConfigError(f"{checkpoint}: no *.safetensors weights")
    check_tokenizer(Path(config.tokenizer))
    return config


def _check_architecture(config_json: Path) -> None:
    architectures = json.loads(config_json.read_text()).get("architectures") or [None]
    if architectures[0] not in MODELS:
        raise ConfigError(f"{config_json}: architecture {architectures[0]!r} is not supported "
                          f"(supported: {', '.join(sorted(MODELS))})")


def check_tokenizer(directory: Path) -> None:
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"tokenizer: {directory} holds no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    try:
        AutoTokenizer.from_pretrained(str(directory))
    except Exception as e:  # whatever transformers raises for a broken tokenizer
        raise ConfigError(f"tokenizer: {directory} does not load ({type(e).__name__}: {one_line(e)})") from None


def check_ports(host: str, ports: dict[str, int]) -> None:
    """ports: flag -> port. Each must be a port number, distinct, and free on host now."""
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if not 0 < port < 65536:
            raise ConfigError(f"{flag}: {port} is not a port number (1-65535)")
        if port in seen:
            raise ConfigError(f"{flag}: port {port} is also {seen[port]}")
        seen[port] = flag
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no obstacle
            try:
                probe.bind((host, port))
            except OSError as e:
                raise ConfigError(f"{flag}: {host}:{port} is not available ({e.strerror})") from None


# ---- a model repository -------------------------------------------------------------------------------
def read_model_config(model_dir: Path) -> model_config_pb2.ModelConfig:
    path = model_dir / "config.pbtxt"
    try:
        return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise ConfigError(f"{path}: {one_line(e)}") from None


def is_engine_model(config: model_config_pb2.ModelConfig) -> bool:
    return config.backend == "nanoserve"


def check_repository(repository: Path) -> dict[str, str]:
    """Every model's config.pbtxt parses; every nanoserve model's model.json holds valid engine arguments for a
    checkpoint that loads; every model naming an `engine_model` (the ensemble's pre/postprocessing) names one
    in the repository. Returns the models that fail, each with its one-line reason: tritonserver serves the others.
    ConfigError when the repository holds no model, or every model fails (the first one's reason)."""
    if not repository.is_dir():
        raise ConfigError(f"--model-repository: {repository} is not a directory")
    model_dirs = sorted(p for p in repository.iterdir() if (p / "config.pbtxt").is_file())
    if not model_dirs:
        raise ConfigError(f"--model-repository: {repository} holds no model (a folder with config.pbtxt)")
    failures = {}
    for model_dir in model_dirs:
        try:
            check_model(repository, model_dir)
        except ConfigError as e:
            failures[model_dir.name] = str(e)
    if len(failures) == len(model_dirs):
        raise ConfigError(next(iter(failures.values())))
    return failures


def check_model(repository: Path, model_dir: Path) -> None:
    """One model of the repository (see check_repository); ConfigError naming the file."""
    config = read_model_config(model_dir)
    if is_engine_model(config):
        for version_dir in _version_dirs(model_dir):
            check_model_json(model_dir, version_dir.name)
    engine_model = config.parameters["engine_model"].string_value if "engine_model" in config.parameters else ""
    if engine_model and not (repository / engine_model / "config.pbtxt").is_file():
        raise ConfigError(f"{model_dir / 'config.pbtxt'}: engine_model {engine_model!r} is not a model in "
                          f"{repository}")


def _version_dirs(model_dir: Path) -> list[Path]:
    return [p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()]


def check_model_json(model_dir: Path, version: str = "1") -> EngineConfig:
    model_json = model_dir / version / "model.json"
    try:
        args = load_engine_args(str(model_dir), version)
    except ValueError as e:
        raise ConfigError(one_line(e)) from None
    try:
        config = check_engine_args(resolve_checkpoint(args.pop("model")), args)
    except ConfigError as e:
        raise ConfigError(f"{model_json}: {e}") from None
    check_lora_modules(model_dir, version, config)
    return config


def check_lora_modules(model_dir: Path, version: str, config: EngineConfig) -> None:
    """Every adapter multi_lora.json names is a PEFT LoRA adapter the engine can run on its checkpoint."""
    try:
        adapters = lora_modules(str(model_dir), version)
    except ValueError as e:
        raise ConfigError(one_line(e)) from None
    for name, path in adapters.items():
        try:
            check_peft_adapter(path, config.model, config.max_lora_rank)
        except ValueError as e:
            raise ConfigError(f"{model_dir / version / MULTI_LORA_JSON}: {name}: {one_line(e)}") from None
