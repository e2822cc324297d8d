"""Every SamplingParams the engine admits is safe: arbitrary values from the documented ranges (edges included)
go through the sampler and through real engine steps in mixed batches, and nothing raises; what is not admitted
is a ValueError naming its field."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.sequence import Sequence
from nanoserve.layers.sampler import Sampler, SamplingMetadata
from nanoserve.sampling_params import (MAX_SEED, MAX_STOP_STRING_CHARS, MAX_TEMPERATURE, MAX_TOP_K,
                                       REPETITION_PENALTY_RANGE, SamplingParams)

MAX_MODEL_LEN = 96
EOS = 2


def edges(strategy, *values):
    return st.sampled_from(values) | strategy


def floats(lo, hi, *extra):
    return edges(st.floats(lo, hi, allow_nan=False), lo, hi, *extra)


def params_values(vocab_size: int):
    """Keyword arguments for SamplingParams, mostly inside the documented ranges, sometimes just outside."""
    return st.fixed_dictionaries({}, optional={
        "max_tokens": st.none() | edges(st.integers(1, 40), MAX_MODEL_LEN, 2 ** 63, 10 ** 30),
        "min_tokens": edges(st.integers(0, 40), MAX_MODEL_LEN + 1, 2 ** 64),
        "temperature": floats(0.0, MAX_TEMPERATURE, 1e-5, 1e-6, 2e-5),
        "top_p": edges(st.floats(0.0, 1.0, exclude_min=True), 5e-324, 1e-9, 1.0),
        "top_k": edges(st.integers(-1, MAX_TOP_K), 0, 1, vocab_size - 1, vocab_size, vocab_size + 1, 2 ** 31,
                       MAX_TOP_K, MAX_TOP_K + 1),
        "min_p": floats(0.0, 1.0, 1e-300),
        "seed": st.none() | edges(st.integers(0, MAX_SEED), 2 ** 32, 2 ** 63, MAX_SEED, MAX_SEED + 1),
        "repetition_penalty": floats(*REPETITION_PENALTY_RANGE, 1.0),
        "presence_penalty": floats(-2.0, 2.0, 0.0),
        "frequency_penalty": floats(-2.0, 2.0, 0.0),
        "ignore_eos": st.booleans(),
        "stop": st.lists(st.text(min_size=1, max_size=8) | st.just("x" * MAX_STOP_STRING_CHARS), max_size=3),
        "stop_token_ids": st.lists(edges(st.integers(0, vocab_size - 1), EOS, vocab_size, 2 ** 40), max_size=4),
        "include_stop_str_in_output": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "logprobs": st.none() | edges(st.integers(0, 20), 21),
    })


def admitted(values: dict, vocab_size: int) -> SamplingParams | None:
    """The params if admitted; None if rejected, which must be a ValueError naming one of the given fields."""
    try:
        params = SamplingParams(**values)
        params.check_against_model(MAX_MODEL_LEN, vocab_size, max_logprobs=20)
        return params
    except ValueError as e:
        assert str(e).split(":")[0] in values, (str(e), values)
        return None


# ---- the sampler -----------------------------------------------------------------------------------------

SAMPLER_VOCAB = 64


@st.composite
def sampler_batches(draw):
    rows = draw(st.lists(params_values(SAMPLER_VOCAB), min_size=1, max_size=5))
    params = [p for p in (admitted(values, SAMPLER_VOCAB) for values in rows) if p is not None]
    seqs = []
    for i, p in enumerate(params):
        prompt = draw(st.lists(st.integers(0, SAMPLER_VOCAB - 1), min_size=1, max_size=6))
        output = draw(st.lists(st.integers(0, SAMPLER_VOCAB - 1), max_size=6))
        seq = Sequence(str(i), prompt, p, max_tokens=64)
        seq.token_ids += output
        seqs.append(seq)
    scale = draw(st.sampled_from([0.0, 1.0, 30.0, 1e4]))
    masked = draw(st.sampled_from([0, 1, SAMPLER_VOCAB - 1]))  # logits at -inf, as a grammar mask would leave
    return seqs, scale, masked


@settings(max_examples=300, deadline=None)
@given(sampler_batches(), st.integers(0, 2 ** 32))
def test_admitted_params_never_break_the_sampler(batch, logits_seed):
    seqs, scale, masked = batch
    logits = torch.randn(len(seqs), SAMPLER_VOCAB, generator=torch.Generator().manual_seed(logits_seed)) * scale
    logits[:, :masked] = -math.inf
    out = Sampler(seed=logits_seed)(logits, SamplingMetadata.from_seqs(seqs, EOS, "cpu"))
    assert len(out.token_ids) == len(seqs)
    assert all(0 <= t < SAMPLER_VOCAB for t in out.token_ids)
    for seq, token, logprob in zip(seqs, out.token_ids, out.sampled_logprobs):
        if masked == 0:  # (with a mask, min_tokens may ban the tokens it left: no token is possible)
            assert not math.isnan(logprob)
        elif seq.sampling_params.min_tokens == 0:
            assert token >= masked  # a masked token is never sampled while another one is possible


# ---- real engine steps -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(qwen3_dir):
    engine = LLMEngine.from_engine_args(qwen3_dir, device="cpu", max_model_len=MAX_MODEL_LEN,
                                        num_kvcache_blocks=64, kvcache_block_size=16)
    yield engine
    engine.shutdown()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_admitted_params_never_break_an_engine_step(engine, data):
    vocab_size = engine.vocab_size
    rows = data.draw(st.lists(st.tuples(params_values(vocab_size), st.lists(st.integers(0, vocab_size - 1),
                                                                            min_size=1, max_size=40), st.booleans()),
                              min_size=1, max_size=4))
    num_steps = data.draw(st.integers(1, 6))
    try:
        for i, (values, prompt, stream) in enumerate(rows):
            params = admitted(values, vocab_size)
            if params is None:
                continue
            try:
                engine.add_request(f"r{i}", prompt, params, stream=stream)
            except ValueError as e:  # prompt + max_tokens beyond max_model_len: rejected at admission
                assert str(e).startswith(("max_tokens:", "prompt:")), str(e)
        for _ in range(num_steps):
            for output in engine.step():
                assert all(0 <= t < vocab_size for t in output.new_token_ids)
    finally:
        for request_id in list(engine.requests):
            engine.abort_request(request_id)
        engine.step()  # delivers the abort outputs
    stats = engine.stats()
    assert not engine.requests and stats["num_free_blocks"] == stats["num_total_blocks"]
