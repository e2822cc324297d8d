"""An OpenAI-compatible HTTP API in front of tritonserver: /v1/models, /v1/completions, /v1/chat/completions.

It is a Triton client like any other: each request goes to a text model (backend nanoserve, mode text) over
gRPC streaming with vllm_backend's tensors. `nanoserve serve` runs it (server.OpenAIServer) once the models
are ready.
"""
