"""/metrics of a real tritonserver against the traffic sent and the offline engine's own counters. The KV pool
is small (16 blocks of 8 tokens) so that concurrent requests preempt each other. The model runs in the plain
`backend: "python"` form (backend/model.py copied into the model), the alternative to the nanoserve backend,
with REPORT_CUSTOM_METRICS: the vllm:* metrics beside the nanoserve_* ones."""
import threading

import pytest
from serving_utils import metrics, stream, triton

from nanoserve import LLM, SamplingParams

pytestmark = [pytest.mark.triton_server, pytest.mark.slow]
MODEL = "nanoserve"
# max_model_len: the pool's size, so that a request without max_tokens (max_model_len - prompt) is admitted
ENGINE_ARGS = {"device": "cpu", "kvcache_block_size": 8, "num_kvcache_blocks": 16, "max_model_len": 128}
M = 30  # tokens per request
GREEDY = {"temperature": 0, "max_tokens": M, "ignore_eos": True}
PROMPTS = ["The licence grants you the right to", "naïve café — 你好", "def main():", "Copyright (C) 2007"]


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    with triton(tmp_path_factory.mktemp("metrics"), qwen3_dir, [MODEL], plain_python=[MODEL],
                parameters={"REPORT_CUSTOM_METRICS": "true"}, **ENGINE_ARGS) as server:
        yield server


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    with LLM(qwen3_dir, **ENGINE_ARGS) as llm:
        yield llm


def delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_prefix_cache_hit_rate_and_pool_gauges_match_the_engine(server, llm):
    # First test on a fresh server: the same requests, one after the other, through the offline engine.
    shared = "Everyone is permitted to copy and distribute verbatim copies of this license document"
    for prompt in (shared, shared + " twice"):
        assert stream(server, MODEL, text_input=prompt, sampling_parameters=GREEDY).error is None
        llm.generate(prompt, SamplingParams(**GREEDY), use_tqdm=False)
    stats = llm.stats()
    hits, computed = stats["prefix_cache_hit_tokens"], stats["prompt_tokens_computed"]
    values = metrics(server, MODEL)
    assert hits > 0
    assert values["nanoserve_prefix_cache_hit_rate"] == pytest.approx(hits / (hits + computed))
    assert values["nanoserve_kv_blocks_total"] == ENGINE_ARGS["num_kvcache_blocks"]
    assert values["nanoserve_kv_blocks_used"] == 0
    assert values["nanoserve_requests_running"] == values["nanoserve_requests_waiting"] == 0
    vllm = metrics(server, MODEL, prefix="vllm:")
    assert vllm["vllm:prefix_cache_hits_total"] == hits  # the second prompt repeats the first's blocks
    assert vllm["vllm:prefix_cache_queries_total"] == hits + computed
    assert vllm["vllm:kv_cache_usage_perc"] == 0
    assert vllm["vllm:num_requests_running"] == vllm["vllm:num_requests_waiting"] == 0


def send_traffic(server, max_tokens: list[int]) -> list:
    """PROMPTS streamed: the first alone until its first token, then the others beside it."""
    results = [None] * len(PROMPTS)
    first_running = threading.Event()  # set by the first request's first token

    def run(i):
        results[i] = stream(server, MODEL, text_input=PROMPTS[i], stream=True, first_response=first_running,
                            sampling_parameters={**GREEDY, "max_tokens": max_tokens[i]})

    first = threading.Thread(target=run, args=(0,))
    first.start()
    assert first_running.wait(60)
    others = [threading.Thread(target=run, args=(i,)) for i in range(1, len(PROMPTS))]
    for t in others:
        t.start()
    for t in [first, *others]:
        t.join(120)
    return results


def test_counters_and_histograms_match_the_traffic(server, llm):
    # The first request (13 blocks at its end) is running when the others (5 blocks each) arrive: 16 blocks
    # cannot hold them all, so the scheduler preempts. On a busy machine the first may finish before the others
    # arrive; the traffic is then sent again (every attempt is checked in full) until one preempted.
    max_tokens = [96, M, M, M]
    params = [SamplingParams(**{**GREEDY, "max_tokens": n}) for n in max_tokens]
    expected = llm.generate(PROMPTS, params, use_tqdm=False)
    assert any(check_traffic(server, max_tokens, expected) for _ in range(5)), "no attempt preempted"


