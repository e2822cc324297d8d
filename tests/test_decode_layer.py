"""The one-op decoder layer of decode steps (layers/decode_layer.py) against the layers' modules on the same engine
(Llama, Qwen2's biases, Qwen3's q/k norms): the same kernels in the same order, so tokens and logprobs are equal
exactly; and which steps and layers it takes."""
from __future__ import annotations

import pytest

from nanoserve import SamplingParams
from nanoserve.kernels.cpu_ops import cpu_op
from nanoserve.layers.decode_layer import DecodeLayerOp
from nanoserve.tiny_model import build_tiny_model

pytestmark = pytest.mark.skipif(cpu_op("decode_layer") is None, reason="the CPU kernels are not built here")
PROMPTS = ["The future of AI is", "def fibonacci(n):", "Paged attention keeps its blocks", "Hello"]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k norms), each made at its first use."""
    root, made = tmp_path_factory.mktemp("decode-layer"), {}

    def model(arch: str) -> str:
        if arch not in made:
            extra = {"rope_scaling": None} if arch == "llama" else {}
            made[arch] = build_tiny_model(str(root / arch), arch, seed=5, initializer_range=0.1, **extra)
        return made[arch]
    return model


@pytest.fixture(scope="module")
def tiny_llama(tiny_models):
    return tiny_models("llama")


def decoder_layers(llm) -> list:
    return [m for m in llm.engine.executor.runner.model.modules() if hasattr(m, "decode_op")]


def greedy(llm) -> list[tuple[list[int], list[dict]]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    return [(out.outputs[0].token_ids, out.outputs[0].logprobs)
            for out in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("arch, quantization, dtype, kv_cache_dtype", [
    ("llama", "int8", "float32", "auto"), ("llama", "int4", "float32", "auto"), ("llama", "int4", "float32", "fp8"),
    ("llama", "int4", "bfloat16", "auto"), ("qwen3", "int4", "float32", "auto"), ("qwen2", "int8", "float32", "fp8")])
def test_decode_steps_as_one_op_equal_the_modules(tiny_models, arch, quantization, dtype, kv_cache_dtype, make_llm,
                                                  monkeypatch):
    llm = make_llm(tiny_models(arch), quantization=quantization, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                   num_kvcache_blocks=64, enable_prefix_caching=False)  # (a second run's cached prefix would differ)
    layers = decoder_layers(llm)
    assert layers and all(layer.decode_op is not None for layer in layers)
    calls = []
    op_call = DecodeLayerOp.__call__
    monkeypatch.setattr(DecodeLayerOp, "__call__", lambda self, *args: calls.append(1) or op_call(self, *args))
    fused = greedy(llm)
    assert len(calls) == len(layers) * 11  # every decode step (prefill steps take the modules' path)
    for layer in layers:
        layer.decode_op = None
    assert fused == greedy(llm)


def test_float_weights_keep_the_modules(tiny_llama, make_llm):
    """Float weights multiply in oneDNN (layers/linear.py), which the op does not call."""
    llm = make_llm(tiny_llama, quantization="none", num_kvcache_blocks=32)
    layers = decoder_layers(llm)
    assert layers and all(layer.decode_op is None for layer in layers)
    assert all(len(ids) == 12 for ids, _ in greedy(llm))


def test_a_lora_step_takes_the_modules(tiny_llama, tmp_path, make_llm):
    """A step with an adapter adds its deltas in the modules' linear layers, which the op does not have: the
    adapter's outputs are the same with the op as without it."""
    from lora_adapters import make_adapter

    adapter = make_adapter(tiny_llama, str(tmp_path / "adapter"), rank=8, seed=3)
    llm = make_llm(tiny_llama, quantization="int8", enable_lora=True, max_lora_rank=8, num_kvcache_blocks=64,
                   enable_prefix_caching=False)
    llm.add_lora("a", adapter)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1, lora_name="a")
    with_op = llm.generate(PROMPTS, params, use_tqdm=False)
    for layer in decoder_layers(llm):
        layer.decode_op = None
    without_op = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [out.outputs[0].logprobs for out in with_op] == [out.outputs[0].logprobs for out in without_op]
