"""Model registry, weight loading (shards, tied embeddings, packed q/k/v and gate/up, errors) and the model
interface, checked against HF transformers on the same random weights."""
from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from hf_reference import hf_model
from test_model_runner import Blocks, check_rows, greedy_next, make_runner, make_seq, random_ids, run_step
from transformers import AutoConfig

from nanoserve.layers.attention import Attention, AttentionBatch, make_backend
from nanoserve.models import MODELS, get_model_class, load_weights


@pytest.fixture(scope="module")
def tied_sharded_dir(tmp_path_factory):
    """qwen2 with tie_word_embeddings, saved in ~100 KB shards."""
    from nanoserve.tiny_model import build_tiny_model

    path = str(tmp_path_factory.mktemp("tied") / "qwen2-tied")
    return build_tiny_model(path, "qwen2", seed=3, max_shard_size="100KB", tie_word_embeddings=True)


def _copy_checkpoint(src: str, dst: str, edit) -> str:
    """Copy a single-file checkpoint, passing its tensors dict through `edit`."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


def _build(model_dir: str):
    config = AutoConfig.from_pretrained(model_dir)
    model = get_model_class(config)(config, make_backend("torch"))
    return config, model


def test_registry_knows_the_three_architectures(tiny_models):
    assert set(MODELS) == {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
    for arch, name in (("qwen3", "Qwen3ForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("llama", "LlamaForCausalLM")):
        assert get_model_class(AutoConfig.from_pretrained(tiny_models[arch])).__name__ == name


def test_unknown_architecture_is_a_clear_error(tiny_models):
    config = AutoConfig.from_pretrained(tiny_models["qwen3"])
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM, Qwen2ForCausalLM, "
                                         "Qwen3ForCausalLM"):
        get_model_class(config)


def test_model_interface_matches_hf_full_sequence(tiny_models):
    """model(input_ids, positions, attn_metadata) + compute_logits on every position of one prompt."""
    model_dir = tiny_models["qwen3"]
    config, model = _build(model_dir)
    load_weights(model, model_dir)
    ids = random_ids(10, seed=5)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    kv = torch.zeros(2, len(layers), 2, 8, config.num_key_value_heads, config.head_dim)  # 2 blocks of 8 slots
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = kv[0, i], kv[1, i]
    batch = AttentionBatch(slot_mapping=torch.arange(10), query_start_loc=torch.tensor([0, 10], dtype=torch.int32),
                           seq_lens=torch.tensor([10], dtype=torch.int32),
                           block_tables=torch.tensor([[0, 1]], dtype=torch.int32), max_query_len=10, max_seq_len=10)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(10), layers[0].backend.build(batch))
        logits = model.compute_logits(hidden)
        ref = hf_model(model_dir)(torch.tensor([ids])).logits[0]
    assert hidden.shape == (10, config.hidden_size) and logits.shape == (10, config.vocab_size)
    torch.testing.assert_close(logits, ref, atol=1e-4 * float(ref.abs().max()), rtol=1e-4)


def test_tied_embeddings_and_sharded_checkpoint(tied_sharded_dir):
    files = glob.glob(os.path.join(tied_sharded_dir, "*.safetensors"))
    assert len(files) > 1
    names = set()
    for path in files:
        names |= set(load_file(path))
    assert "lm_head.weight" not in names
    runner = make_runner(tied_sharded_dir)
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
    blocks = Blocks(96, 4)
    seqs = [make_seq("t0", random_ids(9, seed=50)), make_seq("t1", random_ids(2, seed=51))]
    check_rows(tied_sharded_dir, run_step(runner, blocks, [(s, 0, s.num_tokens) for s in seqs]), seqs)
    for seq in seqs:
        greedy_next(tied_sharded_dir, seq)
    check_rows(tied_sharded_dir, run_step(runner, blocks, [(s, s.num_tokens - 1, 1) for s in seqs]), seqs)
    runner.shutdown()


def test_missing_weight_is_named(tiny_models, tmp_path):
    def drop(tensors):
        del tensors["model.layers.1.self_attn.k_proj.weight"]
        del tensors["model.norm.weight"]

    model_dir = _copy_checkpoint(tiny_models["llama"], str(tmp_path / "m"), drop)
    _, model = _build(model_dir)
    with pytest.raises(ValueError, match="missing weights") as err:
        load_weights(model, model_dir)
    assert "model.layers.1.self_attn.qkv_proj.weight (shard 'k')" in str(err.value)
    assert "model.norm.weight" in str(err.value)


def test_unexpected_and_misshaped_weights_are_named(tiny_models, tmp_path):
    def add(tensors):
        tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)

    model_dir = _copy_checkpoint(tiny_models["qwen2"], str(tmp_path / "extra"), add)
    _, model = _build(model_dir)
    with pytest.raises(ValueError, match="unexpected weights: model.layers.0.mlp.extra_proj.weight"):
        load_weights(model, model_dir)

    def reshape(tensors):
        tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 64)

    model_dir = _copy_checkpoint(tiny_models["qwen2"], str(tmp_path / "bad"), reshape)
    _, model = _build(model_dir)
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight.*shape mismatch"):
        load_weights(model, model_dir)


def test_no_checkpoint_files(tmp_path, tiny_models):
    _, model = _build(tiny_models["qwen3"])
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_weights(model, str(tmp_path))
