"""The CUDA-graph decode path: the capture protocol against a fake torch.cuda graph API, replay through the model
runner (without a GPU a fake graph's replay runs the captured forward eagerly on the static buffers; with
NANOSERVE_TEST_DEVICE=cuda the graphs are captured and replayed for real), padding, a batch whose size changes
every step, eager fallbacks (past the largest bucket, wider block tables, prefill), the engine with graphs against
HF, and a check that the captured forward never synchronizes with the host."""
from __future__ import annotations

import contextlib
import functools
import sys

import pytest
import torch
from device import ON_CUDA, cuda_only
from hf_reference import hf_greedy
from test_model_runner import Blocks, check_rows, greedy_next, make_runner, make_seq, random_ids, run_step
from torch.overrides import TorchFunctionMode

from nanoserve.engine.cuda_graph import PAD_SEQ_LEN, PAD_SLOT, CUDAGraphRunner
from nanoserve.engine.lora import LoRAAdapter
from nanoserve.layers.attention import AttentionBatch

MAX_MODEL_LEN = 256  # make_runner's


def use_triton_kernels(monkeypatch):
    """Norms, RoPE and SiLU take the Triton kernels on CPU tensors too (through the interpreter), as on CUDA."""
    from nanoserve.layers import activation, norm, rotary

    pytest.importorskip("nanoserve.kernels.ops")
    for module in (activation, norm, rotary):
        monkeypatch.setattr(module, "pick", lambda name, reference, x: activation.cuda_op(name))


def graph_runner(runner, max_num_seqs: int, max_blocks: int | None = None) -> CUDAGraphRunner:
    return CUDAGraphRunner(runner.model, runner.backend, max_num_seqs, max_blocks or runner.max_blocks_per_seq,
                           MAX_MODEL_LEN, runner.config.hf_config.hidden_size, runner.dtype, runner.device)


class FakeGraph:
    """A captured graph on CPU: replay() runs `body` (the captured bucket's forward) eagerly."""

    def __init__(self, body=None):
        self.body = body
        self.handle = ("pool", id(self))

    def pool(self):
        return self.handle

    def replay(self):
        self.body()


class FakeCuda:
    """torch.cuda.CUDAGraph / graph / synchronize stand-ins that log the capture protocol."""

    def __init__(self, monkeypatch):
        self.log = []
        self.capturing = None
        monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
        monkeypatch.setattr(torch.cuda, "graph", self.graph)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.log.append(("sync",)))

    @contextlib.contextmanager
    def graph(self, graph, pool=None):
        self.log.append(("capture", pool))
        self.capturing = graph
        try:
            yield
        finally:
            self.capturing = None

    def spy_forward(self, model, monkeypatch):
        forward = model.forward

        def logged(input_ids, positions, meta, lora=None):
            self.log.append(("forward", input_ids.shape[0], self.capturing is not None,
                             torch.is_inference_mode_enabled()))
            return forward(input_ids, positions, meta, lora)
        monkeypatch.setattr(model, "forward", logged)


def fake_capture(graphs: CUDAGraphRunner, monkeypatch) -> FakeCuda:
    cuda = FakeCuda(monkeypatch)
    cuda.spy_forward(graphs.model, monkeypatch)
    graphs.capture()
    for bucket, graph in graphs.graphs.items():
        graph.body = functools.partial(graphs._forward, bucket)
    for bucket, graph in graphs.verify_graphs.items():
        graph.body = functools.partial(graphs._forward, bucket, graphs.verify_len)
    return cuda


def capture(graphs: CUDAGraphRunner, monkeypatch) -> None:
    """Real graphs on a GPU; on the CPU, fake ones whose replay runs the captured bucket's forward eagerly."""
    if graphs.input_ids.is_cuda:
        graphs.capture()
    else:
        fake_capture(graphs, monkeypatch)


def spy_replays(graphs: CUDAGraphRunner, monkeypatch) -> list[int]:
    batches, run = [], graphs.run

    def wrapped(input_ids, positions, batch):
        batches.append(input_ids.shape[0])
        return run(input_ids, positions, batch)
    monkeypatch.setattr(graphs, "run", wrapped)
    return batches


def spy_query_lens(graphs: CUDAGraphRunner, monkeypatch) -> list[int]:
    """The max_query_len of each replay of graphs."""
    query_lens, run = [], graphs.run

    def spy(input_ids, positions, batch):
        query_lens.append(batch.max_query_len)
        return run(input_ids, positions, batch)
    monkeypatch.setattr(graphs, "run", spy)
    return query_lens


