"""Outputs in one place (docs/architecture.md, "Output processor"): per sequence its detokenizer, the stop rule
and the RequestOutputs a step produces: every step it samples when streamed, else when it finishes."""
from __future__ import annotations

from itertools import compress, count
from operator import attrgetter

import numpy as np

from nanoserve.engine.detokenizer import IncrementalDetokenizer
from nanoserve.engine.model_runner import RunnerOutput
from nanoserve.engine.outputs import PromptLogprobs, RequestOutput
from nanoserve.engine.scheduler import SampledSeqs
from nanoserve.engine.sequence import Sequence


class Samples:
    """The n > 1 sequences of one request: their ids, and how many have not finished."""
    __slots__ = ("sequence_ids", "num_unfinished")

    def __init__(self, sequence_ids: list[str]):
        self.sequence_ids, self.num_unfinished = sequence_ids, len(sequence_ids)


class RequestState:
    __slots__ = ("seq", "detokenizer", "stream", "stop_token_ids", "wants_logprobs", "needs_text", "watched",
                 "logprobs", "logprob_ranks", "cumulative_logprob", "request_id", "index", "samples",
                 "prompt_logprobs", "deferrable")

    def __init__(self, seq: Sequence, detokenizer: IncrementalDetokenizer, stream: bool, request_id: str,
                 index: int = 0, samples: Samples | None = None):
        self.seq, self.detokenizer, self.stream = seq, detokenizer, stream
        self.request_id, self.index, self.samples = request_id, index, samples  # samples: None when n is 1
        params = seq.sampling_params
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.wants_logprobs = params.logprobs is not None
        self.needs_text = stream or bool(detokenizer.stop)  # detokenized at every step
        # looked at every step, not only near a stop
        self.watched = self.needs_text or self.wants_logprobs or seq.grammar is not None
        self.logprobs: list[dict[int, float]] = []  # per generated token: {token_id: logprob}
        self.logprob_ranks: list[int] = []  # per generated token: its rank in the vocabulary
        self.cumulative_logprob = 0.0  # summed only while watched
        self.prompt_logprobs = None  # filled as the prompt is computed (with the prompt_logprobs parameter)
        if params.prompt_logprobs is not None:
            prompt = seq.token_ids[1:seq.num_prompt_tokens]
            self.prompt_logprobs = PromptLogprobs(prompt, [None] * len(prompt), [0] * len(prompt))
        # a stream whose end its token ids alone decide: its outputs can be made after the next step is launched
        self.deferrable = stream and not detokenizer.stop and seq.grammar is None and self.prompt_logprobs is None


