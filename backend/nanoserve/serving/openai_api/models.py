"""Which Triton models the API serves (the ready text models: backend nanoserve, mode text) and their
tokenizers (for chat templates), read from the model repository's model.json like the ensemble's. A request's
`model` may also name a LoRA adapter of a text model (its multi_lora.json), as in vLLM's API."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import tritonclient.grpc.aio as grpcaio
from transformers import AutoTokenizer

from nanoserve.serving.openai_api.errors import APIError
from nanoserve.serving.shared.engine_model import is_text_model
from nanoserve.serving.shared.model_json import lora_modules, tokenizer_dir


@dataclass
class Target:
    """What a request's `model` names: the Triton text model, and the LoRA adapter it runs with (None: none)."""
    model: str
    lora_name: str | None = None


class ModelRegistry:
    def __init__(self, client: grpcaio.InferenceServerClient, repository: Path):
        self.client = client
        self.repository = repository
        self.versions: dict[str, str] = {}  # text model -> its ready version
        self.adapters: dict[str, str] = {}  # LoRA adapter -> the text model serving it (the first one)
        self._tokenizers: dict[str, object] = {}

    async def refresh(self) -> list[str]:
        """The ready text models, in Triton's order."""
        index = await self.client.get_model_repository_index(as_json=True)
        versions = {}
        for model in index.get("models", []):
            if model.get("state") != "READY":
                continue
            config = (await self.client.get_model_config(model["name"], as_json=True))["config"]
            if is_text_model(config):
                versions[model["name"]] = model.get("version") or "1"
        adapters = {}
        for name, version in versions.items():
            for adapter in lora_modules(str(self.repository / name), version):
                adapters.setdefault(adapter, name)
        self.versions, self.adapters = versions, adapters
        return list(versions)

    async def require(self, name: str) -> Target:
        if name not in self.versions and name not in self.adapters:
            await self.refresh()
        if name in self.versions:
            return Target(name)
        if name in self.adapters:
            return Target(self.adapters[name], name)
        raise APIError(404, f"model: {name!r} is not a text model or LoRA adapter served here (GET /v1/models "
                       "lists them)", "model", "model_not_found")

    async def tokenizer(self, name: str):
        if name not in self._tokenizers:
            directory = tokenizer_dir(str(self.repository / name), self.versions[name])
            self._tokenizers[name] = await asyncio.to_thread(AutoTokenizer.from_pretrained, directory)
        return self._tokenizers[name]
