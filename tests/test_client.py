"""The streaming client against a real tritonserver serving the tiny model: gRPC streaming and HTTP SSE give
the same text as the offline engine (greedy), and so do the CLI, `nanoserve demo` (on SmolLM2) and the serving
benchmark's streams."""
import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from client import bench_serving, stream
from nanoserve.engine.simulated_device import ENV_STEP_MS, ENV_WAIT
from triton_server import TEST_ENGINE_ARGS, nanoserve_server, tiny_repository  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.triton_server, pytest.mark.slow]
PROMPT = "The quick brown fox"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    """The offline engine's greedy completion of PROMPT."""
    from nanoserve import LLM, SamplingParams

    with LLM(qwen3_dir, **TEST_ENGINE_ARGS) as llm:
        return llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]


def greedy_params() -> dict:
    return stream.sampling_parameters(max_tokens=MAX_TOKENS, temperature=0.0)


def test_grpc_stream_matches_offline(nanoserve_server, reference):
    printed = []
    result = stream.stream_grpc(nanoserve_server.url_grpc, "nanoserve", PROMPT, greedy_params(),
                                on_text=printed.append)
    assert result.text == reference.text and "".join(printed) == reference.text
    assert result.num_output_tokens == len(reference.token_ids) == MAX_TOKENS
    assert result.finish_reason == "length"
    assert 0 < result.ttft <= result.total


def test_http_sse_matches_offline(nanoserve_server, reference):
    result = stream.stream_http(nanoserve_server.url_http, "nanoserve", PROMPT, greedy_params())
    assert result.text == reference.text
    assert result.num_output_tokens == MAX_TOKENS and result.finish_reason == "length"


def run_cli(prompt: str, protocol: str, url: str, *args: str) -> subprocess.CompletedProcess:
    """client/stream.py as a user runs it."""
    return subprocess.run([sys.executable, str(REPO / "client" / "stream.py"), prompt, "--protocol", protocol,
                           "--url", url, *args], capture_output=True, text=True, timeout=120)


def test_cli_prints_the_stream_and_stats(nanoserve_server, reference):
    for protocol, url in (("grpc", nanoserve_server.url_grpc), ("http", nanoserve_server.url_http)):
        done = run_cli(PROMPT, protocol, url, "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--stats")
        assert done.returncode == 0, done.stderr
        assert done.stdout == reference.text + "\n"
        assert f"output tokens: {MAX_TOKENS}" in done.stderr and "time to first token" in done.stderr


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_cli_reports_a_server_error_in_one_line(nanoserve_server, protocol):
    url = nanoserve_server.url_grpc if protocol == "grpc" else nanoserve_server.url_http
    done = run_cli(PROMPT, protocol, url, "--max-tokens", "-1")
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "max_tokens: must be >= 0, got -1" in done.stderr and "Traceback" not in done.stderr
    assert "data:" not in done.stderr and '{"error"' not in done.stderr  # the message, not the raw SSE event


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_cli_pointed_at_the_other_protocols_port_says_so_in_one_line(nanoserve_server, protocol):
    url = nanoserve_server.url_http if protocol == "grpc" else nanoserve_server.url_grpc
    done = run_cli(PROMPT, protocol, url, "--max-tokens", "2")
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"stream.py: error: {url}:" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_cli_reports_no_server_in_one_line(protocol):
    import socket

    with socket.socket() as closed:  # a port that nothing listens on
        closed.bind(("127.0.0.1", 0))
        url = f"127.0.0.1:{closed.getsockname()[1]}"
    done = run_cli("hi", protocol, url)
    assert done.returncode == 1
    assert f"stream.py: error: {url}:" in done.stderr and "Traceback" not in done.stderr


def test_unknown_model_raises(nanoserve_server):
    with pytest.raises(RuntimeError, match="no_such_model"):
        stream.stream_grpc(nanoserve_server.url_grpc, "no_such_model", PROMPT, greedy_params(), timeout=30)
    with pytest.raises(RuntimeError, match="no_such_model"):
        stream.stream_http(nanoserve_server.url_http, "no_such_model", PROMPT, greedy_params(), timeout=30)


