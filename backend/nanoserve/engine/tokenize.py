"""How a text prompt becomes token ids: one definition for the engine, the serving front end and the ensemble's
preprocessing model, so that every path feeds the model the same ids. Imports nothing heavy."""


def encode_prompt_text(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=True)
