"""Model implementations. `get_model_class(hf_config)(hf_config, attention_backend)` (an instance from
`layers.attention.make_backend`), then `load_weights(model, model_dir)`."""
from nanoserve.models.loader import load_weights
from nanoserve.models.registry import MODELS, get_model_class

__all__ = ["MODELS", "get_model_class", "load_weights"]