def test_bench_serving_streams_every_token(nanoserve_server, qwen3_dir):
    prompts = bench_serving.make_prompts(qwen3_dir, num_prompts=6, input_len=8, seed=0)
    params = {"max_tokens": 5, "ignore_eos": True, "temperature": 0.0}
    result = asyncio.run(bench_serving.run_served(nanoserve_server.url_grpc, "nanoserve", prompts, params,
                                                  concurrency=4))
    assert result.output_tokens == 6 * 5
    assert len(result.ttfts) == 6 and result.seconds > 0


def test_bench_serving_inprocess_streams_what_generate_returns(qwen3_dir):
    prompts = bench_serving.make_prompts(qwen3_dir, num_prompts=3, input_len=8, seed=0)
    params = {"max_tokens": 4, "ignore_eos": True, "temperature": 0.0}
    streamed, generated = (bench_serving.run_inprocess(qwen3_dir, TEST_ENGINE_ARGS, prompts, params, concurrency=2,
                                                       warmup_prompts=prompts[:1], stream=stream)
                           for stream in (True, False))
    assert streamed.output_tokens == generated.output_tokens == 3 * 4
    assert streamed.texts == generated.texts and len(streamed.texts) == 3  # the deltas join to the whole text


def test_bench_serving_rounds_print_each_ratio_and_the_median(nanoserve_server, capsys):
    argv = ["--model-repository", str(nanoserve_server.model_repository), "--url", nanoserve_server.url_grpc,
            "--concurrency", "2", "--num-prompts", "3", "--warmup", "1", "--input-len", "6", "--output-len", "4",
            "--rounds", "2", "--server-pid", str(nanoserve_server.process.pid)]
    assert bench_serving.main(argv) == 0
    out = capsys.readouterr().out
    ratios = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if ": served / in-process: " in line]
    assert len(ratios) == 2 and out.count("3 requests, 12 output tokens") == 4
    order = [line.split(":")[:2] for line in out.splitlines() if "3 requests" in line]
    assert [side.strip() for _, side in order] == ["served", "in-process", "in-process", "served"]  # drift: ABBA
    median = float(out.rsplit("served / in-process: ", 1)[1].split()[0])
    assert median == pytest.approx(sum(ratios) / 2, abs=1e-3)
    if sys.platform.startswith("linux"):  # each run is followed by what its engine side's threads used
        threads = [line.strip() for line in out.splitlines() if line.strip().startswith("threads: ")]
        assert len(threads) == 4 and all(line.startswith("threads: engine ") for line in threads[1:3])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_bench_serving_reads_the_server_threads_by_their_names(nanoserve_server, qwen3_dir):
    args = bench_serving.parse_args(["--model-repository", str(nanoserve_server.model_repository),
                                     "--concurrency", "2"])
    prompts = bench_serving.make_prompts(qwen3_dir, num_prompts=3, input_len=6, seed=0)
    params = {"max_tokens": 8, "ignore_eos": True, "temperature": 0.0}
    run = bench_serving.timed_served(nanoserve_server.url_grpc, nanoserve_server.process.pid, args, prompts, params)
    assert run.output_tokens == 3 * 8
    assert run.threads["ns-engine"].cpu > 0 and run.threads["ns-responses"].cpu > 0  # named in the stub
    assert "tritonserver" in run.threads  # tritonserver's main thread: the stub's process group is its
    assert all(t.cpu >= 0 and t.wait >= 0 for t in run.threads.values())
    assert sum(t.cpu for t in run.threads.values()) <= 2 * os.cpu_count() * run.seconds + 0.5


def test_bench_serving_together_loads_the_inprocess_engine_once(nanoserve_server, capsys, monkeypatch):
    loads = []
    loaded_llm = bench_serving.loaded_llm

    def counted(*args):
        loads.append(args)
        return loaded_llm(*args)

    warmups = []
    make_warmup_prompts = bench_serving.make_warmup_prompts
    monkeypatch.setattr(bench_serving, "loaded_llm", counted)
    monkeypatch.setattr(bench_serving, "make_warmup_prompts", lambda *args: warmups.append(args) or
                        make_warmup_prompts(*args))
    argv = ["--model-repository", str(nanoserve_server.model_repository), "--url", nanoserve_server.url_grpc,
            "--concurrency", "2", "--num-prompts", "3", "--warmup", "1", "--input-len", "6", "--output-len", "4",
            "--rounds", "3", "--together"]
    assert bench_serving.main(argv) == 0
    out = capsys.readouterr().out
    assert len(loads) == 1  # the separate mode loads one per in-process run
    assert len(warmups) == 1  # and warms each side up before each of its runs
    assert out.count("3 requests, 12 output tokens") == 6 and out.count(": served / in-process: ") == 3
    order = [line.split(":")[1].strip() for line in out.splitlines() if "3 requests" in line]
    assert order == ["served", "in-process", "in-process", "served", "served", "in-process"]


