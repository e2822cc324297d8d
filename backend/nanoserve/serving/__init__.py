"""Serving nanoserve through tritonserver, in folders by where the code runs:

    stub/        inside tritonserver's Python backend stub (backend/model.py, the ensemble's models), and the
                 engine core process a stub may start
    serve/       the `nanoserve serve` process: preflight, the tritonserver process, its supervisor, the drain
    openai_api/  the OpenAI-compatible API (a Triton gRPC client; `nanoserve serve` runs it on a thread)
    shared/      what more than one of them needs: model.json and engine arguments, the engine model's words, the
                 tensor contracts (shared/contracts/: each model's tensors, and a client's requests and responses)
    workarounds.py  the code that exists because of a tritonserver release, each with the test that shows it

stub/, serve/ and openai_api/ import nothing of each other (import-linter checks it).
"""
