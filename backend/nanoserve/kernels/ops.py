"""The Triton kernels, with the same signatures as kernels/reference.py (imports triton)."""
from .activation import silu_and_mul
from .decode_attention import paged_decode_attention
from .kv_store import store_kvcache
from .lora import add_lora
from .paged_attention import paged_attention
from .quant_matmul import int4_group_matmul, int8_matmul
from .rmsnorm import fused_add_rms_norm, rms_norm
from .rotary import rotary

__all__ = ["store_kvcache", "paged_attention", "paged_decode_attention", "rms_norm", "fused_add_rms_norm",
           "silu_and_mul", "rotary", "add_lora", "int8_matmul", "int4_group_matmul"]
