"""The engine core in its own process: it serves exactly what the same engine serves in-process (tokens, text,
logprobs, prompt logprobs, n samples, stop strings, aborts); its messages round-trip; a core that cannot load
says why; a core that dies is a failure at once; a core whose stub dies exits."""
import dataclasses
import os
import queue
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from serving_utils import wait_until
from transformers import AutoTokenizer

from nanoserve.config import EngineConfig
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.outputs import PromptLogprobs, RequestOutput
from nanoserve.errors import FIELD, ErrorKind, RequestError
from nanoserve.sampling_params import SamplingParams
from nanoserve.serving.stub.engine_core import Abort, Add, Command, EngineCoreClient, step_codec
from nanoserve.serving.stub.engine_thread import EngineThread, StepResult

import msgspec

TIMEOUT = 120
ENGINE_ARGS = dict(device="cpu", max_model_len=256, num_kvcache_blocks=64, kvcache_block_size=16)
REQUESTS = {
    "greedy": ("The licence grants you", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)),
    "seeded": ("Héllo wörld", SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True, logprobs=2)),
    "stop": ("def main():", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=["e"])),
    "samples": ("  spaces   and\ttabs", SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=12,
                                                          ignore_eos=True, prompt_logprobs=1)),
    "ids": ([5, 17, 99, 3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
    "endless": ("Once upon a time", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)),
}


