"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before RoPE (and no qkv bias)."""
from __future__ import annotations

from nanoserve.layers.norm import RMSNorm
from nanoserve.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config, attention_backend, rotary_emb):
        super().__init__(config, attention_backend, rotary_emb)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