# ---- capture ----
def test_capture_largest_first_into_one_pool_after_a_warmup(tiny_models, monkeypatch):
    from nanoserve.kernels import ops

    runner = make_runner(tiny_models["qwen3"], attention_backend="triton", max_num_seqs=8)
    attention_hints = []
    paged_attention = ops.paged_attention

    def spy(*args, **kwargs):
        attention_hints.append((kwargs["max_query_len"], kwargs["max_seq_len"]))
        return paged_attention(*args, **kwargs)
    monkeypatch.setattr(ops, "paged_attention", spy)
    graphs = graph_runner(runner, 8)
    cuda = fake_capture(graphs, monkeypatch)

    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    pool = graphs.graphs[8].pool()
    expected = []
    for bucket in (8, 4, 2, 1):
        expected += [("forward", bucket, False, True), ("sync",),  # warm-up, outside the capture
                     ("capture", None if bucket == 8 else pool), ("forward", bucket, True, True), ("sync",)]
    assert cuda.log == expected
    # the decode split count is frozen at capture: it is sized from max_model_len, not the dummy batch
    assert set(attention_hints) == {(1, MAX_MODEL_LEN)}
    runner.shutdown()


def test_capture_refuses_host_synchronizing_attention(tiny_models, monkeypatch):
    runner = make_runner(tiny_models["qwen3"])  # attention_backend "torch"
    graphs = graph_runner(runner, 4)
    cuda = FakeCuda(monkeypatch)
    with pytest.raises(ValueError, match="cannot run in a CUDA graph"):
        graphs.capture()
    assert cuda.log == [] and graphs.graphs == {}
    runner.shutdown()


# ---- replay through the model runner ----
def test_replay_matches_hf_and_repads_rows(tiny_models, monkeypatch):
    """The batch changes size every step, rows leaving and joining again: each step replays the smallest bucket
    that holds it, and the rows of a bigger earlier batch become padding again."""
    use_triton_kernels(monkeypatch)
    model_dir = tiny_models["qwen3"]
    runner = make_runner(model_dir, attention_backend="triton", max_num_seqs=8, enforce_eager=True)
    graphs = graph_runner(runner, 8)
    capture(graphs, monkeypatch)
    graphs.block_tables.fill_(1 << 30)  # stale ids that a padded row or an unused column must never follow
    runner.graphs = graphs
    replays = spy_replays(graphs, monkeypatch)
    blocks = Blocks(96, 4, seed=5)
    seqs = [make_seq(f"r{i}", random_ids(n, seed=50 + i)) for i, n in enumerate((3, 9, 5, 1, 6))]
    run_step(runner, blocks, [(s, 0, s.num_tokens) for s in seqs])
    assert replays == []  # prefill runs eagerly

    # buckets 8 (3 padded rows), 4 (rows 3, 4 become padding), 4, 1, 8, 2
    steps = [seqs, seqs[:3], seqs[1:], seqs[2:3], seqs, seqs[3:]]
    for batch in steps:
        for seq in batch:
            greedy_next(model_dir, seq)
        logits = run_step(runner, blocks, [(s, s.num_tokens - 1, 1) for s in batch])
        check_rows(model_dir, logits, blocks.sampled)
        assert sorted(s.request_id for s in blocks.sampled) == sorted(s.request_id for s in batch)
        assert (graphs.slot_mapping[len(batch):] == PAD_SLOT).all()
        assert (graphs.seq_lens[len(batch):] == PAD_SEQ_LEN).all()
    assert replays == [len(batch) for batch in steps[:len(replays)]] and len(replays) >= 2
    assert graphs.outputs[:4].isfinite().all()  # padded row 3 included
    runner.shutdown()


