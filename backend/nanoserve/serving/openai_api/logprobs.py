"""vllm_backend's logprobs (per token {token_id: {"logprob", "rank", "decoded_token"}}, the sampled token first)
as OpenAI's two shapes: chat's `logprobs.content` and the completions endpoint's legacy lists."""
from __future__ import annotations


def chat_logprobs(entries: list[dict], top_n: int) -> list[dict]:
    """Chat: per token {"token", "logprob", "bytes", "top_logprobs": the top_n most likely, by rank}."""
    content = []
    for entry in entries:
        values = list(entry.values())
        top = sorted((v for v in values if v["rank"] <= top_n), key=lambda v: v["rank"])[:top_n]
        content.append({**_token(values[0]), "top_logprobs": [_token(v) for v in top]})
    return content


def _token(value: dict) -> dict:
    text = value["decoded_token"]
    return {"token": text, "logprob": value["logprob"], "bytes": list(text.encode())}


def completion_logprobs(entries: list[dict], text_offset: int, top_n: int) -> dict:
    """Completions: parallel lists of the tokens, their logprobs, {token: logprob} of the token and the top_n most
    likely, and each token's offset in the text (starting at text_offset); "end": the offset after the last."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        values = list(entry.values())
        tokens.append(values[0]["decoded_token"])
        token_logprobs.append(values[0]["logprob"])
        top_logprobs.append({v["decoded_token"]: v["logprob"] for v in _top(values, top_n)})
        offsets.append(text_offset)
        text_offset += len(values[0]["decoded_token"])
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets, "end": text_offset}


def _top(values: list[dict], top_n: int) -> list[dict]:
    """The token's own value, then those ranked within top_n (the engine may have computed more)."""
    return [values[0], *(v for v in values[1:] if v["rank"] <= top_n)]


def top_prompt_logprobs(entries: list | None, top_n: int) -> list | None:
    """vLLM's prompt_logprobs: per prompt token (None for the first) {token_id: {"logprob", "rank",
    "decoded_token"}} of the token and the top_n most likely."""
    if entries is None:
        return None
    return [None if entry is None else {k: v for k, v in entry.items() if k == next(iter(entry)) or v["rank"] <= top_n}
            for entry in entries]
