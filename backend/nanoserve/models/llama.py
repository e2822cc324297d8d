"""Llama decoder (also the base of Qwen2 and Qwen3): pre-norm blocks of GQA attention with RoPE and a
SwiGLU MLP, the residual add fused into the following RMSNorm."""
from __future__ import annotations

import torch
from torch import nn

from nanoserve.layers.activation import SiluAndMul
from nanoserve.layers.attention import Attention, AttentionBackend
from nanoserve.layers.decode_layer import DecodeLayerOp
from nanoserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanoserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoserve.layers.norm import RMSNorm
from nanoserve.layers.rotary import RotaryEmbedding, rope_parameters


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config, attention_backend: AttentionBackend, rotary_emb: RotaryEmbedding):
        super().__init__()
        head_dim = head_dim_of(config)
        qkv_bias, o_bias = self.biases(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=o_bias)
        self.rotary_emb = rotary_emb  # one cos/sin table shared by every layer
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # per rank
        self.head_dim = head_dim
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim ** -0.5, attention_backend)
        self.q_norm = self.k_norm = None  # per-head RMSNorms of q and k before RoPE (Qwen3's)

    @staticmethod
    def biases(config) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias)."""
        bias = getattr(config, "attention_bias", False)
        return bias, bias

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor):
        return (q, k) if self.q_norm is None else (self.q_norm(q), self.k_norm(k))

    def forward(self, angles, x: torch.Tensor, attn_metadata, lora=None) -> torch.Tensor:
        """angles: the rotary embedding's (cos, sin) of the tokens' positions."""
        q, k, v = self.qkv_proj(x, lora).split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], -1)
        tokens = x.shape[0]
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(angles, *self.qk_norm(q, k))
        return self.o_proj(self.attn(q, k, v, attn_metadata), lora)


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        bias = getattr(config, "mlp_bias", False)
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x, lora)), lora)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, attention_backend: AttentionBackend, attention_cls: type[LlamaAttention],
                 rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = attention_cls(config, attention_backend, rotary_emb)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.decode_op: DecodeLayerOp | None = None  # set by fuse_decode

    def fuse_decode(self) -> None:
        """Run decode steps as one op where it can (layers/decode_layer.py)."""
        attention = self.self_attn
        qk_norms = () if attention.q_norm is None else (attention.q_norm, attention.k_norm)
        self.decode_op = DecodeLayerOp.of(
            (self.input_layernorm, self.post_attention_layernorm, *qk_norms),
            (attention.qkv_proj, attention.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj), attention.attn)

    def forward(self, angles, x, residual, attn_metadata, lora=None):
        if lora is None and self.decode_op is not None and self.decode_op.runs(x, attn_metadata):
            return self.decode_op(angles, x, residual, attn_metadata)
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(angles, x, attn_metadata, lora)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, lora), residual


class LlamaModel(nn.Module):
    def __init__(self, config, attention_backend: AttentionBackend, attention_cls: type[LlamaAttention]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = rotary_emb = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings,
                                                       rope_parameters(config))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, attention_backend, attention_cls, rotary_emb)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, attn_metadata, lora=None):
        x, residual, angles = self.embed_tokens(input_ids), None, self.rotary_emb.angles(positions)
        for layer in self.layers:
            x, residual = layer(angles, x, residual, attn_metadata, lora)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    attention_cls = LlamaAttention
    # checkpoint module name -> (our fused module, shard id passed to its weight_loader)
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config, attention_backend: AttentionBackend):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, attention_backend, self.attention_cls)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata, lora=None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]; attn_metadata is what the attention
        backend built for the step (`backend.build(batch)`), lora the step's LoRABatch (layers/lora.py) or None."""
        return self.model(input_ids, positions, attn_metadata, lora)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] on rank 0 (None on other tensor-parallel ranks)."""
        return self.lm_head(hidden)
