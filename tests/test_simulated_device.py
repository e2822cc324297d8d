"""The simulated device (a benchmark tool): the engine runs every step's host work for real, takes at least the
simulated device time per step, and produces the tokens its requests ask for."""
import numpy as np
import pytest

from nanoserve.engine.simulated_device import ENV_STEP_MS, ENV_WAIT, WAITS, SimulatedDevice

STEP_MS = 3.0


def simulated_llm(make_llm, qwen3_dir, monkeypatch, wait: str, **engine_args):
    monkeypatch.setenv(ENV_STEP_MS, str(STEP_MS))
    monkeypatch.setenv(ENV_WAIT, wait)
    return make_llm(qwen3_dir, cpu_kvcache_space_gib=0.125, **engine_args)


@pytest.mark.parametrize("wait", WAITS)
def test_every_step_takes_the_device_time_and_every_request_its_tokens(make_llm, qwen3_dir, monkeypatch, wait):
    from nanoserve import SamplingParams

    # synchronous scheduling: each step() waits for its own device time (async: for the step before's)
    engine = simulated_llm(make_llm, qwen3_dir, monkeypatch, wait, max_num_seqs=4, async_scheduling=False).engine
    assert engine.executor.runner.simulated.wait == wait
    params = SamplingParams(max_tokens=7, ignore_eos=True, temperature=0.0)
    prompts = ["The quick brown fox", "jumps over", "the lazy dog", "and runs", "far away"]  # 5 > max_num_seqs
    deltas, token_ids, step_seconds = {}, {}, []
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params, stream=True)
    while engine.has_unfinished_requests():
        for output in engine.step():
            deltas.setdefault(output.request_id, []).append(output.text_delta)
            token_ids.setdefault(output.request_id, []).extend(output.new_token_ids)
        if engine.last_step.num_prefill_tokens + engine.last_step.num_decode_tokens:
            step_seconds.append(engine.last_step.seconds)
    assert sorted(token_ids) == [str(i) for i in range(len(prompts))]
    assert all(len(ids) == 7 for ids in token_ids.values())
    vocab_size = engine.config.hf_config.vocab_size
    assert all(0 <= t < vocab_size for ids in token_ids.values() for t in ids)
    for request_id, ids in token_ids.items():  # the random ids are detokenized like any others
        assert "".join(deltas[request_id]) == engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert len(step_seconds) >= 7 and min(step_seconds) >= STEP_MS / 1000  # the device time is a lower bound


def test_the_offline_llm_generates_on_the_simulated_device(make_llm, qwen3_dir, monkeypatch):
    from nanoserve import SamplingParams

    llm = make_llm(qwen3_dir, cpu_kvcache_space_gib=0.125)
    simulated = simulated_llm(make_llm, qwen3_dir, monkeypatch, "sync")
    assert llm.engine.executor.runner.simulated is None  # built before the environment asked for one
    assert simulated.engine.executor.runner.simulated is not None
    params = SamplingParams(max_tokens=6, ignore_eos=True, n=2, seed=3)
    outputs = simulated.generate(["a b c", "d e"], params, use_tqdm=False)
    assert [len(completion.token_ids) for output in outputs for completion in output.outputs] == [6] * 4


