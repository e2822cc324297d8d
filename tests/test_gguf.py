"""GGUF files: dequantized weights with llama.cpp's q/k permutation undone, checked against the HF checkpoint a
small GGUF was written from (and against transformers' own GGUF loader); the tokenizer and chat template from the
metadata; the content-keyed cache; errors naming the file; and a trained model (SmolLM2-135M-Instruct, Q4_1)
whose greedy tokens equal transformers' on the same file."""
from __future__ import annotations

import json
import os
import shutil
import threading

import gguf
import numpy as np
import pytest
import torch
from gguf_files import write_gguf
from hf_reference import hf_greedy
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from kernel_cache import cache_with_kernels
from nanoserve import SamplingParams
from nanoserve.cache import build_once
from nanoserve.config import EngineConfig
from nanoserve.layers.quantization import GroupQuantized
from nanoserve.models.gguf import checkpoint_dir
from nanoserve.serving.shared.model_json import load_engine_args
from nanoserve.serving.stub.ensemble import engine_tokenizer

ARCHS = ("llama", "qwen2", "qwen3")
Q8_0 = gguf.GGMLQuantizationType.Q8_0
PROMPTS = ["The future of AI is", "def fibonacci(n):", "Paged attention keeps"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Tiny random checkpoints per architecture; the llama one without rope scaling (GGUF keeps no llama3 rope
    parameters)."""
    from nanoserve.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("hf")
    return {arch: build_tiny_model(str(root / arch), arch, seed=5, rope_scaling=None) for arch in ARCHS}


@pytest.fixture(scope="module")
def gguf_files(hf_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {arch: write_gguf(hf_dirs[arch], str(root / f"tiny-{arch}.gguf"), arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return cache_with_kernels(tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_gguf_gives_back_the_hf_weights(arch, hf_dirs, gguf_files, cache):
    converted = load_file(os.path.join(checkpoint_dir(gguf_files[arch], cache), "model.safetensors"))
    original = load_file(os.path.join(hf_dirs[arch], "model.safetensors"))
    assert converted.keys() == original.keys()
    for name, weights in original.items():
        np.testing.assert_array_equal(converted[name], weights, err_msg=name)


@pytest.mark.parametrize("qtype", [Q8_0, gguf.GGMLQuantizationType.Q4_1])
def test_quantized_rows_come_back_in_hf_order(qtype, hf_dirs, tmp_path):
    """Q8_0 and Q4_1 quantize each row on its own, so the codes, scales and offsets kept, with the row permutation
    undone, dequantize to exactly dequantize(quantize(W)) of the HF weights."""
    path = write_gguf(hf_dirs["llama"], str(tmp_path / "q.gguf"), "llama", qtype=qtype)
    converted = load_file(os.path.join(checkpoint_dir(path, str(tmp_path / "cache")), "model.safetensors"))
    for name, weights in load_file(os.path.join(hf_dirs["llama"], "model.safetensors")).items():
        if weights.ndim == 1:
            np.testing.assert_array_equal(converted[name], weights, err_msg=name)
            continue
        parts = (torch.from_numpy(converted[f"{name}.{part}"]) for part in ("codes", "scale", "offset"))
        expected = gguf.dequantize(gguf.quantize(weights, qtype), qtype)
        np.testing.assert_array_equal(GroupQuantized(*parts).dequantize().numpy(), expected, err_msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # transformers reads no head_dim from a qwen3 GGUF (uses 128)
def test_the_test_files_read_as_transformers_reads_llama_cpp_files(arch, hf_dirs, gguf_files):
    """transformers' GGUF loader (independent of ours) finds the HF weights in the files this test writes, so
    they are laid out (names, q/k permutation) as llama.cpp's converter lays them out."""
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_files[arch]),
                                                 gguf_file=os.path.basename(gguf_files[arch]), dtype=torch.float32)
    original = load_file(os.path.join(hf_dirs[arch], "model.safetensors"))
    for name, weights in original.items():
        np.testing.assert_array_equal(model.state_dict()[name].numpy(), weights, err_msg=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_transformers_on_the_source_checkpoint(arch, hf_dirs, gguf_files, cache, make_llm,
                                                                  monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE", cache)  # where LLM(...) converts the file
    llm = make_llm(gguf_files[arch], num_kvcache_blocks=64)
    assert llm.engine.config.model == checkpoint_dir(gguf_files[arch], cache)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(hf_dirs[arch])
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == hf_greedy(hf_dirs[arch], tokenizer.encode(prompt), 12), prompt


def test_model_json_and_the_ensemble_tokenizer_take_a_gguf_file(hf_dirs, gguf_files, cache, tmp_path, monkeypatch):
    """A Triton model's model.json names the file (relative to the model directory); the engine arguments and the
    pre/postprocessing models' tokenizer resolve it to the converted checkpoint."""
    monkeypatch.setenv("NANOSERVE_CACHE", cache)
    shutil.copy(gguf_files["qwen3"], tmp_path / "tiny.gguf")
    (tmp_path / "repo" / "nanoserve_tokens" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "nanoserve_tokens" / "1" / "model.json").write_text('{"model": "../../tiny.gguf"}')
    args = load_engine_args(str(tmp_path / "repo" / "nanoserve_tokens"))
    assert EngineConfig.from_kwargs(args.pop("model"), device="cpu", **args).model == checkpoint_dir(
        gguf_files["qwen3"], cache)
    tokenizer = engine_tokenizer({"model_config": json.dumps({"parameters": {}}),
                                  "model_repository": str(tmp_path / "repo" / "preprocessing")})
    assert tokenizer.encode("Hello, world!") == AutoTokenizer.from_pretrained(hf_dirs["qwen3"]).encode("Hello, world!")


def test_tokenizer_and_chat_template_come_from_the_metadata(hf_dirs, gguf_files, cache):
    original = AutoTokenizer.from_pretrained(hf_dirs["qwen3"])
    converted = AutoTokenizer.from_pretrained(checkpoint_dir(gguf_files["qwen3"], cache))
    for text in ["Hello, world!", "  spaces\tand\nlines", "naïve café 東京 🙂", "<|im_start|>user\nhi<|im_end|>"]:
        assert converted.encode(text) == original.encode(text), text
        assert converted.decode(converted.encode(text)) == text
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert (converted.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == original.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert converted.eos_token == "<|im_end|>"


def test_conversion_is_cached_by_content(gguf_files, tmp_path):
    cache = str(tmp_path / "cache")
    first = checkpoint_dir(gguf_files["qwen2"], cache)
    stamp = os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns
    copy = shutil.copy(gguf_files["qwen2"], tmp_path / "renamed-copy.gguf")
    assert checkpoint_dir(gguf_files["qwen2"], cache) == first == checkpoint_dir(copy, cache)
    assert os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns == stamp, "converted again"
    with open(copy, "ab") as f:
        f.write(b"\0" * 32)  # the same tensors, but other bytes: another key
    assert checkpoint_dir(copy, cache) != first


def test_concurrent_builders_build_once_and_a_failed_build_leaves_nothing(tmp_path):
    out, builds, waiting = tmp_path / "built", [], threading.Event()

    def build(folder):
        builds.append(folder)
        waiting.wait(60)  # until the second caller has started
        (folder / "done").write_text("yes")

    first = threading.Thread(target=build_once, args=(out, build))
    first.start()
    second = threading.Thread(target=lambda: (waiting.set(), build_once(out, build)))
    second.start()
    first.join(120), second.join(120)
    assert len(builds) == 1 and (out / "done").read_text() == "yes"

    def interrupted(folder):
        (folder / "half").write_text("")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_once(tmp_path / "other", interrupted)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["built"]


def test_errors_name_the_file(hf_dirs, tmp_path):
    cache = str(tmp_path / "cache")
    with pytest.raises(ValueError, match="model: .*missing.gguf: no such GGUF file"):
        EngineConfig(str(tmp_path / "missing.gguf"), device="cpu")
    (tmp_path / "garbage.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="garbage.gguf: not a readable GGUF file"):
        checkpoint_dir(str(tmp_path / "garbage.gguf"), cache)
    odd = write_gguf(hf_dirs["llama"], str(tmp_path / "rope-freqs.gguf"), "llama",
                     extra_tensors={"rope_freqs.weight": np.ones(8, dtype=np.float32)})
    with pytest.raises(ValueError, match="rope-freqs.gguf: tensor 'rope_freqs.weight' is not supported"):
        checkpoint_dir(odd, cache)
    untokenized = write_gguf(hf_dirs["qwen2"], str(tmp_path / "no-tokenizer.gguf"), "qwen2", tokenizer=False)
    with pytest.raises(ValueError, match="no-tokenizer.gguf: no tokenizer could be built from its metadata"):
        checkpoint_dir(untokenized, cache)
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(ValueError, match="gpt2.gguf: GGUF architecture 'gpt2' is not supported"):
        checkpoint_dir(str(tmp_path / "gpt2.gguf"), cache)
    assert all(p.name.endswith(".lock") for p in (tmp_path / "cache" / "gguf" / "v2").iterdir())


# ---- a trained model: SmolLM2-135M-Instruct, Q4_1 (downloaded once into the cache, as the demo does) ----------
@pytest.fixture(scope="module")
def smollm2():
    from nanoserve.demo_model import smollm2_gguf

    path = smollm2_gguf()
    return str(path), checkpoint_dir(str(path))


@pytest.mark.slow
def test_smollm2_greedy_tokens_equal_transformers_on_the_gguf(smollm2, make_llm):
    """The reference is transformers reading the same file (its own dequantization and permutation)."""
    gguf_path, converted = smollm2
    tokenizer = AutoTokenizer.from_pretrained(converted)
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                          add_generation_prompt=True)
            for question in ("What is the capital of France?", "Name a primary color.")]
    prompts = chat + ["The three primary colors are"]
    llm = make_llm(gguf_path, max_model_len=512, num_kvcache_blocks=64, quantization="none")  # float32, as HF
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        expected = hf_greedy(os.path.dirname(gguf_path), tokenizer.encode(prompt), 10,
                             gguf_file=os.path.basename(gguf_path))
        assert out.token_ids == expected, prompt
    assert outputs[0].text.startswith("The capital of France is Paris.")


def test_smollm2_chat_template_is_chatml(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(smollm2[1])
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.convert_ids_to_tokens(2) == tokenizer.eos_token == "<|im_end|>"
