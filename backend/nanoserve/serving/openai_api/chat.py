"""Chat messages -> the prompt text, with the chat template of the model's tokenizer.

The text model tokenizes its prompt with the tokenizer's special tokens (a BOS where the tokenizer adds one),
so a template that writes the BOS itself would get it twice: the rendered text's leading BOS is dropped then.
"""
from __future__ import annotations

from nanoserve.serving.openai_api.errors import bad_request


def render_chat(tokenizer, messages: list[dict], template_kwargs: dict | None = None,
                add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
    """tools: OpenAI's tool definitions, for a template that describes them to the model."""
    if tokenizer.chat_template is None:
        raise bad_request("messages", "the model's tokenizer has no chat template (use /v1/completions)")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             tools=tools, **(template_kwargs or {}))
    except Exception as e:  # the template's own raise_exception(...) (e.g. roles must alternate), bad kwargs
        raise bad_request("messages", f"the chat template failed: {e}") from None
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and adds_bos(tokenizer):
        text = text[len(bos):]
    return text


def adds_bos(tokenizer) -> bool:
    ids = tokenizer.encode("", add_special_tokens=True)
    return bool(ids) and ids[0] == tokenizer.bos_token_id
