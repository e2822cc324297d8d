"""Model implementations. `get_model_class(hf_config)(hf_config, attention_backend)` (an instance from
`layers.attention.make_backend`), then `load_weights(model, model_dir)`."""
from nanoserve.models.llama import LlamaForCausalLM
from nanoserve.models.loader import load_weights
from nanoserve.models.qwen2 import Qwen2ForCausalLM
from nanoserve.models.qwen3 import Qwen3ForCausalLM

__all__ = ["MODELS", "get_model_class", "load_weights"]

MODELS = {"LlamaForCausalLM": LlamaForCausalLM, "Qwen2ForCausalLM": Qwen2ForCausalLM,
          "Qwen3ForCausalLM": Qwen3ForCausalLM}  # HF `architectures[0]` -> model class


def get_model_class(hf_config) -> type:
    arch = (getattr(hf_config, "architectures", None) or [None])[0]
    if arch not in MODELS:
        raise ValueError(f"unsupported model architecture {arch!r} (config.json 'architectures'); "
                         f"supported: {', '.join(sorted(MODELS))}")
    return MODELS[arch]
