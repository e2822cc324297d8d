"""What the engine gives out: a request's RequestOutputs, and the logprobs of its prompt. Plain data, so that
whoever only carries them (the Triton stub, the engine core's messages) imports no torch."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PromptLogprobs:
    """Logprobs of consecutive prompt tokens, each given the tokens before it: per token its id, {token_id: logprob}
    of the most likely tokens and itself, and its rank in the vocabulary."""
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # None where not computed yet
    ranks: list[int]


@dataclass(slots=True)  # slots: one is built per streamed request per step, and that is cheaper with slots
class RequestOutput:
    """What one step produced for one request. `text_delta`s concatenate to the final text."""
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_output_tokens: int
    cumulative_logprob: float | None = 0.0  # None for a request neither streamed nor asking for logprobs
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_cached_tokens: int = 0
    new_logprob_ranks: list[int] = field(default_factory=list)  # each new token's rank, with new_logprobs
    index: int = 0  # which of the request's n samples this output is about (finish_reason is that sample's)
    # with the prompt_logprobs parameter: on the request's first output when streamed, else on its last
    prompt_logprobs: PromptLogprobs | None = None


def joined(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One sample's two consecutive outputs as one: `later`, holding `earlier`'s tokens, text and logprobs before
    its own (its counts and finish state are the latest already). Sets later's fields in place: a server joins
    outputs for every stream at every step."""
    return joined_all((earlier, later))


def joined_all(outputs: list[RequestOutput] | tuple[RequestOutput, ...]) -> RequestOutput:
    """One sample's consecutive outputs as one, the last holding every one's tokens, text and logprobs in order
    (and the first prompt logprobs given), in one pass: a server keeps a stream's steps and joins them once per
    response."""
    last = outputs[-1]
    last.new_token_ids = [token_id for output in outputs for token_id in output.new_token_ids]
    last.text_delta = "".join([output.text_delta for output in outputs])
    last.new_logprobs = [entry for output in outputs for entry in output.new_logprobs]
    last.new_logprob_ranks = [rank for output in outputs for rank in output.new_logprob_ranks]
    last.prompt_logprobs = next((output.prompt_logprobs for output in outputs if output.prompt_logprobs), None)
    return last
