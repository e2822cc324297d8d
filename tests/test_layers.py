"""Layers: rotary vs HF's rope functions, norms/activation vs the reference kernels, and the tensor-parallel
sharding math (each rank's weight_loader shard recombines to the full layer) without torch.distributed."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import nanoserve.layers.embedding as embedding_mod
import nanoserve.layers.linear as linear_mod
from nanoserve.kernels.reference import fused_add_rms_norm_ref, rms_norm_ref, silu_and_mul_ref
from nanoserve.layers.activation import SiluAndMul
from nanoserve.layers.attention import make_backend
from nanoserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanoserve.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                     RowParallelLinear)
from nanoserve.layers.norm import RMSNorm
from nanoserve.layers.rotary import RotaryEmbedding, rope_inv_freq, rope_parameters

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256, "rope_theta": 500000.0}


def _llama_config(rope: dict, head_dim: int = 64):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                       max_position_embeddings=4096, rope_parameters=rope)


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 10000.0}, LLAMA3_ROPE,
                                  {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}],
                         ids=["default", "llama3", "linear"])
def test_rotary_matches_hf(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = _llama_config(rope)
    params = rope_parameters(config)
    if rope["rope_type"] == "default":
        hf_inv_freq, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        hf_inv_freq, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    torch.testing.assert_close(rope_inv_freq(64, params), hf_inv_freq, rtol=0, atol=0)

    ours = RotaryEmbedding(64, 4096, params)
    positions = torch.tensor([0, 1, 7, 255, 256, 1000, 4095])
    q, k = torch.randn(7, 4, 64), torch.randn(7, 2, 64)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(q, positions[None])
    torch.testing.assert_close(ours.cos[positions], hf_cos[0, :, :32], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.sin[positions], hf_sin[0, :, :32], rtol=0, atol=1e-6)
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    our_q, our_k = ours(ours.angles(positions), q, k)
    torch.testing.assert_close(our_q, hf_q[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(our_k, hf_k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_rope_parameters_reads_old_and_new_config_styles():
    from types import SimpleNamespace

    old = SimpleNamespace(rope_theta=1e6, rope_scaling=None)
    assert rope_parameters(old) == {"rope_theta": 1e6, "rope_type": "default"}
    old_scaled = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_parameters(old_scaled)["rope_type"] == "linear"
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(64, {"rope_type": "yarn", "rope_theta": 1e4})


def test_rms_norm_and_fused_residual():
    norm = RMSNorm(32, eps=1e-6)
    norm.weight.data = torch.randn(32)
    x, residual = torch.randn(5, 32), torch.randn(5, 32)
    torch.testing.assert_close(norm(x), rms_norm_ref(x, norm.weight, 1e-6))
    normed, summed = norm(x, residual)
    ref_normed, ref_summed = fused_add_rms_norm_ref(x, residual, norm.weight, 1e-6)
    torch.testing.assert_close(normed, ref_normed)
    torch.testing.assert_close(summed, x + residual)
    heads = torch.randn(5, 4, 32)  # q_norm / k_norm: per head
    torch.testing.assert_close(norm(heads), rms_norm_ref(heads, norm.weight, 1e-6))


def test_silu_and_mul():
    x = torch.randn(3, 16)
    torch.testing.assert_close(SiluAndMul()(x), silu_and_mul_ref(x))
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :8]) * x[:, 8:])


def test_attention_backend_errors():
    with pytest.raises(ValueError, match="attention backend"):
        make_backend("nope")
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="flash-attn"):
            make_backend("flash_attn")


# ---- tensor-parallel sharding math, one rank at a time ----
@pytest.fixture
def as_rank(monkeypatch):
    """as_rank(rank, size): layers built afterwards believe they are that tensor-parallel rank."""
    def set_rank(rank: int, size: int):
        for module in (linear_mod, embedding_mod):
            monkeypatch.setattr(module, "get_tp_rank", lambda: rank)
            monkeypatch.setattr(module, "get_tp_size", lambda: size)
    return set_rank


def _shards(as_rank, size, build, load):
    layers = []
    for rank in range(size):
        as_rank(rank, size)
        layer = build()
        load(layer)
        layers.append(layer)
    return layers


def test_column_and_row_parallel_recombine(as_rank):
    w1, b1 = torch.randn(8, 6), torch.randn(8)
    w2, b2 = torch.randn(6, 8), torch.randn(6)
    x = torch.randn(3, 6)

    def load_column(layer):
        layer.weight.weight_loader(layer.weight, w1)
        layer.bias.weight_loader(layer.bias, b1)

    def load_row(layer):
        layer.weight.weight_loader(layer.weight, w2)
        layer.bias.weight_loader(layer.bias, b2)

    cols = _shards(as_rank, 2, lambda: ColumnParallelLinear(6, 8, bias=True), load_column)
    rows = _shards(as_rank, 2, lambda: RowParallelLinear(8, 6, bias=True), load_row)
    assert cols[1].weight.shape == (4, 6) and rows[1].weight.shape == (6, 4)
    hidden = [c(x) for c in cols]  # each rank's output slice feeds that rank's row-parallel input slice
    torch.testing.assert_close(torch.cat(hidden, -1), F.linear(x, w1, b1))
    # un-reduced partial sums (all_reduce is a no-op without a process group); bias only on rank 0
    partial = [r(h) for r, h in zip(rows, hidden)]
    torch.testing.assert_close(sum(partial), F.linear(F.linear(x, w1, b1), w2, b2))


def test_merged_column_shards(as_rank):
    gate, up = torch.randn(8, 6), torch.randn(8, 6)

    def load(layer):
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)

    layers = _shards(as_rank, 2, lambda: MergedColumnParallelLinear(6, [8, 8]), load)
    for rank, layer in enumerate(layers):
        rows = slice(4 * rank, 4 * rank + 4)
        torch.testing.assert_close(layer.weight, torch.cat([gate[rows], up[rows]]))


@pytest.mark.parametrize("tp,num_kv_heads", [(1, 2), (2, 2), (4, 2), (2, 4)])
def test_qkv_shards_by_heads(as_rank, tp, num_kv_heads):
    heads, head_dim, hidden = 4, 3, 12
    wq, wk, wv = (torch.randn(n * head_dim, hidden) for n in (heads, num_kv_heads, num_kv_heads))
    bq, bk, bv = (torch.randn(n * head_dim) for n in (heads, num_kv_heads, num_kv_heads))

    def load(layer):
        for shard, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            layer.weight.weight_loader(layer.weight, w, shard)
            layer.bias.weight_loader(layer.bias, b, shard)

    layers = _shards(as_rank, tp, lambda: QKVParallelLinear(hidden, head_dim, heads, num_kv_heads, bias=True), load)
    for rank, layer in enumerate(layers):
        q_heads = heads // tp
        kv_per_rank = max(1, num_kv_heads // tp)
        kv_head = rank * num_kv_heads // tp  # replicated kv heads when tp > num_kv_heads
        q = slice(rank * q_heads * head_dim, (rank + 1) * q_heads * head_dim)
        kv = slice(kv_head * head_dim, (kv_head + kv_per_rank) * head_dim)
        assert (layer.num_heads, layer.num_kv_heads) == (q_heads, kv_per_rank)
        torch.testing.assert_close(layer.weight, torch.cat([wq[q], wk[kv], wv[kv]]))
        torch.testing.assert_close(layer.bias, torch.cat([bq[q], bk[kv], bv[kv]]))
    with pytest.raises(ValueError, match="shard_id"):
        layers[0].weight.weight_loader(layers[0].weight, wq, "x")


def test_vocab_parallel_embedding_and_lm_head(as_rank):
    vocab, dim = 10, 4  # 3 rows per rank over 4 ranks: the last rank holds 1 real row + 2 zero rows
    table = torch.randn(vocab, dim)
    ids = torch.tensor([0, 3, 9, 5, 2])
    hidden = torch.randn(2, dim)

    def load(layer):
        layer.weight.weight_loader(layer.weight, table)

    embeds = _shards(as_rank, 4, lambda: VocabParallelEmbedding(vocab, dim), load)
    assert embeds[3].weight.shape == (3, dim) and embeds[3].weight[1:].abs().sum() == 0
    torch.testing.assert_close(sum(e(ids) for e in embeds), table[ids])  # the all-reduce, summed by hand
    heads = _shards(as_rank, 4, lambda: ParallelLMHead(vocab, dim), load)
    gathered = torch.cat([F.linear(hidden, h.weight) for h in heads], -1)[:, :vocab]
    torch.testing.assert_close(gathered, hidden @ table.T)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tokens", [0, 3, 70, 300])
def test_packed_cpu_weights_match_f_linear(dtype, tol, tokens):
    """pack_cpu_weights moves the CPU matmuls to oneDNN; the results stay F.linear's, and the LM head is packed too.
    The packed copy replaces each weight (held once), except a tied LM head's, which the embedding still reads."""
    model = torch.nn.ModuleDict({"proj": ColumnParallelLinear(16, 24, bias=True), "down": RowParallelLinear(24, 16),
                                 "head": ParallelLMHead(40, 16), "tied": ParallelLMHead(40, 16),
                                 "embed": VocabParallelEmbedding(40, 16)}).to(dtype)
    model["tied"].weight = model["embed"].weight
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape))
    weights = {name: module.weight.detach().clone() for name, module in model.items()}
    linear_mod.pack_cpu_weights(model)
    packed = ["proj", "down", "head", "tied"]
    assert all(model[name].packed_weight is not None for name in packed)
    assert [name for name in packed if model[name].weight.numel()] == ["tied"]
    assert torch.equal(model["embed"].weight, weights["embed"])
    x = torch.randn(tokens, 16, dtype=dtype)
    for name, inputs in (("proj", x), ("down", torch.randn(tokens, 24, dtype=dtype)), ("head", x), ("tied", x)):
        module = model[name]
        expected = F.linear(inputs.double(), weights[name].double(),
                            None if getattr(module, "bias", None) is None else module.bias.double())
        torch.testing.assert_close(module(inputs).double(), expected, atol=tol * 10, rtol=tol)


def test_onednn_sees_only_the_packed_row_counts(monkeypatch):
    """oneDNN keeps a primitive and scratch memory per row count it sees: every count from 1 to 1100 reaches it as
    one of PACKED_ROWS (padded, or cut into pieces), so its caches stay bounded, and the results stay F.linear's."""
    seen = set()

    def recording(x, packed, bias):
        seen.add(x.shape[0])
        return real(x, packed, bias)

    real = linear_mod.onednn_linear
    monkeypatch.setattr(linear_mod, "onednn_linear", recording)
    weight = torch.randn(24, 16)
    packed = linear_mod.pack_weight(weight)
    for rows in range(1, 1101):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(linear_mod.linear(x, weight, None, packed), F.linear(x, weight))
    assert seen == set(linear_mod.PACKED_ROWS)


def test_loader_shape_mismatch_is_named():
    layer = ColumnParallelLinear(4, 3, bias=False)
    with pytest.raises(ValueError, match="shape mismatch"):
        layer.weight.weight_loader(layer.weight, torch.randn(3, 5))
    with pytest.raises(ValueError, match="divisible"):
        linear_mod.divide(6, 4)