@pytest.fixture(scope="module")
def config(qwen3_dir):
    return EngineConfig.from_kwargs(qwen3_dir, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def tokenizer(config):
    return AutoTokenizer.from_pretrained(config.tokenizer)


def serve(engine, results: queue.Queue, tokenizer) -> dict:
    """REQUESTS through `engine` (an EngineThread or an EngineCoreClient), "endless" aborted once it has an output:
    each request's outputs, without their timing."""
    outputs: dict[str, list[RequestOutput]] = {request_id: [] for request_id in REQUESTS}
    for request_id, (prompt, params) in REQUESTS.items():
        if isinstance(prompt, str):  # (the stub's intake tokenizes)
            prompt = tokenizer.encode(prompt)
        engine.add(request_id, prompt, params)
    unfinished, aborted = {"greedy": 1, "seeded": 1, "stop": 1, "samples": 2, "ids": 1, "endless": 1}, False
    while any(unfinished.values()):
        result = results.get(timeout=TIMEOUT)
        assert not result.rejected and not result.failed and result.failure is None
        for output in result.outputs:
            outputs[output.request_id].append(output)
            unfinished[output.request_id] -= output.finish_reason is not None  # (finished: the request's last)
        if outputs["endless"] and not aborted:
            engine.abort("endless")
            aborted = True
    return outputs


def summary(outputs: dict[str, list[RequestOutput]]) -> dict:
    """Per request and sample: its tokens, text, logprobs, ranks, last cumulative logprob and finish reason, and
    the prompt logprobs (which steps they came in, and the prefix cache's hits, depend on when requests arrive)."""
    samples = {}
    for request_id, request_outputs in outputs.items():
        for output in request_outputs:
            sample = samples.setdefault((request_id, output.index), {"tokens": [], "text": "", "logprobs": [],
                                                                     "ranks": [], "prompt": None})
            sample["tokens"] += output.new_token_ids
            sample["text"] += output.text_delta
            sample["logprobs"] += output.new_logprobs
            sample["ranks"] += output.new_logprob_ranks
            sample["prompt"] = sample["prompt"] or output.prompt_logprobs
            sample["end"] = (output.finish_reason, output.cumulative_logprob, output.num_output_tokens)
    return samples


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_core_process_serves_what_the_engine_serves_in_process(config, tokenizer, async_scheduling):
    """The in-process engine steps synchronously; the core, with async scheduling or without, serves the same."""
    engine = LLMEngine(dataclasses.replace(config, async_scheduling=False))
    results = queue.Queue()
    thread = EngineThread(engine, results).start()
    try:
        in_process = serve(thread, results, tokenizer)
    finally:
        thread.stop()
        engine.shutdown()
    results = queue.Queue()
    client = EngineCoreClient(dataclasses.replace(config, async_scheduling=async_scheduling), results)
    try:
        assert client.initial_stats["num_total_blocks"] == 64
        in_core = serve(client, results, tokenizer)
    finally:
        client.stop()
    assert client.process.exitcode == 0
    endless = in_core.pop("endless"), in_process.pop("endless")
    assert summary(in_core) == summary(in_process)
    assert [outputs[-1].finish_reason for outputs in endless] == ["abort", "abort"]
    assert in_core["stop"][-1].finish_reason == "stop"
    assert {output.index for output in in_core["samples"]} == {0, 1}
    assert in_core["samples"][0].prompt_logprobs is not None  # on the request's first output


def test_a_request_the_engine_refuses_is_rejected_by_the_core(config):
    results = queue.Queue()
    client = EngineCoreClient(config, results)
    try:
        client.add("bad", [1, 2], SamplingParams(max_tokens=1000))  # checked by the engine, in the core
        result = results.get(timeout=TIMEOUT)
        assert result.rejected[0][0] == "bad" and result.rejected[0][1].field == "max_tokens"  # typed in the core
    finally:
        client.stop()


def test_a_core_that_cannot_load_says_why(qwen3_dir, tokenizer, tmp_path):
    config = EngineConfig.from_kwargs(qwen3_dir, **ENGINE_ARGS, enable_lora=True)
    with pytest.raises(RuntimeError, match=r"^LoRA adapter 'missing': "):
        EngineCoreClient(config, queue.Queue(), adapters={"missing": str(tmp_path / "nothing")})


def test_a_killed_core_is_a_failure_at_once(config, tokenizer):
    results = queue.Queue()
    client = EngineCoreClient(config, results)
    try:
        client.add("r", tokenizer.encode("The licence grants you"), SamplingParams(max_tokens=200, ignore_eos=True))
        results.get(timeout=TIMEOUT)
        os.kill(client.process.pid, signal.SIGKILL)
        wait_until(lambda: client.failure is not None)
        assert client.failure == "the engine core process exited (exit code -9)"
        client.abort("r")  # a no-op now, never an error
        client.add("s", tokenizer.encode("Hi"), SamplingParams())
    finally:
        client.stop()


CHILD = textwrap.dedent("""
    import queue, sys, time
    from transformers import AutoTokenizer
    from nanoserve.config import EngineConfig
    from nanoserve.serving.stub.engine_core import EngineCoreClient
    if __name__ == "__main__":
        config = EngineConfig.from_kwargs(sys.argv[1], device="cpu", num_kvcache_blocks=16)
        client = EngineCoreClient(config, queue.Queue())
        print(client.process.pid, flush=True)
        time.sleep(600)
""")


def test_a_core_exits_when_its_stub_dies(qwen3_dir, tmp_path):
    script = tmp_path / "stub.py"
    script.write_text(CHILD)
    stub = subprocess.Popen([sys.executable, str(script), qwen3_dir], stdout=subprocess.PIPE, text=True)
    try:
        core = psutil.Process(int(stub.stdout.readline()))
        stub.kill()
        stub.wait()
        wait_until(lambda: not core.is_running() or core.status() == psutil.STATUS_ZOMBIE)
    finally:
        stub.kill()
        stub.stdout.close()


# ---- messages ----
token_ids = st.lists(st.integers(0, 2 ** 31 - 1), max_size=4)
logprob_entries = st.lists(st.dictionaries(st.integers(0, 2 ** 31 - 1), st.floats(-100, 0), max_size=3), max_size=3)
request_outputs = st.builds(
    RequestOutput, request_id=st.text(max_size=8), new_token_ids=token_ids, text_delta=st.text(max_size=8),
    finished=st.booleans(), finish_reason=st.sampled_from([None, "stop", "length", "abort"]),
    num_prompt_tokens=st.integers(0, 10 ** 6), num_output_tokens=st.integers(0, 10 ** 6),
    cumulative_logprob=st.one_of(st.none(), st.floats(-1e6, 0)), new_logprobs=logprob_entries,
    num_cached_tokens=st.integers(0, 10 ** 6), new_logprob_ranks=token_ids, index=st.integers(0, 16),
    prompt_logprobs=st.one_of(st.none(), st.builds(
        PromptLogprobs, token_ids=token_ids, logprobs=st.lists(st.one_of(st.none(), st.dictionaries(
            st.integers(0, 100), st.floats(-100, 0), max_size=2)), max_size=3), ranks=token_ids)))
pairs = st.lists(st.tuples(st.text(max_size=8), st.text(max_size=20)), max_size=2)
request_errors = st.builds(RequestError, st.one_of(st.none(), st.from_regex(FIELD, fullmatch=True)),
                           st.text(max_size=20), st.sampled_from(ErrorKind))
rejections = st.lists(st.tuples(st.text(max_size=8), request_errors), max_size=2)
step_results = st.builds(StepResult, outputs=st.lists(request_outputs, max_size=4), rejected=rejections, failed=pairs,
                         stats=st.dictionaries(st.text(max_size=8), st.integers(0, 10 ** 9), max_size=3),
                         time=st.floats(0, 1e9), failure=st.one_of(st.none(), st.text(max_size=20)))


@settings(max_examples=200, deadline=None)
@given(step_results)
def test_a_step_result_arrives_as_it_was_sent(step):
    encoder, decoder = step_codec()
    assert decoder.decode(encoder.encode(step)) == step


def test_commands_arrive_as_they_were_sent():
    params = SamplingParams(temperature=0.5, stop=["x"], logit_bias={"3": 1.5}, structured_outputs={"regex": "a+"},
                            seed=2 ** 64 - 1, logprobs=3)
    for command in (Add("r1", [1, 2, 3], params), Abort("r1")):
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(command), type=Command) == command


