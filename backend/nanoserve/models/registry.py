"""HF `architectures[0]` -> model class."""
from __future__ import annotations

from nanoserve.models.llama import LlamaForCausalLM
from nanoserve.models.qwen2 import Qwen2ForCausalLM
from nanoserve.models.qwen3 import Qwen3ForCausalLM

MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(hf_config) -> type:
    archs = getattr(hf_config, "architectures", None) or []
    arch = archs[0] if archs else None
    if arch not in MODELS:
        raise ValueError(f"unsupported model architecture {arch!r} (config.json 'architectures'); "
                         f"supported: {', '.join(sorted(MODELS))}")
    return MODELS[arch]