def check_traffic(server, max_tokens: list[int], expected: list) -> bool:
    """Send the traffic, check every metric against it; True when it preempted."""
    before, vllm_before = metrics(server, MODEL), metrics(server, MODEL, prefix="vllm:")
    results = send_traffic(server, max_tokens)
    assert [r.text for r in results] == [e.text for e in expected]  # preemption recomputes exactly

    after = metrics(server, MODEL)
    k, prompt_tokens, generated = len(PROMPTS), sum(e.num_prompt_tokens for e in expected), sum(max_tokens)
    assert delta(after, before, "nanoserve_generation_tokens_total") == generated
    assert delta(after, before, "nanoserve_prompt_tokens_total") == prompt_tokens
    assert delta(after, before, "nanoserve_requests_finished_total{reason=length}") == k
    assert delta(after, before, "nanoserve_requests_finished_total{reason=stop}") == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "prompt_length_tokens",
                 "generation_length_tokens"):
        assert delta(after, before, f"nanoserve_{name}_count") == k
        assert after[f"nanoserve_{name}_bucket{{le=+Inf}}"] == after[f"nanoserve_{name}_count"]
    assert delta(after, before, "nanoserve_inter_token_latency_seconds_count") == k  # one mean per request
    mean_itl = delta(after, before, "nanoserve_inter_token_latency_seconds_sum") / k
    assert 0 < mean_itl < delta(after, before, "nanoserve_e2e_request_latency_seconds_sum") / k
    assert delta(after, before, "nanoserve_prompt_length_tokens_sum") == prompt_tokens
    assert delta(after, before, "nanoserve_generation_length_tokens_sum") == generated
    assert after["nanoserve_kv_blocks_used"] == 0 and after["nanoserve_requests_running"] == 0

    vllm = metrics(server, MODEL, prefix="vllm:")
    assert delta(vllm, vllm_before, "vllm:prompt_tokens_total") == prompt_tokens
    assert delta(vllm, vllm_before, "vllm:generation_tokens_total") == generated
    assert delta(vllm, vllm_before, "vllm:num_preemptions_total") == delta(after, before, "nanoserve_preemptions_total")
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):
        assert delta(vllm, vllm_before, f"vllm:{name}_count") == k
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds"):  # once per token, as vLLM does
        assert delta(vllm, vllm_before, f"vllm:{name}_count") == generated - k
        assert vllm[f"vllm:{name}_bucket{{le=+Inf}}"] == vllm[f"vllm:{name}_count"]
    assert delta(vllm, vllm_before, "vllm:request_prompt_tokens_sum") == prompt_tokens
    assert delta(vllm, vllm_before, "vllm:request_generation_tokens_sum") == generated
    assert delta(vllm, vllm_before, "vllm:request_params_n_count") == k
    assert delta(vllm, vllm_before, "vllm:request_params_n_sum") == k
    assert delta(vllm, vllm_before, "vllm:request_params_max_tokens_count") == k
    assert delta(vllm, vllm_before, "vllm:request_params_max_tokens_sum") == sum(max_tokens)
    assert delta(vllm, vllm_before, "vllm:request_params_max_tokens_bucket{le=50}") == k - 1  # 96 above 50
    assert vllm["vllm:kv_cache_usage_perc"] == 0 and vllm["vllm:num_requests_running"] == 0
    return delta(after, before, "nanoserve_preemptions_total") > 0


def test_n_samples_compute_their_prompt_once(server):
    """n = 3 at temperature 1: three different texts, and the prefix-cache counters show the prompt's full blocks
    computed by the first sample alone (the others take them as hits, as vLLM's samples do)."""
    before = metrics(server, MODEL, prefix="vllm:")
    out = stream(server, MODEL, text_input="Three samples of one prompt, its blocks computed only once here.",
                 exclude_input_in_output=True, return_num_input_tokens=True,
                 sampling_parameters={"n": 3, "temperature": 1.0, "max_tokens": 8, "ignore_eos": True})
    [response] = out.responses
    assert len({text for text in response["text_output"].tolist()}) == 3
    num_prompt = int(response["num_input_tokens"][0])
    shared = (num_prompt - 1) // ENGINE_ARGS["kvcache_block_size"] * ENGINE_ARGS["kvcache_block_size"]
    after = metrics(server, MODEL, prefix="vllm:")
    assert shared > 0 and delta(after, before, "vllm:prefix_cache_queries_total") == 3 * num_prompt
    assert delta(after, before, "vllm:prefix_cache_hits_total") == 2 * shared
    assert delta(after, before, "vllm:prompt_tokens_total") == num_prompt
    assert delta(after, before, "vllm:request_generation_tokens_sum") == 3 * 8
    # vLLM's histograms of the request's parameters: one sample per request, n's buckets 1, 2, 5, 10, 20
    assert delta(after, before, "vllm:request_params_n_count") == 1
    assert delta(after, before, "vllm:request_params_n_sum") == 3
    assert delta(after, before, "vllm:request_params_n_bucket{le=2}") == 0
    assert delta(after, before, "vllm:request_params_n_bucket{le=5}") == 1
    assert delta(after, before, "vllm:request_params_max_tokens_sum") == 8


def test_max_tokens_not_given_is_counted_as_what_max_model_len_leaves(server, llm):
    before = metrics(server, MODEL, prefix="vllm:")
    out = stream(server, MODEL, text_input="Stop soon", return_num_input_tokens=True,
                 sampling_parameters={"temperature": 0})
    assert out.error is None, out.error
    num_prompt = int(out.responses[-1]["num_input_tokens"][0])
    after = metrics(server, MODEL, prefix="vllm:")
    assert delta(after, before, "vllm:request_params_max_tokens_count") == 1
    assert delta(after, before, "vllm:request_params_max_tokens_sum") == llm.engine.config.max_model_len - num_prompt
