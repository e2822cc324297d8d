"""`nanoserve serve`'s command line: flags generated from EngineConfig, help text and defaults on every option,
and a configuration mistake told in one line (exit code 2) before tritonserver starts; a model that fails to
load anyway is one line from tritonserver's log (exit code 1)."""
import argparse
import json
import shutil
import socket
import urllib.request
from pathlib import Path

import pytest

from client import stream
from nanoserve import cli
from nanoserve.config import EngineConfig
from nanoserve.serving.serve import launcher, preflight, triton_log
from nanoserve.serving.serve.engine_flags import flag, given_engine_args
from nanoserve.serving.shared.model_json import lora_modules, tokenizer_dir

from triton_server import nanoserve_serve

REPO = Path(__file__).resolve().parents[1]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_has_help_and_shows_its_default():
    for name, parser in subcommands().items():
        text = parser.format_help()
        for action in parser._actions:
            if action.dest == "help":
                continue
            assert action.help, f"{name} {action.option_strings}: no help text"
            if action.default not in (None, argparse.SUPPRESS):
                assert "(default" in parser._get_formatter()._get_help_string(action), (name, action.dest)
        assert "default: 8000" in text or name != "serve"


def test_engine_flags_are_every_engine_argument_with_its_default():
    serve = subcommands()["serve"]
    options = {option for action in serve._actions for option in action.option_strings}
    for field in EngineConfig.engine_args():
        assert flag(field.name) in options
        if field.default is not None:
            assert f"(default: {field.default})" in " ".join(serve.format_help().split())
    args = serve.parse_args(["ckpt", "--max-model-len", "512", "--no-enable-prefix-caching", "--dtype", "float32",
                             "--gpu-memory-utilization", "0.5"])
    assert given_engine_args(args) == {"max_model_len": 512, "enable_prefix_caching": False, "dtype": "float32",
                                       "gpu_memory_utilization": 0.5}  # only what was given, typed
    args = serve.parse_args(["ckpt", "--block-size", "32", "--num-gpu-blocks-override", "100"])  # vLLM's names
    assert given_engine_args(args) == {"kvcache_block_size": 32, "num_kvcache_blocks": 100}


@pytest.fixture
def no_tritonserver(monkeypatch):
    """These mistakes must be found before tritonserver starts."""
    def refuse(self):
        raise AssertionError("tritonserver was started")
    monkeypatch.setattr(launcher.TritonServer, "start", refuse)


