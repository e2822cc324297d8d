"""Multi-LoRA through a real tritonserver (`nanoserve serve --lora-modules`, which writes the model's
multi_lora.json): adapters picked with `lora_name` in sampling_parameters give the offline engine's text in one
shared batch; an unknown lora_name is INVALID_ARG naming it; the OpenAI API lists the adapters and takes one as
`model`. One server for the module; the offline engine is the reference (tests/test_lora.py checks it against
peft; tests/test_serve_cli.py checks multi_lora.json's relative paths)."""
import json
import threading
import urllib.request

import openai
import pytest
from serving_utils import http_post, stream
from triton_server import nanoserve_serve

from nanoserve import LLM, SamplingParams

pytestmark = [pytest.mark.triton_server, pytest.mark.slow]
N = 8
PROMPT = "The adapter says"
NAMES = ["wide", "narrow", None]


@pytest.fixture(scope="module")
def served(lora_adapters, qwen3_dir, tmp_path_factory):
    """`nanoserve serve --enable-lora --lora-modules ...`: its repository's multi_lora.json names the adapters."""
    paths = lora_adapters["qwen3"]
    with nanoserve_serve(qwen3_dir, tmp_path_factory.mktemp("lora_server"), "--enable-lora", "--max-lora-rank", "8",
                         "--max-loras", "2", "--lora-modules", f"wide={paths['wide']}",
                         f"narrow={paths['narrow']}") as served:
        yield served


@pytest.fixture(scope="module")
def offline(qwen3_dir, lora_adapters) -> dict:
    llm = LLM(qwen3_dir, device="cpu", enable_lora=True, max_lora_rank=8)
    try:
        for name, path in lora_adapters["qwen3"].items():
            llm.add_lora(name, path)
        outputs = llm.generate([PROMPT] * len(NAMES), [greedy(name) for name in NAMES], use_tqdm=False)
        return {name: out.text for name, out in zip(NAMES, outputs)}
    finally:
        llm.shutdown()


def greedy(lora_name=None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, lora_name=lora_name)


def sampling(lora_name=None) -> dict:
    values = {"temperature": 0, "max_tokens": N, "ignore_eos": True}
    return values if lora_name is None else {**values, "lora_name": lora_name}


def test_lora_name_picks_a_multi_lora_json_adapter_in_a_shared_batch(served, offline):
    server = served
    assert len(set(offline.values())) == len(NAMES), "the adapters should change the text"
    results = {}

    def run(name):
        results[name] = stream(server, "nanoserve", text_input=PROMPT, stream=False, exclude_input_in_output=True,
                               sampling_parameters=sampling(name))

    threads = [threading.Thread(target=run, args=(name,)) for name in NAMES]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name in NAMES:
        assert results[name].error is None, results[name].error
        assert results[name].text == offline[name], name


def test_unknown_lora_name_is_invalid_arg_naming_it(served):
    server = served
    out = stream(server, "nanoserve", text_input=PROMPT, sampling_parameters=sampling("nope"))
    assert out.error is not None and out.responses == []
    assert out.error.message().startswith("lora_name: unknown LoRA adapter 'nope' (known: narrow, wide)")
    status, body = http_post(server, "/v2/models/nanoserve/generate",
                             {"text_input": PROMPT, "parameters": {"lora_name": "nope", "max_tokens": 2}})
    assert status == 400 and b"lora_name" in body
    assert stream(server, "nanoserve", text_input=PROMPT, sampling_parameters=sampling()).error is None


def test_openai_api_lists_the_adapters_and_takes_one_as_model(served, offline):
    with urllib.request.urlopen(served.openai_url + "/models", timeout=30) as response:
        listed = json.loads(response.read())["data"]
    assert [(m["id"], m.get("parent")) for m in listed] == [("nanoserve", None), ("wide", "nanoserve"),
                                                             ("narrow", "nanoserve")]
    client = openai.OpenAI(base_url=served.openai_url, api_key="unused", max_retries=0, timeout=120)
    for name in NAMES:
        completion = client.completions.create(model=name or "nanoserve", prompt=PROMPT, temperature=0,
                                               max_tokens=N, extra_body={"ignore_eos": True})
        assert completion.choices[0].text == offline[name] and completion.model == (name or "nanoserve")
    with pytest.raises(openai.NotFoundError, match="LoRA adapter"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
