"""nanoserve: a small continuous-batching LLM engine, served through NVIDIA Triton Inference Server."""
from nanoserve.openmp import load_intel_openmp

load_intel_openmp()  # before anything imports torch (see openmp.py)

from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402


def __getattr__(name):
    # LLM pulls in torch models and the engine; import it lazily so light users (the CLI, clients) stay light.
    if name == "LLM":
        from nanoserve.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]