def step_outputs(engine, overlap: bool, abort_after: int) -> dict:
    """REQUESTS (+ a grammar, a non-streamed and a scored request) stepped to the end, "endless" aborted after
    abort_after steps: per request and sample, its outputs in order, each as a tuple of its fields."""
    requests = {**REQUESTS,
                "grammar": ("Once upon", SamplingParams(temperature=0, max_tokens=12,
                                                        structured_outputs={"regex": "[a-z]+( [a-z]+)+"})),
                "scored": ("The licence", SamplingParams(max_tokens=0, prompt_logprobs=1))}
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    engine.add_request("whole", "Héllo", SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=1),
                       stream=False)
    per_sample, steps, deferred = {}, 0, 0
    while engine.has_unfinished_requests():
        for output in engine.step(overlap=overlap):
            fields = tuple(getattr(output, name) for name in RequestOutput.__dataclass_fields__)
            per_sample.setdefault((output.request_id, output.index), []).append(fields)
        steps += 1
        deferred = max(deferred, len(engine.output_processor.deferred))
        if steps == abort_after:
            engine.abort_request("endless")
    # deferrable: greedy, seeded, ids, endless and the second sample of "samples" (not: a stop string, prompt
    # logprobs, a grammar, not streamed)
    assert (deferred >= 4) if overlap else not deferred
    return per_sample


@pytest.mark.parametrize("abort_after", [1, 5])
def test_overlapped_outputs_are_the_step_by_step_ones(config, abort_after):
    """The engine thread's steps make a stream's output while the next step runs: every request still gets the
    same outputs in the same order, an abort's included (overlap is synchronous scheduling's)."""
    engine = LLMEngine(dataclasses.replace(config, async_scheduling=False))
    try:
        assert step_outputs(engine, True, abort_after) == step_outputs(engine, False, abort_after)
        assert not engine.output_processor.deferred and engine.stats()["num_running"] == 0
    finally:
        engine.shutdown()