def test_eager_fallbacks(tiny_models, monkeypatch):
    """Steps a graph cannot take run eagerly and still give HF's logits. On the CPU the torch backend is fine:
    the fake graphs are installed without a capture; a GPU captures real ones (with the Triton backend)."""
    model_dir = tiny_models["llama"]
    backend = {"attention_backend": "triton", "enforce_eager": True} if ON_CUDA else {}
    runner = make_runner(model_dir, max_num_seqs=4, **backend)
    graphs = graph_runner(runner, max_num_seqs=2, max_blocks=3)  # buckets 1, 2; tables up to 3 blocks of 4
    if ON_CUDA:
        graphs.capture()
    else:
        graphs.graphs = {b: FakeGraph(functools.partial(graphs._forward, b)) for b in graphs.buckets}
    runner.graphs = graphs
    replays = spy_replays(graphs, monkeypatch)
    blocks = Blocks(96, 4, seed=6)
    a, b, c = (make_seq(f"f{i}", random_ids(n, seed=60 + i)) for i, n in enumerate((4, 7, 11)))
    run_step(runner, blocks, [(s, 0, s.num_tokens) for s in (a, b, c)])
    for seq in (a, b, c):
        greedy_next(model_dir, seq)

    check_rows(model_dir, run_step(runner, blocks, [(s, s.num_tokens - 1, 1) for s in (a, b, c)]), [a, b, c])
    assert replays == []  # 3 sequences: bigger than the largest bucket
    c_step = [(c, c.num_tokens - 1, 1)]
    check_rows(model_dir, run_step(runner, blocks, c_step), [c])
    assert len(c.block_table) == 3 and replays == [1]  # 12 tokens: exactly the captured width
    c.token_ids.append(5)
    check_rows(model_dir, run_step(runner, blocks, [(c, c.num_tokens - 1, 1)]), [c])
    assert len(c.block_table) == 4 and replays == [1]  # a block table wider than captured
    d = make_seq("f3", random_ids(6, seed=63))
    a.token_ids.append(9)
    check_rows(model_dir, run_step(runner, blocks, [(a, a.num_tokens - 1, 1), (d, 0, 6)]), [a, d])
    assert replays == [1]  # a mixed prefill + decode step
    runner.shutdown()


def test_steps_with_lora_rows_run_eagerly(tiny_models, lora_adapters, monkeypatch):
    """The graphs hold no adapters: a decode step with a LoRA row runs eagerly, a base-only one replays."""
    model_dir = tiny_models["qwen3"]
    runner = make_runner(model_dir, max_num_seqs=4, enable_lora=True, max_lora_rank=8)
    graphs = graph_runner(runner, max_num_seqs=2)
    graphs.graphs = {b: FakeGraph(functools.partial(graphs._forward, b)) for b in graphs.buckets}
    runner.graphs = graphs
    replays = spy_replays(graphs, monkeypatch)
    blocks = Blocks(96, 4, seed=7)
    adapted, base = (make_seq(f"l{i}", random_ids(5, seed=70 + i)) for i in range(2))
    out = blocks.output([(s, 0, s.num_tokens) for s in (adapted, base)])
    out.new_seqs[0].lora_slot = 0
    out.lora_loads = [(0, LoRAAdapter(1, "wide", lora_adapters["qwen3"]["wide"]))]
    runner.run_model(out)
    for seq in (adapted, base):
        seq.token_ids.append(7)
    logits = run_step(runner, blocks, [(s, s.num_tokens - 1, 1) for s in (adapted, base)])
    assert replays == []
    check_rows(model_dir, logits[1:], [base])
    greedy_next(model_dir, base)
    check_rows(model_dir, run_step(runner, blocks, [(base, base.num_tokens - 1, 1)]), [base])
    assert replays == [1]
    runner.shutdown()


def test_replay_needs_one_token_per_sequence(tiny_models):
    runner = make_runner(tiny_models["qwen3"])
    graphs = graph_runner(runner, 4)
    ids = torch.zeros(2, dtype=torch.int64)
    batch = AttentionBatch(torch.zeros(2, dtype=torch.int64), torch.tensor([0, 1, 2, 2], dtype=torch.int32),
                           torch.ones(3, dtype=torch.int32), torch.zeros(3, 1, dtype=torch.int32), 1, 1)
    with pytest.raises(ValueError, match="one token per sequence"):
        graphs.run(ids, ids, batch)
    runner.shutdown()


# ---- nothing in the captured forward synchronizes with the host ----
SYNCING = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere", "numpy",
           "cpu", "tensor", "as_tensor", "masked_select", "unique", "unique_consecutive"}


