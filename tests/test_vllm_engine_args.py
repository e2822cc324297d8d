"""A vllm_backend model.json in nanoserve: vLLM's engine argument names renamed, ignored with a warning, or (a
name neither engine knows) refused; and vllm_backend's switch for the vllm:* metrics. The same model directory
through a real tritonserver: tests/test_vllm_backend_model.py."""
import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.config import VLLM_NAMES, EngineConfig
from nanoserve.serving.serve.preflight import ConfigError, check_model_json
from nanoserve.serving.shared.model_json import SERVING_ARGS, engine_args_of, load_engine_args, reports_vllm_metrics
from nanoserve.serving.shared.vllm_engine_args import OLDER_VLLM_ENGINE_ARGS, VLLM_ENGINE_ARGS

OWN = {field.name for field in EngineConfig.engine_args()}
# nanoserve's engine arguments that mean what vLLM's of the same name mean (docs/serving.md lists them)
SHARED = {"max_num_seqs", "max_num_batched_tokens", "max_model_len", "gpu_memory_utilization", "enable_prefix_caching",
          "enforce_eager", "tensor_parallel_size", "dtype", "seed", "tokenizer", "attention_backend",
          "async_scheduling"}
VLLM_ONLY = sorted((VLLM_ENGINE_ARGS | OLDER_VLLM_ENGINE_ARGS) - OWN - set(VLLM_NAMES) - set(SERVING_ARGS))


def test_the_offline_api_takes_vllms_names_too(qwen3_dir):
    config = EngineConfig.from_kwargs(str(qwen3_dir), block_size=32, num_gpu_blocks_override=64, device="cpu")
    assert (config.kvcache_block_size, config.num_kvcache_blocks) == (32, 64)
    with pytest.raises(ValueError, match="block_size: vLLM's name for kvcache_block_size"):
        EngineConfig.from_kwargs(str(qwen3_dir), block_size=32, kvcache_block_size=16)


def write_model_json(model_dir, args: dict):
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.json").write_text(json.dumps(args))
    return model_dir


def test_the_names_both_engines_share_are_vllms():
    assert SHARED <= OWN & VLLM_ENGINE_ARGS
    assert set(VLLM_NAMES) <= VLLM_ENGINE_ARGS and set(VLLM_NAMES.values()) <= OWN
    assert {"disable_log_requests", "swap_space", "lora_extra_vocab_size"} <= OLDER_VLLM_ENGINE_ARGS


def test_vllm_backends_sample_model_json_loads_with_a_warning(qwen3_dir, tmp_path, caplog):
    # vllm_backend's samples/model_repository/vllm_model/1/model.json, with our checkpoint
    model_dir = write_model_json(tmp_path / "vllm_model", {"model": qwen3_dir, "disable_log_requests": True,
                                                            "gpu_memory_utilization": 0.5, "enforce_eager": True})
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        args = load_engine_args(str(model_dir))
    assert args == {"model": qwen3_dir, "gpu_memory_utilization": 0.5, "enforce_eager": True}
    assert [r.getMessage() for r in caplog.records] == [
        "model.json: vLLM engine arguments that do not apply to nanoserve, ignored: disable_log_requests"]
    config = check_model_json(model_dir)  # what `nanoserve serve --model-repository` checks
    assert config.gpu_memory_utilization == 0.5 and config.enforce_eager


def test_vllms_names_for_nanoserves_arguments_are_renamed(caplog):
    vllm_json = {"model": "m", "block_size": 8, "num_gpu_blocks_override": 64, "max_num_seqs": "4",
                 "disable_log_stats": True}
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        args = engine_args_of(vllm_json)
    assert args == {"model": "m", "kvcache_block_size": 8, "num_kvcache_blocks": 64, "max_num_seqs": "4"}
    assert not caplog.records  # disable_log_stats applies: it switches the vllm:* metrics
    with pytest.raises(ValueError, match="block_size: vLLM's name for kvcache_block_size, which model.json"):
        engine_args_of({"model": "m", "block_size": 8, "kvcache_block_size": 16})


def test_a_name_neither_engine_knows_is_still_an_error(qwen3_dir, tmp_path):
    model_dir = write_model_json(tmp_path / "typo", {"model": qwen3_dir, "gpu_memory_utilisation": 0.5})
    with pytest.raises(ConfigError, match="unknown engine argument.*gpu_memory_utilisation"):
        check_model_json(model_dir)


@settings(max_examples=50, deadline=None)
@given(vllm_only=st.sets(st.sampled_from(VLLM_ONLY), max_size=6), own=st.sets(st.sampled_from(sorted(OWN))),
       renamed=st.sets(st.sampled_from(sorted(VLLM_NAMES))))
def test_every_vllm_name_is_renamed_kept_or_ignored(vllm_only, own, renamed):
    own -= {VLLM_NAMES[name] for name in renamed}  # giving both names is an error (above)
    model_json = {name: 1 for name in vllm_only | own | renamed}
    warnings = []
    handler = logging.Handler()
    handler.emit = warnings.append
    logger = logging.getLogger("nanoserve.serving.shared.model_json")
    logger.addHandler(handler)
    try:
        args = engine_args_of(model_json)
    finally:
        logger.removeHandler(handler)
    assert set(args) == own | {VLLM_NAMES[name] for name in renamed}
    ignored = warnings[0].getMessage().rsplit(": ", 1)[1].split(", ") if warnings else []
    assert ignored == sorted(vllm_only)


@pytest.mark.parametrize("parameter, model_json, on", [
    ("", {}, False),  # vllm_backend's default: off
    ("true", {}, True), ("TRUE", {"disable_log_stats": False}, True), ("false", {}, False), ("no", {}, False),
    ("yes", {}, True),  # nanoserve's one truth table (nanoserve/coercion.py); vllm_backend: only "true"
    ("true", {"disable_log_stats": True}, False), ("true", {"disable_log_stats": "true"}, False),
])
def test_report_custom_metrics_switches_the_vllm_metrics_as_in_vllm_backend(parameter, model_json, on):
    assert reports_vllm_metrics(parameter, model_json) is on


def test_a_relative_draft_path_is_taken_from_model_json_s_folder_or_the_current_directory(tmp_path, monkeypatch):
    """As `model` is: model.json's relative paths from its model's folder, a command line's from where it runs."""
    from nanoserve.serving.serve.launcher import make_model_repository
    from nanoserve.serving.shared.model_json import read_model_json

    model_dir = tmp_path / "repo" / "m"
    (model_dir / "1").mkdir(parents=True)
    spec = {"model": "drafts/small", "num_speculative_tokens": 3}
    (model_dir / "1" / "model.json").write_text(json.dumps({"model": "/ckpt", "speculative_config": spec}))
    assert read_model_json(str(model_dir), "1")["speculative_config"] == {
        "model": str(model_dir / "drafts" / "small"), "num_speculative_tokens": 3}
    template = tmp_path / "template"
    (template / "m" / "1").mkdir(parents=True)
    (template / "m" / "1" / "model.json").write_text(json.dumps({"model": "x"}))
    monkeypatch.chdir(tmp_path)
    make_model_repository(tmp_path / "out", "/ckpt", template=template, speculative_config=spec)
    written = json.loads((tmp_path / "out" / "m" / "1" / "model.json").read_text())
    assert written["speculative_config"]["model"] == str(tmp_path / "drafts" / "small")
