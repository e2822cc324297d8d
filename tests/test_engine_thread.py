"""The engine thread with a real engine: a step that raises fails only the requests admitted with it, the others
finish with the same text as without the fault; a step that keeps raising, or a dead thread, fails the engine;
a prompt that cannot fit is rejected without being tokenized."""
import queue

import pytest

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.tokenize import encode_prompt_text, max_prompt_bytes, max_token_bytes
from nanoserve.errors import RequestError
from nanoserve.layers.sampler import Sampler
from nanoserve.sampling_params import SamplingParams
from nanoserve.serving.stub.engine_thread import EngineThread

FAULT_SEED = 666  # a request with this seed makes the sampler raise (from the given step on)
TIMEOUT = 120
PROMPTS = ["The licence grants you", "Héllo wörld", "  spaces   and\ttabs", "def main():"]
GOOD = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=2 ** 63 + 1, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=["zz"])]


class FaultySampler(Sampler):
    """The real sampler, which raises for a batch holding a row seeded FAULT_SEED, once it has seen that row
    `after` times: a request's own bug, reached at admission (after=0) or later in its life."""

    def __init__(self, seed, after=0):
        super().__init__(seed)
        self.after, self.seen = after, 0

    def __call__(self, logits, meta):
        if any(seed == FAULT_SEED for _, seed in meta.seeds):
            self.seen += 1
            if self.seen > self.after:
                raise RuntimeError("injected sampler fault")
        return super().__call__(logits, meta)


@pytest.fixture(params=[False, True], ids=["sync", "async_scheduling"])
def engine(qwen3_dir, request):
    engine = LLMEngine.from_engine_args(qwen3_dir, device="cpu", max_model_len=256, num_kvcache_blocks=64,
                                        kvcache_block_size=16, async_scheduling=request.param)
    yield engine
    engine.shutdown()


def run(engine, requests, bad=None, after=0):
    """Serve requests ({id: (prompt, params)}) on an engine thread; once each has an output, add `bad` (id,
    prompt, params). Returns ({id: text}, {id: failure message}, the thread)."""
    engine.executor.runner.sampler = FaultySampler(engine.config.seed, after)
    results = queue.Queue()
    thread = EngineThread(engine, results).start()
    texts, failed = {request_id: "" for request_id in requests}, {}
    for request_id, (prompt, params) in requests.items():
        thread.add(request_id, prompt, params)
    finished = set()
    try:
        while len(finished) + len(failed) < len(texts) and thread.failure is None:
            result = results.get(timeout=TIMEOUT)
            for output in result.outputs:
                texts[output.request_id] += output.text_delta
                finished |= {output.request_id} if output.finished else set()
            failed.update(result.failed + result.rejected)
            if bad is not None and all(texts[request_id] for request_id in requests):
                texts[bad[0]] = ""
                thread.add(*bad)
                bad = None
    finally:
        thread.stop()
    return {k: v for k, v in texts.items() if k in finished}, failed, thread


def test_a_failing_step_fails_only_the_request_admitted_with_it(engine):
    requests = {f"good{i}": (prompt, params) for i, (prompt, params) in enumerate(zip(PROMPTS, GOOD))}
    reference, failed, _ = run(engine, requests)
    assert not failed and len(reference) == len(requests)
    bad = ("bad", PROMPTS[0], SamplingParams(temperature=1.0, seed=FAULT_SEED, max_tokens=24))
    texts, failed, thread = run(engine, requests, bad)
    assert list(failed) == ["bad"] and "engine step failed with this request" in failed["bad"]
    assert texts == reference
    assert thread.failure is None
    stats = engine.stats()
    assert not engine.output_processor.requests and stats["num_free_blocks"] == stats["num_total_blocks"]


def test_a_step_that_keeps_failing_fails_the_engine(engine):
    """The faulty request was admitted steps ago: the retry without the suspects (none) raises again."""
    requests = {"good": (PROMPTS[1], GOOD[0]),
                "late": (PROMPTS[0], SamplingParams(temperature=1.0, seed=FAULT_SEED, max_tokens=24))}
    _, failed, thread = run(engine, requests, after=5)
    assert thread.failure == "an engine step failed again after recovering from a failed step"
    assert not failed  # nothing was admitted since the last good step: the response thread ends them all
    stats = engine.stats()
    assert not engine.output_processor.requests and stats["num_free_blocks"] == stats["num_total_blocks"]


class BrokenResults(queue.Queue):
    def put(self, item, block=True, timeout=None):
        raise RuntimeError("results queue broken")


def test_a_dead_engine_thread_is_a_failure(engine):
    thread = EngineThread(engine, BrokenResults()).start()
    assert thread.failure is None
    thread.add("r", PROMPTS[0], GOOD[0])
    thread._thread.join(TIMEOUT)
    assert thread.failure == "the engine thread died (RuntimeError: results queue broken)"


class UncallableTokenizer:
    """A tokenizer whose vocabulary is known but which must never be asked to encode."""

    def __init__(self, tokenizer):
        self.vocab = tokenizer.get_vocab()
        self.backend_tokenizer = tokenizer.backend_tokenizer

    def get_vocab(self):
        return self.vocab

    def __call__(self, *args, **kwargs):
        raise AssertionError("the tokenizer was called")

    encode = __call__


def test_a_prompt_that_cannot_fit_is_rejected_without_tokenizing(engine):
    limit = max_prompt_bytes(engine.tokenizer, engine.config.max_model_len)
    assert limit == (engine.config.max_model_len - 1) * max_token_bytes(engine.tokenizer)
    with pytest.raises(ValueError, match=r"^prompt: 5000000 bytes of text cannot fit max_model_len"):
        encode_prompt_text(UncallableTokenizer(engine.tokenizer), "x" * 5_000_000, limit)
    results = queue.Queue()
    thread = EngineThread(engine, results).start()
    try:
        thread.add("huge", "é" * 2_500_000, GOOD[0])
        result = results.get(timeout=TIMEOUT)
        assert result.rejected == [("huge", RequestError("prompt", f"5000000 bytes of text cannot fit max_model_len "
                                                                   f"(at most {limit} bytes for this tokenizer); "
                                                                   "rejected without tokenizing"))]
    finally:
        thread.stop()
    with pytest.raises(ValueError, match=r"^prompt: 5000000 bytes"):
        engine.add_request("offline", "x" * 5_000_000, GOOD[0])


def test_the_longest_token_bounds_every_prompt(engine):
    """The bound is a lower bound on the token count: no text encodes to fewer tokens than bytes / bound."""
    per_token = max_token_bytes(engine.tokenizer)
    for text in PROMPTS + ["=" * 500, " " * 300, "ab" * 200 + "😀" * 50, "\n\n" * 100]:
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) * per_token >= len(text.encode())
