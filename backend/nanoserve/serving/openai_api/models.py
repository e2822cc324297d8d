"""Which Triton models the API serves (the ready text models: backend nanoserve, mode text) and their
tokenizers (for chat templates), read from the model repository's model.json like the ensemble's."""
from __future__ import annotations

import asyncio
from pathlib import Path

import tritonclient.grpc.aio as grpcaio
from transformers import AutoTokenizer

from nanoserve.serving.model_json import tokenizer_dir
from nanoserve.serving.openai_api.errors import APIError


def is_text_model(config: dict) -> bool:
    mode = config.get("parameters", {}).get("mode", {}).get("string_value", "") or "text"
    return config.get("backend") == "nanoserve" and mode == "text"


class ModelRegistry:
    def __init__(self, client: grpcaio.InferenceServerClient, repository: Path):
        self.client = client
        self.repository = repository
        self.versions: dict[str, str] = {}  # text model -> its ready version
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
        self.versions = versions
        return list(versions)

    async def require(self, name: str) -> None:
        if name not in self.versions and name not in await self.refresh():
            raise APIError(404, f"model: {name!r} is not a text model served here (GET /v1/models lists them)",
                           "model", "model_not_found")

    async def tokenizer(self, name: str):
        if name not in self._tokenizers:
            directory = tokenizer_dir(str(self.repository / name), self.versions[name])
            self._tokenizers[name] = await asyncio.to_thread(AutoTokenizer.from_pretrained, directory)
        return self._tokenizers[name]