_request_id = attrgetter("request_id")


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids, vocab_size: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, RequestState] = {}  # by sequence id (a request's id when n is 1)
        self.samples: dict[str, Samples] = {}  # the requests with n > 1, by request id
        self.watched: set[str] = set()  # the sequences looked at every step
        self.constrained: set[str] = set()  # the sequences with structured outputs (a grammar)
        # streamed sequences whose prompt logprobs go with their first output, by (request id, index)
        self.prompt_logprobs_due: dict[tuple[str, int], RequestState] = {}
        self._rows: tuple[list[Sequence], list[RequestState]] = ([], [])  # the last step's sequences and states
        self.num_dropped_tokens = 0  # tokens of accepted runs after a stop (speculative decoding)
        self.deferred: list[tuple] = []  # rows whose outputs emit_deferred() makes (process(defer=True))
        self.may_stop = np.zeros(vocab_size, dtype=bool)  # ids that may stop some request: EOS, stop_token_ids
        self._mark_stop_ids(self.eos_token_ids)
        IncrementalDetokenizer(tokenizer)  # builds the tokenizer's byte table now, not at the first request

    def _mark_stop_ids(self, token_ids) -> None:
        for token_id in token_ids:
            if 0 <= token_id < len(self.may_stop):
                self.may_stop[token_id] = True

    def add(self, request_id: str, seqs: list[Sequence], stream: bool) -> None:
        """A request's sequences: one, or its n samples in order."""
        samples = None
        if len(seqs) > 1:
            samples = self.samples[request_id] = Samples([seq.request_id for seq in seqs])
        for index, seq in enumerate(seqs):
            params = seq.sampling_params
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop,
                                                 params.include_stop_str_in_output)
            state = self.requests[seq.request_id] = RequestState(seq, detokenizer, stream, request_id, index, samples)
            if state.watched:
                self.watched.add(seq.request_id)
            if seq.grammar is not None:
                self.constrained.add(seq.request_id)
            if stream and state.prompt_logprobs is not None:
                self.prompt_logprobs_due[request_id, index] = state
            self._mark_stop_ids(params.stop_token_ids)

    def sequence_ids(self, request_id: str) -> list[str]:
        """The ids of a request's sequences (the request's own id when n is 1), finished ones included."""
        samples = self.samples.get(request_id)
        return list(samples.sequence_ids) if samples is not None else [request_id]

    def request_ids(self) -> set[str]:
        """The requests that have not finished."""
        if not self.samples:
            return set(self.requests)
        return {state.request_id for state in self.requests.values()}

    def abort(self, request_id: str) -> list[RequestOutput]:
        """The final outputs of an aborted request's unfinished sequences (what each generated, reason "abort");
        none if it is unknown. The deferred outputs come first (they may be the request's own)."""
        if request_id not in self.samples and request_id not in self.requests:
            return []
        outputs = self.emit_deferred()
        for sequence_id in self.sequence_ids(request_id):
            state = self.requests.pop(sequence_id, None)
            if state is None:
                continue
            self.watched.discard(sequence_id)
            self.constrained.discard(sequence_id)
            self.prompt_logprobs_due.pop((request_id, state.index), None)
            self._rows = [], []
            done, seq = self._sequence_done(state), state.seq
            if not state.stream:
                outputs.append(self._final_output(state, "abort", done))
                continue
            outputs.append(RequestOutput(request_id, [], state.detokenizer.flush(), done, "abort",
                                         seq.num_prompt_tokens, seq.num_output_tokens, state.cumulative_logprob, [],
                                         seq.num_cached_tokens, index=state.index))
        return outputs

    def take_dropped_tokens(self) -> int:
        """The tokens of accepted runs that came after a stop since the last call (they are not output)."""
        dropped, self.num_dropped_tokens = self.num_dropped_tokens, 0
        return dropped

    def scored(self, seq: Sequence) -> RequestOutput:
        """The one output of a sequence with max_tokens 0, once its prompt is computed: no tokens, reason "length",
        its prompt logprobs when it asked for them."""
        state = self.requests.pop(seq.request_id)
        self.watched.discard(seq.request_id)
        self.constrained.discard(seq.request_id)
        self.prompt_logprobs_due.pop((state.request_id, state.index), None)
        self._rows = [], []
        return self._final_output(state, "length", self._sequence_done(state), prompt_computed=True)

    def _sequence_done(self, state: RequestState) -> bool:
        """A sequence of the request has finished: True when it was the last one."""
        samples = state.samples
        if samples is not None:
            samples.num_unfinished -= 1
            if samples.num_unfinished:
                return False
            del self.samples[state.request_id]
        return True

    def _add_prompt_logprobs(self, chunks: dict[str, tuple[int, PromptLogprobs]]) -> None:
        """A step's prompt logprobs, per sequence (from its first prompt token's index). A prompt computed again
        after a preemption writes the same places again."""
        for sequence_id, (start, chunk) in chunks.items():
            state = self.requests.get(sequence_id)
            if state is not None and state.prompt_logprobs is not None:
                whole, end = state.prompt_logprobs, start - 1 + len(chunk.token_ids)
                whole.logprobs[start - 1:end], whole.ranks[start - 1:end] = chunk.logprobs, chunk.ranks

    def process(self, sampled_seqs: SampledSeqs, sampled: RunnerOutput, outputs: list[RequestOutput],
                defer: bool = False) -> list[tuple[Sequence, str]]:
        """After the scheduler appended the sampled tokens: add this step's RequestOutputs to `outputs`; returns
        the sequences that finish, with their reasons. defer: the outputs of deferrable streams are left for
        emit_deferred() (their ends are decided now). The loop body runs for every streamed request at every
        step, so its common path is written out here rather than split into calls."""
        if sampled.prompt_logprobs:
            self._add_prompt_logprobs(sampled.prompt_logprobs)
        seqs = sampled_seqs.seqs
        stopping = self.may_stop.take(sampled.token_ids, mode="clip")
        stopping |= sampled_seqs.num_tokens >= sampled_seqs.max_num_tokens
        looked_at = self._looked_at(seqs, stopping)
        if looked_at is not None and not looked_at.any():
            return []
        states = self._states(seqs)
        rows = zip(states, sampled.token_ids.tolist(), sampled.logprobs.tolist(), stopping.tolist(), count())
        if looked_at is not None:
            rows = compress(rows, looked_at.tolist())
        finished = []
        runs = sampled.num_tokens is not None  # rows verified proposals: a sequence may have several tokens
        defer = defer and not runs
        for state, token_id, logprob, may_stop, row in rows:
            seq = state.seq
            if runs and seq.request_id not in self.requests:
                continue  # it stopped at an earlier token of its run
            if defer and state.deferrable:
                self._defer(state, token_id, logprob, may_stop, sampled, row, finished)
                continue
            new_logprobs = new_ranks = []
            if state.watched:  # a request not looked at every step has no cumulative logprob (None in its output)
                state.cumulative_logprob += logprob
                if state.wants_logprobs:
                    new_logprobs, new_ranks = self._logprob_entry(state, token_id, logprob, sampled.top_logprobs[row])
            detokenizer = state.detokenizer
            delta = detokenizer.add_token(token_id) if state.needs_text else ""
            reason, done = None, False
            grammar_ends = seq.grammar is not None and seq.grammar.advance(token_id)
            if may_stop or grammar_ends or detokenizer.stop_matched is not None:
                num_tokens = int(sampled_seqs.num_tokens[row])  # the sequence's length with this token
                reason = "stop" if grammar_ends or detokenizer.stop_matched is not None else \
                    self._finish_reason(state, token_id, num_tokens)
                if reason is not None:
                    done = self._finish(state, reason, num_tokens, finished)
                    if not state.stream:
                        outputs.append(self._final_output(state, reason, done))
                        continue
                    delta += detokenizer.flush()
            if state.stream:
                output = RequestOutput(state.request_id, [token_id], delta, done, reason, seq.num_prompt_tokens,
                                       len(seq.token_ids) - seq.num_prompt_tokens, state.cumulative_logprob,
                                       new_logprobs, seq.num_cached_tokens, new_ranks, state.index)
                if runs:
                    output = self._run_output(state, output, outputs, int(sampled_seqs.num_tokens[row]))
                outputs.append(output)
        if self.prompt_logprobs_due:
            self._attach_prompt_logprobs(outputs)
        if finished:
            self._rows = [], []  # a finished request's state is not kept alive
        return finished

    def _looked_at(self, seqs: list[Sequence], stopping: np.ndarray) -> np.ndarray | None:
        """The rows process() looks at: None for every row (all streamed, say), else a mask of those that may stop
        and those watched at every step."""
        if len(self.watched) == len(self.requests):
            return None
        if not self.watched:
            return stopping
        return stopping | np.fromiter(map(self.watched.__contains__, map(_request_id, seqs)), bool)

    def _finish(self, state: RequestState, reason: str, num_tokens: int,
                finished: list[tuple[Sequence, str]]) -> bool:
        """The sequence ends at its num_tokens-th token (tokens of its run after the stop are dropped); True when it
        was its request's last sequence."""
        seq = state.seq
        self.num_dropped_tokens += len(seq.token_ids) - num_tokens
        del seq.token_ids[num_tokens:]
        finished.append((seq, reason))
        del self.requests[seq.request_id]
        self.watched.discard(seq.request_id)
        self.constrained.discard(seq.request_id)
        return self._sequence_done(state)

    def _defer(self, state: RequestState, token_id: int, logprob: float, may_stop: bool, sampled: RunnerOutput,
               row: int, finished: list[tuple[Sequence, str]]) -> None:
        """Decide now whether a deferrable stream ends here; leave its output for emit_deferred()."""
        seq, reason, done = state.seq, None, False
        num_tokens = len(seq.token_ids)
        if may_stop:
            reason = self._finish_reason(state, token_id, num_tokens)
            if reason is not None:
                done = self._finish(state, reason, num_tokens, finished)
                self._rows = [], []
        top = sampled.top_logprobs[row] if state.wants_logprobs else None
        self.deferred.append((state, token_id, logprob, top, num_tokens - seq.num_prompt_tokens, reason, done))

    def emit_deferred(self) -> list[RequestOutput]:
        """The outputs process(defer=True) left, in order: detokenized and logprobs made now (after the next step
        is launched, so that this work overlaps it)."""
        outputs, deferred, self.deferred = [], self.deferred, []
        for state, token_id, logprob, top, num_output_tokens, reason, done in deferred:
            new_logprobs = new_ranks = []
            state.cumulative_logprob += logprob
            if top is not None:
                new_logprobs, new_ranks = self._logprob_entry(state, token_id, logprob, top)
            detokenizer, seq = state.detokenizer, state.seq
            delta = detokenizer.add_token(token_id)
            if reason is not None:
                delta += detokenizer.flush()
            outputs.append(RequestOutput(state.request_id, [token_id], delta, done, reason, seq.num_prompt_tokens,
                                         num_output_tokens, state.cumulative_logprob, new_logprobs,
                                         seq.num_cached_tokens, new_ranks, state.index))
        return outputs

    def _states(self, seqs: list[Sequence]) -> list[RequestState]:
        """The states of a step's sequences, in row order; kept until one of them finishes, as the next steps mostly
        have the same rows (a sequence's state is the same object while it runs)."""
        if seqs != self._rows[0]:
            requests = self.requests
            self._rows = seqs, [requests[seq.request_id] for seq in seqs]
        return self._rows[1]

    def _attach_prompt_logprobs(self, outputs: list[RequestOutput]) -> None:
        """A streamed sequence's prompt logprobs go with its first output: they are complete once it samples."""
        for output in outputs:
            state = self.prompt_logprobs_due.pop((output.request_id, output.index), None)
            if state is not None:
                output.prompt_logprobs = state.prompt_logprobs

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

    @staticmethod
    def _run_output(state: RequestState, output: RequestOutput, outputs: list[RequestOutput],
                    num_tokens: int) -> RequestOutput:
        """One streamed output per sequence and step: a token after the first of its run joins the output of the
        ones before it (the last in outputs), which it replaces."""
        output.num_output_tokens = num_tokens - state.seq.num_prompt_tokens
        last = outputs[-1] if outputs else None
        if last is None or last.request_id != state.request_id or last.index != state.index:
            return output
        outputs.pop()
        last.new_token_ids += output.new_token_ids
        last.text_delta += output.text_delta
        last.new_logprobs = last.new_logprobs + output.new_logprobs
        last.new_logprob_ranks = last.new_logprob_ranks + output.new_logprob_ranks
        last.finished, last.finish_reason = output.finished, output.finish_reason
        last.num_output_tokens, last.cumulative_logprob = output.num_output_tokens, output.cumulative_logprob
        return last

    def _finish_reason(self, state: RequestState, token_id: int, num_tokens: int) -> str | None:
        """Why the sequence stops at token_id, which makes it num_tokens long (None: it goes on)."""
        seq = state.seq
        params = seq.sampling_params
        if num_tokens - seq.num_prompt_tokens >= params.min_tokens and (
                token_id in state.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids)):
            return "stop"
        if num_tokens >= seq.max_num_tokens:
            return "length"
        return None

    @staticmethod
    def _final_output(state: RequestState, reason: str, done: bool, prompt_computed: bool = False) -> RequestOutput:
        """The one output of a sequence that is not streamed (or scored): all its tokens, text and logprobs (and
        the prompt's, once it has been computed: the sequence sampled, or was scored)."""
        seq, detokenizer = state.seq, state.detokenizer
        if not state.needs_text:
            detokenizer.add(seq.output_token_ids)
        detokenizer.flush()
        return RequestOutput(state.request_id, seq.output_token_ids, detokenizer.text, done, reason,
                             seq.num_prompt_tokens, seq.num_output_tokens,
                             state.cumulative_logprob if state.watched else None, list(state.logprobs),
                             seq.num_cached_tokens, list(state.logprob_ranks), state.index,
                             state.prompt_logprobs if seq.num_output_tokens or prompt_computed else None)
