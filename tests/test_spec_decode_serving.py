"""Speculative decoding in a real tritonserver, with n-gram proposals and with a draft model (the checkpoint as
its own draft): model.json's speculative_config, streamed runs equal to the offline engine's output (with and
without speculation), and the spec_decode counters on /metrics under nanoserve's and vLLM's names equal to the
offline engine's for the same requests."""
import pytest
from serving_utils import metrics, stream, triton

from nanoserve import LLM, SamplingParams

pytestmark = [pytest.mark.triton_server, pytest.mark.slow]
MODEL = "nanoserve"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
DRAFT = {"model": "{checkpoint}", "num_speculative_tokens": 3}  # the checkpoint as its own draft
GREEDY = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
PROMPTS = ["one two three four one two three four one two three four one two", "def f(x): return x\ndef g(x):"]


@pytest.fixture(scope="module", params=[NGRAM, DRAFT], ids=["ngram", "draft"])
def engine_args(request, qwen3_dir):
    spec = {key: value.format(checkpoint=qwen3_dir) if key == "model" else value
            for key, value in request.param.items()}
    return {"device": "cpu", "kvcache_block_size": 8, "speculative_config": spec}


@pytest.fixture(scope="module")
def server(engine_args, qwen3_dir, tmp_path_factory):
    with triton(tmp_path_factory.mktemp("spec"), qwen3_dir, [MODEL], plain_python=[MODEL],
                parameters={"REPORT_CUSTOM_METRICS": "true"}, **engine_args) as server:
        yield server


def test_streamed_runs_and_counters_match_the_offline_engine(server, engine_args, qwen3_dir):
    streamed = [stream(server, MODEL, text_input=p, stream=True, sampling_parameters=GREEDY) for p in PROMPTS]
    assert all(s.error is None for s in streamed)
    params = SamplingParams(**GREEDY)
    with LLM(qwen3_dir, **engine_args) as llm:  # one at a time, as the server got them
        texts = [llm.generate(prompt, params, use_tqdm=False)[0].text for prompt in PROMPTS]
        stats = llm.stats()
    with LLM(qwen3_dir, **{**engine_args, "speculative_config": None}) as plain:
        assert [out.text for out in plain.generate(PROMPTS, params, use_tqdm=False)] == texts
    assert [s.text for s in streamed] == texts
    assert any(len(s.responses) < GREEDY["max_tokens"] for s in streamed), "no step emitted a run"
    assert stats["spec_decode_num_accepted_tokens"] > 0
    for prefix in ("nanoserve_", "vllm:"):
        values = metrics(server, MODEL, prefix=prefix)
        for name in ("drafts", "draft_tokens", "accepted_tokens"):
            assert values[f"{prefix}spec_decode_num_{name}_total"] == stats[f"spec_decode_num_{name}"]
        assert sum(values[f"{prefix}spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"]
                   for i in range(3)) == values[f"{prefix}spec_decode_num_accepted_tokens_total"]
