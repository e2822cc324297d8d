"""Outputs in one place: per request its detokenizer, the stop rule (EOS, stop_token_ids, stop strings, the
length limit) and the RequestOutputs a step produces.

A streamed request gets a RequestOutput (new tokens, text delta) every step it samples; any other only when it
finishes, with all its tokens and text, and is detokenized per step only when stop strings need the text. The
rows that need no Python this step (not streamed, no stop strings or logprobs, below their length limit, and
whose token cannot stop them) cost a few numpy calls over the batch."""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from nanoserve.engine.detokenizer import IncrementalDetokenizer
from nanoserve.engine.model_runner import RunnerOutput
from nanoserve.engine.sequence import Sequence


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


class RequestState:
    __slots__ = ("seq", "detokenizer", "stream", "stop_token_ids", "wants_logprobs", "needs_text", "watched",
                 "logprobs", "cumulative_logprob")

    def __init__(self, seq: Sequence, detokenizer: IncrementalDetokenizer, stream: bool):
        self.seq, self.detokenizer, self.stream = seq, detokenizer, stream
        params = seq.sampling_params
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.wants_logprobs = params.logprobs is not None
        self.needs_text = stream or bool(detokenizer.stop)  # detokenized at every step
        self.watched = self.needs_text or self.wants_logprobs  # looked at every step, not only near a stop
        self.logprobs: list[dict[int, float]] = []  # per generated token: {token_id: logprob}
        self.cumulative_logprob = 0.0  # summed only while watched


_request_id = attrgetter("request_id")
_token_ids = attrgetter("token_ids")
_watched = attrgetter("watched")
_max_num_tokens = attrgetter("max_num_tokens")


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids, vocab_size: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, RequestState] = {}
        self.may_stop = np.zeros(vocab_size, dtype=bool)  # ids that may stop some request: EOS, stop_token_ids
        self._mark_stop_ids(self.eos_token_ids)
        IncrementalDetokenizer(tokenizer)  # builds the tokenizer's byte table now, not at the first request

    def _mark_stop_ids(self, token_ids) -> None:
        for token_id in token_ids:
            if 0 <= token_id < len(self.may_stop):
                self.may_stop[token_id] = True

    def add(self, seq: Sequence, stream: bool) -> None:
        params = seq.sampling_params
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop,
                                             params.include_stop_str_in_output)
        self.requests[seq.request_id] = RequestState(seq, detokenizer, stream)
        self._mark_stop_ids(params.stop_token_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """The final output of an aborted request (what it generated, reason "abort"); None if unknown."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        if state.stream:
            return self._output(state, [], state.detokenizer.flush(), "abort")
        return self._final_output(state, "abort")

    def process(self, seqs: list[Sequence], sampled: RunnerOutput,
                outputs: list[RequestOutput]) -> list[tuple[Sequence, str]]:
        """After the scheduler appended the sampled tokens (seqs: the sampling rows, in order): add this step's
        RequestOutputs to `outputs`; returns the sequences that finish, with their reasons."""
        states = list(map(self.requests.__getitem__, map(_request_id, seqs)))
        num_rows = len(seqs)
        lengths = np.fromiter(map(len, map(_token_ids, seqs)), np.int64, num_rows)
        at_limit = lengths >= np.fromiter(map(_max_num_tokens, seqs), np.int64, num_rows)
        stopping = self.may_stop.take(sampled.token_ids, mode="clip") | at_limit
        looked_at = np.flatnonzero(np.fromiter(map(_watched, states), bool, num_rows) | stopping).tolist()
        token_ids, logprobs, stopping = sampled.token_ids.tolist(), sampled.logprobs, stopping.tolist()
        finished = []
        for row in looked_at:
            state, token_id = states[row], token_ids[row]
            reason = self._step_request(state, token_id, float(logprobs[row]), sampled.top_logprobs.get(row),
                                        stopping[row], outputs)
            if reason is not None:
                finished.append((state.seq, reason))
        return finished

    def _step_request(self, state: RequestState, token_id: int, logprob: float, top, may_stop: bool,
                      outputs: list[RequestOutput]) -> str | None:
        """One looked-at request's new token: logprobs, text, the stop rule, its output; returns the finish reason."""
        new_logprobs = []
        if state.watched:  # a request not looked at every step has no cumulative logprob (None in its output)
            state.cumulative_logprob += logprob
        if state.wants_logprobs:
            count = state.seq.sampling_params.logprobs
            entry = dict(zip(top[0][:count], top[1][:count])) if top is not None else {}
            entry[token_id] = logprob
            new_logprobs = [entry]
            state.logprobs.append(entry)
        detokenizer = state.detokenizer
        delta = detokenizer.add_token(token_id) if state.needs_text else ""
        reason = None
        if detokenizer.stop_matched is not None:
            reason = "stop"
        elif may_stop:
            reason = self._finish_reason(state, token_id)
        if reason is not None:
            del self.requests[state.seq.request_id]
            if not state.stream:
                outputs.append(self._final_output(state, reason))
                return reason
            delta += detokenizer.flush()
        if state.stream:
            outputs.append(self._output(state, [token_id], delta, reason, new_logprobs))
        return reason

    def _finish_reason(self, state: RequestState, token_id: int) -> str | None:
        seq = state.seq
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens and (
                token_id in state.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids)):
            return "stop"
        if seq.num_tokens >= seq.max_num_tokens:
            return "length"
        return None

    @staticmethod
    def _output(state: RequestState, token_ids: list[int], delta: str, reason: str | None,
                new_logprobs=()) -> RequestOutput:
        seq = state.seq
        return RequestOutput(seq.request_id, token_ids, delta, reason is not None, reason, seq.num_prompt_tokens,
                             seq.num_output_tokens, state.cumulative_logprob, list(new_logprobs),
                             seq.num_cached_tokens)

    @staticmethod
    def _final_output(state: RequestState, reason: str) -> RequestOutput:
        """The one output of a request that is not streamed: all its tokens, text and logprobs."""
        seq, detokenizer = state.seq, state.detokenizer
        if not state.needs_text:
            detokenizer.add(seq.output_token_ids)
        detokenizer.flush()
        return RequestOutput(seq.request_id, seq.output_token_ids, detokenizer.text, True, reason,
                             seq.num_prompt_tokens, seq.num_output_tokens,
                             state.cumulative_logprob if state.watched else None, list(state.logprobs),
                             seq.num_cached_tokens)