class HostSyncDetector(TorchFunctionMode):
    """Records torch calls that wait for the device or read host data, made outside Triton itself (whose
    interpreter moves tensors to numpy by design): reading a value (.item(), Python branches on a tensor),
    data-dependent shapes (nonzero, boolean-mask indexing), tensors built from host data (an H2D copy)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if (name in SYNCING or _bool_mask_index(name, args)) and not _inside_triton():
            self.calls.append(f"{name} at {_caller()}")
        return func(*args, **(kwargs or {}))


def _bool_mask_index(name: str, args) -> bool:
    if name not in ("__getitem__", "__setitem__", "index_put_", "index_put") or len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], (tuple, list)) else (args[1],)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)


def _frames():
    frame = sys._getframe(2)
    while frame is not None:
        yield frame
        frame = frame.f_back


def _inside_triton() -> bool:
    return any(f.f_globals.get("__name__", "").startswith("triton") for f in _frames())


def _caller() -> str:
    for f in _frames():
        if f.f_globals.get("__name__", "").startswith("nanoserve"):
            return f"{f.f_code.co_filename}:{f.f_lineno}"
    return "?"


def _graph_forward_host_syncs(model_dir: str, backend: str) -> list[str]:
    """The captured decode forward at bucket 4 (2 real rows, 2 padded), then the verify forward at bucket 2
    (3 query tokens and 3 padded token rows), under the detector."""
    runner = make_runner(model_dir, attention_backend=backend, max_num_seqs=4)
    graphs = CUDAGraphRunner(runner.model, runner.backend, 4, runner.max_blocks_per_seq, MAX_MODEL_LEN,
                             runner.config.hf_config.hidden_size, runner.dtype, runner.device, verify_len=3,
                             max_verify_seqs=2)
    graphs.input_ids[:2] = torch.tensor([5, 6])
    graphs.positions[:2] = torch.tensor([4, 0])
    graphs.slot_mapping[:2] = torch.tensor([4, 8])
    graphs.seq_lens[:2] = torch.tensor([5, 1], dtype=torch.int32)
    graphs.block_tables[:2, :2] = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    graphs.verify_query_start_loc[:3] = torch.tensor([0, 2, 3])
    with HostSyncDetector() as detector, torch.inference_mode():
        graphs._forward(4)
        graphs._forward(2, 3)
    runner.shutdown()
    return detector.calls


def test_captured_forward_never_syncs_with_host(tiny_models, monkeypatch):
    use_triton_kernels(monkeypatch)
    assert _graph_forward_host_syncs(tiny_models["qwen3"], "triton") == []


def test_host_sync_detector_catches_the_torch_backend(tiny_models):
    calls = _graph_forward_host_syncs(tiny_models["qwen3"], "torch")
    assert any(c.startswith("tolist") for c in calls) and any(c.startswith("__getitem__") for c in calls)


# ---- the engine's own graphs, on a GPU ----
@cuda_only
def test_engine_graphs_replay_and_match_hf(qwen3_dir, make_llm, monkeypatch):
    """The engine captures its buckets (max_num_seqs 4: 1, 2, 4) and replays them while requests of different
    lengths finish and waiting ones join, so the decode batch changes size; every request gets HF's tokens."""
    from nanoserve import SamplingParams

    llm = make_llm(qwen3_dir, attention_backend="triton", enforce_eager=False, max_num_seqs=4,
                   kvcache_block_size=8)
    graphs = llm.engine.executor.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4]
    replays = spy_replays(graphs, monkeypatch)
    prompts = [random_ids(n, seed=90 + n) for n in (5, 17, 1, 30, 9, 12)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 14, 7, 10, 5, 12)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, param, out in zip(prompts, params, outputs):
        assert out.token_ids == hf_greedy(qwen3_dir, prompt, param.max_tokens)
    assert len(set(replays)) >= 3, replays  # decode batches of several sizes replayed