def test_bench_serving_inprocess_reuses_an_engine_with_new_request_ids(qwen3_dir):
    prompts = bench_serving.make_prompts(qwen3_dir, num_prompts=3, input_len=8, seed=0)
    params = {"max_tokens": 4, "ignore_eos": True, "temperature": 0.0}
    with bench_serving.loaded_llm(qwen3_dir, TEST_ENGINE_ARGS, 2) as llm:
        first, again = (bench_serving.time_inprocess(llm, prompts, params, warmup_prompts=prompts[:1])
                        for _ in range(2))
        assert first.texts == again.texts and first.output_tokens == again.output_tokens == 3 * 4
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_total_blocks


def test_bench_serving_simulates_the_device_in_both_sides(qwen3_dir, tmp_path, monkeypatch, capsys):
    """A launched tritonserver's stub builds the simulated device from the environment, like the in-process engine:
    each side streams every token, never faster than the simulated device allows (every step takes at least its
    time and samples at most --concurrency rows)."""
    monkeypatch.setenv(ENV_STEP_MS, "")  # restored (unset) after the test: main() sets both
    monkeypatch.setenv(ENV_WAIT, "")
    repository = tiny_repository(tmp_path / "repository", qwen3_dir)
    log = tmp_path / "tritonserver.log"
    argv = ["--model-repository", str(repository), "--concurrency", "2", "--num-prompts", "3", "--warmup", "1",
            "--input-len", "6", "--output-len", "4", "--together", "--simulated-device-ms", "20",
            "--log-file", str(log)]
    assert bench_serving.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("3 requests, 12 output tokens") == 2 and "device-bound rate: 100 tok/s (2 rows, 20 ms" in out
    shares = {line.split(" / ")[0]: float(line.split(": ")[1].split()[0])
              for line in out.splitlines() if " / device-bound: " in line}
    assert set(shares) == {"served", "in-process"} and all(0 < share <= 1 for share in shares.values())
    assert f"simulated device ({ENV_STEP_MS}=20, {ENV_WAIT}=sync)" in log.read_text()


def test_host_steal_is_the_steal_share_of_the_cpu_time_between_two_readings(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 0 0 0 50 0 0\ncpu0 1 2 3\n")
    steal = bench_serving.HostSteal(str(stat))
    stat.write_text("cpu  300 0 100 1000 0 0 0 100 0 0\n")  # +200 user, +50 system, +200 idle, +50 steal
    assert steal.share() == pytest.approx(50 / 500)
    assert bench_serving.HostSteal(str(tmp_path / "missing")).share() is None
    run = bench_serving.RunResult(2.0, 10, steal=0.1)
    assert run.describe("x", 1).endswith(", host steal 10%")
    quiet = bench_serving.RunResult(2.0, 10, steal=0.01)
    assert bench_serving.too_much_steal([quiet, run], 0.05) and not bench_serving.too_much_steal([quiet], 0.05)
    assert not bench_serving.too_much_steal([run], None)


def test_demo_streams_smollm2s_chat_answer():
    """`nanoserve demo` (scripts/demo.sh) serves SmolLM2-135M-Instruct from the cache (downloaded and converted once,
    as tests/test_gguf.py does) and streams the offline engine's greedy chat answer below the question."""
    from transformers import AutoTokenizer

    from nanoserve import LLM, SamplingParams
    from nanoserve.demo_model import smollm2_gguf
    from nanoserve.models.gguf import checkpoint_dir

    question = "What is the capital of France?"
    done = subprocess.run([sys.executable, "-m", "nanoserve.cli", "demo", "--prompt", question, "--max-tokens", "16"],
                          capture_output=True, text=True, timeout=500, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    checkpoint = checkpoint_dir(str(smollm2_gguf()))
    prompt = AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    with LLM(checkpoint, **TEST_ENGINE_ARGS) as llm:
        expected = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].text
    assert "Paris" in expected
    assert done.stdout.endswith(f"> {question}\n\n{expected}\n\n")
    assert "finish reason: stop" in done.stderr
