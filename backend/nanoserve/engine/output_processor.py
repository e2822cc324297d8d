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
from nanoserve.engine.scheduler import SampledSeqs
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
    new_logprob_ranks: list[int] = field(default_factory=list)  # each new token's rank, with new_logprobs


class RequestState:
    __slots__ = ("seq", "detokenizer", "stream", "stop_token_ids", "wants_logprobs", "needs_text", "watched",
                 "logprobs", "logprob_ranks", "cumulative_logprob")

    def __init__(self, seq: Sequence, detokenizer: IncrementalDetokenizer, stream: bool):
        self.seq, self.detokenizer, self.stream = seq, detokenizer, stream
        params = seq.sampling_params
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.wants_logprobs = params.logprobs is not None
        self.needs_text = stream or bool(detokenizer.stop)  # detokenized at every step
        self.watched = self.needs_text or self.wants_logprobs  # looked at every step, not only near a stop
        self.logprobs: list[dict[int, float]] = []  # per generated token: {token_id: logprob}
        self.logprob_ranks: list[int] = []  # per generated token: its rank in the vocabulary
        self.cumulative_logprob = 0.0  # summed only while watched


_request_id = attrgetter("request_id")


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids, vocab_size: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, RequestState] = {}
        self.watched: set[str] = set()  # the requests looked at every step
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
        state = self.requests[seq.request_id] = RequestState(seq, detokenizer, stream)
        if state.watched:
            self.watched.add(seq.request_id)
        self._mark_stop_ids(params.stop_token_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """The final output of an aborted request (what it generated, reason "abort"); None if unknown."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self.watched.discard(request_id)
        if state.stream:
            return self._output(state, [], state.detokenizer.flush(), "abort")
        return self._final_output(state, "abort")

    def process(self, sampled_seqs: SampledSeqs, sampled: RunnerOutput,
                outputs: list[RequestOutput]) -> list[tuple[Sequence, str]]:
        """After the scheduler appended the sampled tokens: add this step's RequestOutputs to `outputs`; returns
        the sequences that finish, with their reasons. The loop body runs for every streamed request at every
        step, so its common path is written out here rather than split into calls."""
        seqs, requests = sampled_seqs.seqs, self.requests
        stopping = self.may_stop.take(sampled.token_ids, mode="clip")
        stopping |= sampled_seqs.num_tokens >= sampled_seqs.max_num_tokens
        if len(self.watched) == len(requests):  # every request is looked at (streamed, say)
            rows, states = range(len(seqs)), [requests[seq.request_id] for seq in seqs]
        else:
            looked_at = stopping
            if self.watched:
                looked_at = stopping | np.fromiter(map(self.watched.__contains__, map(_request_id, seqs)), bool)
            rows = looked_at.nonzero()[0].tolist()
            states = {row: requests[seqs[row].request_id] for row in rows}
        if not rows:
            return []
        token_ids, logprobs, stopping, finished = sampled.token_ids.tolist(), sampled.logprobs.tolist(), \
            stopping.tolist(), []
        for row in rows:
            seq, token_id, state = seqs[row], token_ids[row], states[row]
            new_logprobs = new_ranks = []
            if state.watched:  # a request not looked at every step has no cumulative logprob (None in its output)
                state.cumulative_logprob += logprobs[row]
                if state.wants_logprobs:
                    new_logprobs, new_ranks = self._logprob_entry(state, token_id, logprobs[row],
                                                                  sampled.top_logprobs[row])
            detokenizer = state.detokenizer
            delta = detokenizer.add_token(token_id) if state.needs_text else ""
            reason = None
            if stopping[row] or detokenizer.stop_matched is not None:
                reason = "stop" if detokenizer.stop_matched is not None else self._finish_reason(state, token_id)
                if reason is not None:
                    finished.append((seq, reason))
                    del requests[seq.request_id]
                    self.watched.discard(seq.request_id)
                    if not state.stream:
                        outputs.append(self._final_output(state, reason))
                        continue
                    delta += detokenizer.flush()
            if state.stream:
                outputs.append(RequestOutput(seq.request_id, [token_id], delta, reason is not None, reason,
                                             seq.num_prompt_tokens, len(seq.token_ids) - seq.num_prompt_tokens,
                                             state.cumulative_logprob, new_logprobs, seq.num_cached_tokens,
                                             new_ranks))
        return finished

    @staticmethod
    def _logprob_entry(state: RequestState, token_id: int, logprob: float, top) -> tuple[list[dict], list[int]]:
        """[{token_id: logprob} of the request's top-n tokens and the sampled one], [the sampled token's rank]."""
        count = state.seq.sampling_params.logprobs
        top_ids, top_logprobs, rank = top
        entry = dict(zip(top_ids[:count], top_logprobs[:count]))
        entry[token_id] = logprob
        state.logprobs.append(entry)
        state.logprob_ranks.append(rank)
        return [entry], [rank]

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
                             seq.num_cached_tokens, list(state.logprob_ranks))
