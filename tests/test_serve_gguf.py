"""`nanoserve serve FILE.gguf`: the file is converted once into the cache and served; a completion through the
OpenAI API equals the offline engine's greedy text on the same file, a float32 one and a Q4_0 one (served, as
offline, with its 4-bit codes by default: the server says so in its log)."""
import gguf
import openai
import pytest
from gguf_files import write_gguf
from triton_server import nanoserve_serve

from kernel_cache import cache_with_kernels
from nanoserve import LLM, SamplingParams

pytestmark = [pytest.mark.triton_server, pytest.mark.slow]
PROMPT = "Paged attention keeps"


# A quantized file: the default path; a float file loads as any checkpoint does (tests/test_gguf.py)
@pytest.mark.parametrize("qtype, weights", [(gguf.GGMLQuantizationType.Q4_0, "int8: 2, int4: 8")])
def test_serve_a_gguf_file_equals_the_offline_engine(qtype, weights, tmp_path, monkeypatch):
    from nanoserve.tiny_model import build_tiny_model

    # the server converts where LLM(...) does
    monkeypatch.setenv("NANOSERVE_CACHE", cache_with_kernels(tmp_path / "cache"))
    hf_dir = build_tiny_model(str(tmp_path / "hf"), "llama", seed=5, rope_scaling=None)
    model = write_gguf(hf_dir, str(tmp_path / "tiny-llama.gguf"), "llama", qtype=qtype)
    llm = LLM(model, device="cpu", num_kvcache_blocks=64)
    try:
        expected = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                                use_tqdm=False)[0].text
    finally:
        llm.shutdown()
    with nanoserve_serve(model, tmp_path, "--served-model-name", "tiny-gguf") as served:
        client = openai.OpenAI(base_url=served.openai_url, api_key="unused", max_retries=0, timeout=120)
        completion = client.completions.create(model="tiny-gguf", prompt=PROMPT, temperature=0, max_tokens=10,
                                               extra_body={"ignore_eos": True})
    assert completion.choices[0].text == expected
    log = (tmp_path / "tritonserver.log").read_text() + "".join(served.output)
    assert f"nanoserve: weights (quantization=auto, --quantization none for float): {weights}" in log