def test_a_draft_models_slots_are_filled_without_running_it(make_llm, qwen3_dir, monkeypatch):
    """With a draft model the simulated device runs neither model: the proposals' slots get token 0."""
    from nanoserve import SamplingParams

    simulated = simulated_llm(make_llm, qwen3_dir, monkeypatch, "sync",
                              speculative_config={"model": qwen3_dir, "num_speculative_tokens": 2})
    draft = simulated.engine.executor.runner.draft

    def never(*args):
        raise AssertionError("the draft model ran on the simulated device")
    monkeypatch.setattr(draft, "propose", never)
    monkeypatch.setattr(draft, "compute", never)
    outputs = simulated.generate(["a b c", "d e"], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [len(output.outputs[0].token_ids) for output in outputs] == [6, 6]
    assert simulated.stats()["spec_decode_num_draft_tokens"] > 0


def test_the_environment_is_checked_and_names_its_variable():
    assert SimulatedDevice.from_env(environ={}) is None
    assert SimulatedDevice.from_env(environ={ENV_STEP_MS: " "}) is None
    device = SimulatedDevice.from_env(environ={ENV_STEP_MS: "2.5"})
    assert device.step_seconds == 0.0025 and device.wait == "sync"
    assert SimulatedDevice.from_env(environ={ENV_STEP_MS: "8", ENV_WAIT: "spin"}).wait == "spin"
    with pytest.raises(ValueError, match=ENV_STEP_MS):
        SimulatedDevice.from_env(environ={ENV_STEP_MS: "fast"})
    with pytest.raises(ValueError, match=ENV_STEP_MS):
        SimulatedDevice.from_env(environ={ENV_STEP_MS: "0"})
    with pytest.raises(ValueError, match=ENV_WAIT):
        SimulatedDevice.from_env(environ={ENV_STEP_MS: "8", ENV_WAIT: "block"})


@pytest.mark.parametrize("wait", WAITS)
def test_a_launched_step_is_ready_no_earlier_than_its_device_time(wait):
    import time

    device = SimulatedDevice(STEP_MS, wait, seed=1)
    launched = time.perf_counter()
    step = device.launch(num_tokens=5, num_rows=3, vocab_size=10)
    ids = step.token_ids()
    assert time.perf_counter() - launched >= STEP_MS / 1000
    assert ids.dtype == np.int64 and ids.shape == (3,) and ((0 <= ids) & (ids < 10)).all()
    empty = device.launch(num_tokens=0, num_rows=0, vocab_size=10)  # a step that only preempted: no device time
    assert empty.ready_at <= time.perf_counter() and len(empty.token_ids()) == 0


def test_bench_ab_reads_the_device_shares_bench_serving_prints(capsys, monkeypatch):
    from client import bench_ab, bench_serving

    monkeypatch.setenv(ENV_STEP_MS, "")  # restored (unset) after the test: simulate_device sets both
    monkeypatch.setenv(ENV_WAIT, "")

    args = bench_serving.parse_args(["--model-repository", "repo", "--concurrency", "4", "--simulated-device-ms",
                                     "8"])
    device_bound = bench_serving.simulate_device(args)
    assert device_bound == 4 * 1000 / 8
    rounds = [{"served": bench_serving.RunResult(1.0, tokens), "in-process": bench_serving.RunResult(1.0, 400)}
              for tokens in (250, 300, 350)]
    bench_serving.print_device_shares(rounds, device_bound, args)
    shares = bench_ab.parse("simulated", capsys.readouterr().out)
    assert shares == {"served / device-bound": 0.6, "in-process / device-bound": 0.8}  # the medians


def test_bench_overlap_runs_both_ways_on_the_simulated_device(capsys, monkeypatch, qwen3_dir):
    from client import bench_overlap

    monkeypatch.setenv(ENV_STEP_MS, "1")  # (restored after the test: the bench sets it for its engine)
    bench_overlap.main(["--model", qwen3_dir, "--simulated-device-ms", "1", "--rows", "3", "--output-len", "5",
                        "--rounds", "2"])
    out = capsys.readouterr().out
    rounds = [line.split(":")[0] for line in out.splitlines() if line.startswith("round ")]
    assert sorted(rounds) == ["round 0 overlapped", "round 0 step by step", "round 1 overlapped",
                              "round 1 step by step"]
    assert "overlapped / step by step: median" in out


def test_steps_run_in_launch_order():
    """A step launched while the one before runs starts when that one is done (async scheduling launches so)."""
    device = SimulatedDevice(60_000.0)
    first, second = device.launch(4, 4, 32), device.launch(4, 4, 32)
    assert second.ready_at == pytest.approx(first.ready_at + 60.0)
    assert device.launch(0, 0, 32).ready_at == pytest.approx(second.ready_at)  # no tokens: no device time
