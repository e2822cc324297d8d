"""The tensor contracts of nanoserve's Triton models, one owner each:

    vllm_text.py       vllm_backend's text model (text_input or input_ids -> text_output, one entry per sequence)
    trtllm_scalars.py  TRT-LLM's sampling scalars (max_tokens, temperature, ...) and stop_words, which every model
                       (the text model, the token model, the ensemble) takes besides sampling_parameters
    token_model.py     the ensemble: its token-level engine model (input_ids -> output_ids + decode context), the
                       pre/postprocessing steps around it and the ensemble's own inputs and outputs

Each holds its tensors' names, types and dims once (`TensorSpec`, tensors.py), which the stub declares
(backend/model.py's auto_complete_config) and model_repository/*/config.pbtxt is tested against; the client half
that encodes a request (tritonclient gRPC inputs, HTTP /generate JSON) and decodes a response into a typed
object, used by the OpenAI API, client/stream.py and `nanoserve serve`'s drain and liveness; and the names the
stub's parser (stub/request.py) and formatters (stub/responses.py, stub/ensemble.py) read and write.
"""