# ---- speculative verify steps ----
def test_verify_graphs_are_captured_while_speculation_proposes(tiny_models, monkeypatch):
    """A verify graph for each bucket below disable_by_batch_size, 1 + num_speculative_tokens query tokens per
    sequence; the graph with the most token rows first, so every other fits in its pool."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 5}
    runner = make_runner(tiny_models["qwen3"], attention_backend="triton", max_num_seqs=8, enforce_eager=True,
                         speculative_config=spec)
    graphs = runner.graph_runner()
    cuda = fake_capture(graphs, monkeypatch)
    assert sorted(graphs.graphs) == [1, 2, 4, 8] and sorted(graphs.verify_graphs) == [1, 2, 4]
    assert graphs.input_ids.shape[0] == 4 * 4  # the largest verify graph: 4 sequences of 4 tokens
    captured = [entry[1] for entry in cuda.log if entry[0] == "forward" and entry[2]]
    assert captured == [16, 8, 8, 4, 4, 2, 1]  # token rows: verify 4x4, decode 8, verify 2x4, decode 4, ...
    assert runner.graph_runner().can_run(4, 2, 4) and not runner.graph_runner().can_run(5, 2, 4)
    assert not graphs.can_run(2, 2, 5)  # more query tokens than a verify step has: a prefill chunk
    no_spec = make_runner(tiny_models["qwen3"], attention_backend="triton", max_num_seqs=8).graph_runner()
    assert no_spec.verify_buckets == [] and not no_spec.can_run(2, 2, 2)
    runner.shutdown()


def test_verify_replay_matches_hf_and_repads_rows(tiny_models, monkeypatch):
    """Steps whose sequences have 1 to 3 new tokens each (a verify step's shape; here prompt chunks beside
    decodes) replay the verify graphs, a decode-only step the decode graph: the sampled rows' logits equal HF's,
    and rows and tokens of a bigger earlier step become padding again."""
    use_triton_kernels(monkeypatch)
    model_dir = tiny_models["qwen3"]
    runner = make_runner(model_dir, attention_backend="triton", max_num_seqs=4, enforce_eager=True)
    graphs = CUDAGraphRunner(runner.model, runner.backend, 4, runner.max_blocks_per_seq, MAX_MODEL_LEN,
                             runner.config.hf_config.hidden_size, runner.dtype, runner.device, verify_len=3,
                             max_verify_seqs=4)
    capture(graphs, monkeypatch)
    graphs.block_tables.fill_(1 << 30)  # stale ids that a padded row or an unused column must never follow
    runner.graphs = graphs
    replays = spy_replays(graphs, monkeypatch)
    blocks = Blocks(96, 4, seed=8)
    a, b, c, d, e = (make_seq(f"v{i}", random_ids(n, seed=80 + i)) for i, n in enumerate((9, 4, 6, 2, 3)))
    steps = [[(a, 0, 3), (b, 0, 3), (c, 0, 3), (d, 0, 2)],  # prompt chunks; d's prompt ends: d samples
             [(a, 3, 3), (b, 3, 1), (c, 3, 3), d],  # b's and c's prompts end
             [(a, 6, 3), b, c, d],  # a's last chunk beside three decodes
             [b, c],  # decode only: the decode graph
             [a, (e, 0, 3)]]  # the rows of b, c and d become padding again
    for step in steps:
        items = [item if isinstance(item, tuple) else (item, item.num_tokens - 1, 1) for item in step]
        logits = run_step(runner, blocks, items)
        check_rows(model_dir, logits, blocks.sampled)
        for seq in blocks.sampled:
            greedy_next(model_dir, seq)
        num_tokens = sum(n for _, _, n in items)
        assert (graphs.slot_mapping[num_tokens:] == PAD_SLOT).all()
        assert (graphs.seq_lens[len(items):] == PAD_SEQ_LEN).all()
        if max(n for _, _, n in items) > 1:
            assert (graphs.verify_query_start_loc[len(items):] == num_tokens).all()  # padded sequences: empty
    assert replays == [11, 8, 6, 2, 4]
    assert [len(s.token_ids) for s in (a, b, c, d, e)] == [11, 7, 9, 5, 4]  # every sampled row was checked
    runner.shutdown()


def test_engine_verify_steps_replay_and_equal_no_speculation(qwen3_dir, make_llm, monkeypatch):
    """The engine with n-gram speculation and its graphs (fake ones on the CPU, whose replay runs the captured
    forward eagerly): verify steps replay the verify graphs, and the greedy tokens equal those without
    speculation."""
    from test_spec_decode import NGRAM, ReplayProposer, generate, repetitive_prompts

    from nanoserve import SamplingParams

    use_triton_kernels(monkeypatch)
    prompts = repetitive_prompts(seed=21)[:3]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    base = generate(make_llm(qwen3_dir, kvcache_block_size=8), prompts, params)
    llm = make_llm(qwen3_dir, kvcache_block_size=8, attention_backend="triton", num_kvcache_blocks=32,
                   max_num_seqs=4, speculative_config=NGRAM)
    runner = llm.engine.executor.runner
    runner.graphs = runner.graph_runner()
    capture(runner.graphs, monkeypatch)
    query_lens = spy_query_lens(runner.graphs, monkeypatch)
    llm.engine.scheduler.proposer = ReplayProposer(prompts, base, wrong={3})
    assert generate(llm, prompts, params) == base
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert max(query_lens) > 1, query_lens  # verify steps replayed
