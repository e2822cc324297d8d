"""What the stub, `nanoserve serve` and the OpenAI API all need: a model's model.json and engine arguments, how an
engine model names its mode, reports a failed engine and takes control requests, and the tensor contracts
(contracts/)."""