def one_error_line(capsys, argv: list[str]) -> str:
    if "--http-port" not in argv:
        http, grpc, metrics = launcher.free_ports(3)
        argv = [*argv, "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                "--openai-port", "0"]
    try:
        code = cli.main(["serve", *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, (code, err)
    return err.strip()


def copy_checkpoint(src, dest: Path, without=()) -> Path:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(*without))
    return dest


def edit_json(path: Path, **changes) -> None:
    """Set the given keys (None: remove the key)."""
    edited = {**json.loads(path.read_text()), **changes}
    path.write_text(json.dumps({key: value for key, value in edited.items() if value is not None}))


@pytest.mark.parametrize("argv, expected", [
    (["{ckpt}", "--max-model-len", "4096"], "max_model_len: 4096 exceeds the model's max_position_embeddings"),
    (["{ckpt}", "--max-model-len", "many"], "max_model_len: expected an integer, got 'many'"),
    (["{ckpt}", "--device", "gpu"], "device: must be 'cpu', 'cuda' or 'cuda:N'"),
    (["{ckpt}", "--gpu-memory-utilization", "1.5"], "gpu_memory_utilization: must be in (0, 1]"),
    (["{ckpt}", "--speculative-config", '{{"method": "ngram", "prompt_lookup_min": 9}}'],
     "speculative_config.prompt_lookup_min: 9 exceeds prompt_lookup_max (5)"),
    (["{ckpt}", "--speculative-config", "{{ngram"], "speculative_config: expected a JSON object, got '{{ngram'"),
    (["{ckpt}", "--speculative-config", '{{"model": "{tmp}/missing"}}'],
     "speculative_config.model: '{tmp}/missing' is not a directory"),
    (["{tmp}/missing"], "model: {tmp}/missing does not exist"),
    (["{tmp}"], "{tmp}/config.json: not found"),
    (["{ckpt}", "--served-model-name", "a/b"], "--served-model-name: 'a/b'"),
    (["{ckpt}", "--liveness-timeout", "-1"], "--liveness-timeout: must be in [0, 86400] seconds, got -1"),
    (["{ckpt}", "--liveness-timeout", "nan"], "--liveness-timeout: must be in [0, 86400] seconds, got nan"),
    (["{ckpt}", "--exit-timeout-secs", "-1"], "--exit-timeout-secs: must be in [0, 3600] seconds, got -1"),
    (["{ckpt}", "--model-repository", "{tmp}"], "exclude each other"),
    ([], "MODEL: give a checkpoint directory"),
    (["{ckpt}", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["{ckpt}", "--lora-modules", "a={tmp}"], "--lora-modules: needs --enable-lora"),
    (["{ckpt}", "--enable-lora", "--lora-modules", "a"], "--lora-modules: expected NAME=PATH, got 'a'"),
    (["{ckpt}", "--enable-lora", "--lora-modules", "a={tmp}/missing"],
     "/1/multi_lora.json: a: {tmp}/missing: no adapter_config.json"),
])
def test_mistakes_are_one_line_before_tritonserver_starts(capsys, no_tritonserver, qwen3_dir, tmp_path, argv,
                                                          expected):
    fill = lambda text: text.format(ckpt=qwen3_dir, tmp=tmp_path)  # noqa: E731
    assert fill(expected) in one_error_line(capsys, [fill(a) for a in argv])


def test_checkpoint_mistakes_name_the_file(capsys, no_tritonserver, qwen3_dir, tmp_path):
    unsupported = copy_checkpoint(qwen3_dir, tmp_path / "gpt2")
    edit_json(unsupported / "config.json", architectures=["GPT2LMHeadModel"])
    assert f"{unsupported}/config.json: architecture 'GPT2LMHeadModel' is not supported" in \
        one_error_line(capsys, [str(unsupported)])
    no_tokenizer = copy_checkpoint(qwen3_dir, tmp_path / "no_tok", without=["tokenizer*", "chat_template*"])
    assert f"tokenizer: {no_tokenizer} holds no tokenizer" in one_error_line(capsys, [str(no_tokenizer)])
    no_weights = copy_checkpoint(qwen3_dir, tmp_path / "no_weights", without=["*.safetensors"])
    assert f"{no_weights}: no *.safetensors weights" in one_error_line(capsys, [str(no_weights)])


def test_ports_in_use_or_repeated_are_named(capsys, no_tritonserver, qwen3_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        http, metrics, openai = launcher.free_ports(3)
        argv = [str(qwen3_dir), "--http-port", str(http), "--grpc-port", str(port), "--metrics-port", str(metrics),
                "--openai-port", str(openai)]
        assert f"--grpc-port: 127.0.0.1:{port} is not available" in one_error_line(capsys, argv)
    argv = [str(qwen3_dir), "--http-port", str(http), "--grpc-port", str(http), "--metrics-port", str(metrics)]
    assert f"--grpc-port: port {http} is also --http-port" in one_error_line(capsys, argv)


def test_a_repository_whose_every_model_fails_is_one_line(capsys, no_tritonserver, qwen3_dir, tmp_path):
    """Before tritonserver starts: the first model's mistake, naming its file."""
    repo = launcher.make_model_repository(tmp_path / "repo", qwen3_dir, models=["nanoserve"], device="cpu")
    edit_json(repo / "nanoserve" / "1" / "model.json", max_model_len=4096)
    assert f"{repo}/nanoserve/1/model.json: max_model_len: 4096 exceeds" in \
        one_error_line(capsys, ["--model-repository", str(repo)])
    edit_json(repo / "nanoserve" / "1" / "model.json", max_model_len=1024, max_num_seq=3)
    assert "unknown engine argument(s): max_num_seq" in one_error_line(capsys, ["--model-repository", str(repo)])
    (repo / "nanoserve" / "config.pbtxt").write_text('backend: nanoserve\n')  # not protobuf text: no quotes
    assert f"{repo}/nanoserve/config.pbtxt:" in one_error_line(capsys, ["--model-repository", str(repo)])
    assert "holds no model" in one_error_line(capsys, ["--model-repository", str(tmp_path / "repo" / "nanoserve")])


def test_the_preflight_names_each_model_of_a_repository_that_cannot_load(qwen3_dir, tmp_path):
    # the repository as shipped points at ../../tiny-qwen3, which a fresh clone does not have
    shipped = tmp_path / "shipped"
    shutil.copytree(REPO / "model_repository", shipped)
    failing = preflight.check_repository(shipped)
    assert sorted(failing) == ["nanoserve", "nanoserve_tokens"]  # the others do not read a checkpoint
    for name, reason in failing.items():
        assert reason.startswith(f"{shipped}/{name}/1/model.json: model: ")
        assert f"{tmp_path}/tiny-qwen3 does not exist" in reason
    repo = launcher.make_model_repository(tmp_path / "repo", qwen3_dir, device="cpu")
    assert preflight.check_repository(repo) == {}
    shutil.rmtree(repo / "nanoserve_tokens")
    failing = preflight.check_repository(repo)
    assert failing["postprocessing"] == (f"{repo}/postprocessing/config.pbtxt: engine_model 'nanoserve_tokens' is "
                                         f"not a model in {repo}")
    (repo / "ensemble" / "config.pbtxt").write_text("platform: ensemble\n")  # not protobuf text: no quotes
    assert preflight.check_repository(repo)["ensemble"].startswith(f"{repo}/ensemble/config.pbtxt:")


def test_multi_lora_json_mistakes_name_the_file(capsys, no_tritonserver, qwen3_dir, lora_adapters, tmp_path):
    repo = launcher.make_model_repository(tmp_path / "repo", qwen3_dir, models=["nanoserve"], device="cpu")
    multi_lora = repo / "nanoserve" / "1" / "multi_lora.json"
    multi_lora.write_text("{not json")
    assert lora_modules(str(repo / "nanoserve")) == {}  # read only with enable_lora, as vllm_backend does
    edit_json(repo / "nanoserve" / "1" / "model.json", enable_lora=True, max_lora_rank=4)
    assert f"multi_lora.json: invalid JSON in {multi_lora}" in one_error_line(capsys, ["--model-repository", str(repo)])
    multi_lora.write_text(json.dumps({"wide": lora_adapters["qwen3"]["wide"]}))
    assert f"{multi_lora}: wide: max_lora_rank: the adapter's rank r=8 exceeds max_lora_rank (4)" in \
        one_error_line(capsys, ["--model-repository", str(repo)])
    multi_lora.write_text(json.dumps({"wide": "../../../wide"}))  # relative to multi_lora.json's folder
    assert lora_modules(str(repo / "nanoserve")) == {"wide": str(tmp_path / "wide")}


def test_pre_and_postprocessing_name_model_json_when_the_checkpoint_is_missing(tmp_path):
    """Not transformers' "Repo id must be in the form ..." for a path that does not exist."""
    shutil.copytree(REPO / "model_repository" / "nanoserve_tokens", tmp_path / "repo" / "nanoserve_tokens")
    with pytest.raises(ValueError, match=r'model: .*tiny-qwen3 does not exist \(set "model" in .*model.json'):
        tokenizer_dir(str(tmp_path / "repo" / "nanoserve_tokens"))


@pytest.mark.triton_server
def test_a_model_that_fails_to_load_is_one_line_from_the_log(capsys, qwen3_dir, tmp_path):
    """What only the backend checks (here a config.pbtxt parameter) comes from tritonserver's log."""
    repo = launcher.make_model_repository(tmp_path / "repo", qwen3_dir, models=["nanoserve"], device="cpu")
    config = repo / "nanoserve" / "config.pbtxt"
    config.write_text(config.read_text() + 'parameters { key: "send_budget" value: { string_value: "2" } }\n')
    http, grpc, metrics = launcher.free_ports(3)
    code = cli.main(["serve", "--model-repository", str(repo), "--http-port", str(http), "--grpc-port", str(grpc),
                     "--metrics-port", str(metrics), "--openai-port", "0", "--log-file", str(tmp_path / "log")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and lines[-1].startswith("nanoserve serve: error: model 'nanoserve' did not load: "), lines
    assert "send_budget: must be a number in (0, 1], got '2'" in lines[-1] and f"(log: {tmp_path}/log)" in lines[-1]
    assert not any(line.startswith("nanoserve: ready") for line in lines)


@pytest.mark.triton_server
def test_a_repository_model_that_cannot_load_leaves_the_others_served(qwen3_dir, tmp_path):
    """As tritonserver does (vllm_backend's CI has such a model): the others serve, Triton reports that one as
    failed to load, and the banner says why."""
    repo = launcher.make_model_repository(tmp_path / "repo", qwen3_dir, models=["nanoserve"], device="cpu",
                                          cpu_kvcache_space_gib=0.125)
    shutil.copytree(repo / "nanoserve", repo / "broken")
    edit_json(repo / "broken" / "1" / "model.json", invalid_attribute=True)
    with nanoserve_serve(None, tmp_path, "--model-repository", str(repo)) as served:
        banner = "".join(served.output)
        assert "nanoserve: ready: the repository's other models" in banner
        assert (f"failed to load  broken: {repo}/broken/1/model.json: unknown engine argument(s): invalid_attribute"
                in banner)
        with urllib.request.urlopen(f"http://{served.url_http}/v2/repository/index", data=b"{}") as response:
            index = {model["name"]: model for model in json.loads(response.read())}
        assert index["nanoserve"]["state"] == "READY" and index["broken"]["state"] == "UNAVAILABLE"
        assert "unknown engine argument(s): invalid_attribute" in index["broken"]["reason"]
        result = stream.stream_grpc(served.url_grpc, "nanoserve", "Hello", {"max_tokens": 4, "ignore_eos": True})
        assert result.num_output_tokens == 4 and result.finish_reason == "length"


LOAD_FAILURE_LOG = '''I1125 07:32:39.994 9881 server.cc:241] "started"
E1125 07:32:39.994595 9881 server.cc:241] "CudaDriverHelper has not been initialized."
E1125 07:32:44.517938 9881 model_lifecycle.cc:642] "failed to load 'nanoserve' version 1: Internal: ValueError: \
max_model_len: 4096 exceeds the model's max_position_embeddings (2048)\\n\\nAt:\\n  /x/config.py(83): _load"
| nanoserve | 1       | UNAVAILABLE: Internal: ValueError: max_model_len: 4096 exceeds ... |
error: creating server: Internal - failed to load all models
'''


def test_the_line_that_matters_in_a_tritonserver_log():
    assert triton_log.failure(LOAD_FAILURE_LOG) == ("model 'nanoserve' did not load: ValueError: max_model_len: 4096 "
                                                     "exceeds the model's max_position_embeddings (2048)")
    busy = ('E1125 07:32:44.5 9881 grpc_server.cc:2466] "Failed to start GRPC service: Unavailable - Socket '
            '\'127.0.0.1:8001\' already in use"\nerror: creating server: Internal - failed to start\n')
    assert triton_log.failure(busy) == ("Failed to start GRPC service: Unavailable - Socket '127.0.0.1:8001' "
                                        "already in use")
    assert triton_log.failure("error: creating server: Internal - x\n") == "creating server: Internal - x"
    assert triton_log.failure("I1125 fine\n") is None
