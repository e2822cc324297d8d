"""Rotary position embedding (neox / rotate-half layout, as HF Llama and Qwen) with a precomputed
cos/sin table indexed by position. Supports rope_type "default", "linear" and "llama3"."""
from __future__ import annotations

import math

import torch
from torch import nn

from nanoserve.kernels.reference import rotary_ref
from nanoserve.layers.activation import pick


def rope_parameters(hf_config) -> dict:
    """The rope settings of a HF config: transformers 5 keeps them in `rope_parameters`, 4.x in
    `rope_theta` + `rope_scaling`."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def rope_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band between the
    two cutoffs is interpolated smoothly."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, params).to(torch.get_default_device())
        freqs = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)[:, None] * inv_freq
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_position, head_dim // 2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, head_dim // 2] of positions [T]: looked up once per forward, for every layer."""
        return self.cos[positions], self.sin[positions]

    def forward(self, angles: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor):
        """q [T, heads, head_dim], k [T, kv_heads, head_dim], (cos, sin) from `angles` -> rotated (q, k)."""
        return pick("rotary", rotary_ref, q)(q, k, *angles)
