"""The streaming engine: add / abort requests and step the continuous batch.

Not thread-safe: one thread owns an LLMEngine (the Triton backend's engine thread, or `LLM.generate`)
and calls add_request / abort_request between steps.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np
from transformers import AutoTokenizer

from nanoserve.config import EngineConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.detokenizer import IncrementalDetokenizer
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.tokenize import encode_prompt_text, max_prompt_bytes
from nanoserve.sampling_params import SamplingParams


@dataclass(slots=True)  # slots: one is built per request per step, and that is cheaper with slots
class RequestOutput:
    """What one step produced for one request. `text_delta`s concatenate to the final text."""
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    cumulative_logprob: float | None = 0.0  # None for a request neither streamed nor asking for logprobs
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_cached_tokens: int = 0
    new_logprob_ranks: list[int] = field(default_factory=list)  # each new token's rank, with new_logprobs


@dataclass
class StepStats:
    """Token counts and time of the last step, for progress bars and benchmarks."""
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    seconds: float = 0.0


_NO_TOKEN_IDS = frozenset()


_token_ids = attrgetter("token_ids")


class _Request:
    """A request's engine-side state: its sequence, detokenizer, and what the per-token stop check reads.
    A streamed request gets a RequestOutput (new tokens, text delta) every step; any other one only when it
    finishes, with all its tokens and text, and is detokenized per step only when stop strings need the text."""
    __slots__ = ("seq", "detokenizer", "stop_token_ids", "max_num_tokens", "wants_logprobs", "stream",
                 "needs_text", "watched")

    def __init__(self, seq: Sequence, detokenizer: IncrementalDetokenizer, max_model_len: int, stream: bool):
        self.seq = seq
        self.detokenizer = detokenizer
        params = seq.sampling_params
        self.stop_token_ids = frozenset(params.stop_token_ids) if params.stop_token_ids else _NO_TOKEN_IDS
        self.max_num_tokens = min(seq.num_prompt_tokens + seq.max_tokens, max_model_len)  # "length" from here
        self.wants_logprobs = params.logprobs is not None
        self.stream = stream
        self.needs_text = stream or bool(detokenizer.stop)  # detokenized at every step
        self.watched = self.needs_text or self.wants_logprobs  # looked at every step, not only near a stop


class _StopChecks:
    """The per-step stop check of one batch of sampling sequences, as arrays over its rows: a row is looked at
    only when it is watched, its token may stop it, or it reached its length. Rebuilt when the batch changes."""

    def __init__(self, seqs: list[Sequence], requests: list[_Request], eos_token_ids: set[int], vocab_size: int):
        self.seqs = seqs
        self.requests = requests
        self.watched = np.array([r.watched for r in requests], dtype=bool)
        self.max_num_tokens = np.array([r.max_num_tokens for r in requests], dtype=np.int64)
        self.may_stop = np.zeros(vocab_size, dtype=bool)  # token ids that may stop some row: EOS, stop_token_ids
        for token_id in set(eos_token_ids).union(*(r.stop_token_ids for r in requests)):
            if 0 <= token_id < vocab_size:
                self.may_stop[token_id] = True

    def rows_to_check(self, token_array: np.ndarray, lengths: np.ndarray) -> tuple[list[int], list[bool]]:
        """(rows to look at, and per row of the batch whether it may stop this step)."""
        stopping = self.may_stop.take(token_array, mode="clip") | (lengths >= self.max_num_tokens)
        return np.flatnonzero(self.watched | stopping).tolist(), stopping.tolist()


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
        IncrementalDetokenizer(self.tokenizer, [])  # builds the tokenizer's byte table now, not at the first request
        self.max_prompt_bytes = max_prompt_bytes(self.tokenizer, config.max_model_len)  # longer texts cannot fit
        self.model_runner = ModelRunner(config)  # fixes config.num_kvcache_blocks
        self.block_manager = BlockManager(config.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.vocab_size = config.hf_config.vocab_size
        self.eos_token_ids = _eos_token_ids(config, self.tokenizer)
        self.model_runner.eos_token_id = sorted(self.eos_token_ids)  # min_tokens bans every EOS id
        self.requests: dict[str, _Request] = {}
        self.pending_outputs: list[RequestOutput] = []  # abort notices, emitted by the next step()
        self.last_step = StepStats()
        self.num_generation_tokens = 0
        self._stop_checks: _StopChecks | None = None  # of the last step's sampling sequences

    @classmethod
    def from_engine_args(cls, model: str, **engine_args) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model, **engine_args))

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams,
                    stream: bool = True) -> None:
        """Queue a request. Raises ValueError (message starting with the field) for bad input. stream=True: a
        RequestOutput every step (new tokens, text delta); False: one when it finishes, with all of them."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        sampling_params.check_against_model(self.config.max_model_len, self.vocab_size, self.config.max_logprobs)
        prompt_ids = self.tokenize(prompt)
        max_tokens = sampling_params.max_tokens
        if max_tokens is None:  # documented default: generate until a stop condition or max_model_len
            max_tokens = max(self.config.max_model_len - len(prompt_ids), 1)
        self.scheduler.check_admissible(len(prompt_ids), max_tokens)
        seq = Sequence(request_id, prompt_ids, sampling_params, max_tokens)
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, sampling_params.skip_special_tokens,
                                             sampling_params.stop, sampling_params.include_stop_str_in_output)
        self.requests[request_id] = _Request(seq, detokenizer, self.config.max_model_len, stream)
        self.scheduler.add(seq)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return encode_prompt_text(self.tokenizer, prompt, self.max_prompt_bytes)
        if not isinstance(prompt, (list, tuple)):
            raise ValueError("prompt: expected a string or a list of token ids")
        self.scheduler.check_admissible(len(prompt), 1)  # a huge prompt is rejected before the per-id checks
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt: expected a string or a list of token ids")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return list(prompt)

    def abort_request(self, request_id: str) -> bool:
        """Free the request's blocks now; its final output (reason "abort") comes with the next step()."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.abort(request_id)
        if request.stream:
            self.pending_outputs.append(self._output(request, [], request.detokenizer.flush(), "abort"))
        else:
            self.pending_outputs.append(self._final_output(request, "abort"))
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.pending_outputs)

    # ---- stepping -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """The abort notices queued since the last step, then this step's outputs. The notices are taken only
        once the step has succeeded: a step that raises loses none of them."""
        outputs: list[RequestOutput] = []
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan:
            seqs = plan.sampling_seqs  # before the step appends tokens (which changes what "samples" means)
            sampled = self.model_runner.execute(plan)
            self.scheduler.postprocess(plan, sampled.token_ids)  # appends each sampled token to its sequence
            self._check_stops(plan, seqs, sampled, outputs)
            self.num_generation_tokens += len(sampled.token_ids)
            prefill = plan.num_prefill_tokens
            self.last_step = StepStats(prefill, plan.num_batched_tokens - prefill, time.perf_counter() - started)
        else:
            self.last_step = StepStats()
        outputs, self.pending_outputs = self.pending_outputs + outputs, []
        return outputs

    def fail_and_recover(self, request_ids) -> list[str]:
        """After step() raised: drop the requests in request_ids (the suspects: those admitted or changed since
        the last step that succeeded; their blocks are freed and no output comes for them) and preempt every
        other running request by recompute (blocks freed, back to waiting, its tokens kept), so step() can be
        retried without the suspects. Returns the ids dropped (the caller fails them).
        The retry repeats the failed step for the others when it failed before its results were applied
        (scheduling, the forward pass, sampling): seeded and greedy requests then get the same tokens."""
        dropped = [request_id for request_id in request_ids if self.requests.pop(request_id, None) is not None]
        for request_id in dropped:
            self.scheduler.abort(request_id)
        self.scheduler.preempt_all()
        self._stop_checks = None
        return dropped

    def _check_stops(self, plan, seqs: list[Sequence], sampled, outputs: list[RequestOutput]) -> None:
        """After the scheduler appended the sampled tokens: look only at the rows that may stop or are watched
        (streamed, stop strings, logprobs) to detokenize, check stops and add RequestOutputs. The rest of the
        batch costs a few numpy calls, not a Python loop; the loop body runs for every streamed request at
        every step, so it is written out here rather than split into calls."""
        checks = self._stop_checks
        if checks is None or checks.seqs != seqs:
            requests = self.requests
            checks = self._stop_checks = _StopChecks(seqs, [requests[seq.request_id] for seq in seqs],
                                                     self.eos_token_ids, self.vocab_size)
        if plan.decode is not None:
            lengths = plan.decode.positions + 2  # the position computed, and the token sampled after it
        else:
            lengths = np.fromiter(map(len, map(_token_ids, seqs)), np.int64, len(seqs))
        token_ids, logprobs = sampled.token_ids, sampled.sampled_logprobs
        rows, stopping = checks.rows_to_check(sampled.token_array, lengths)
        for row in rows:
            request, token_id = checks.requests[row], token_ids[row]
            seq = request.seq
            if request.watched:  # a row not looked at every step has no cumulative logprob (None in its output)
                seq.cumulative_logprob += logprobs[row]
            new_logprobs, new_ranks = self._new_logprobs(request, token_id, sampled, row) \
                if request.wants_logprobs else ([], [])
            detokenizer = request.detokenizer
            delta = detokenizer.add_token(token_id) if request.needs_text else ""
            reason = None
            if stopping[row] or detokenizer.stop_matched is not None:
                reason = "stop" if detokenizer.stop_matched is not None else self._finish_reason(seq, token_id)
                if reason is not None:
                    self.scheduler.finish(seq, reason)
                    del self.requests[seq.request_id]
                    if not request.stream:
                        outputs.append(self._final_output(request, reason))
                        continue
                    delta += detokenizer.flush()
            if request.stream:
                outputs.append(RequestOutput(seq.request_id, [token_id], delta, reason is not None, reason,
                                             seq.num_prompt_tokens, len(seq.token_ids) - seq.num_prompt_tokens,
                                             seq.cumulative_logprob, new_logprobs, seq.num_cached_tokens,
                                             new_ranks))

    @staticmethod
    def _new_logprobs(request: _Request, token_id: int, sampled, row: int) -> tuple[list[dict], list[int]]:
        new_logprobs = [{**(sampled.top_logprobs[row] or {}), token_id: sampled.sampled_logprobs[row]}]
        new_ranks = [sampled.sampled_ranks[row]]
        request.seq.logprobs.extend(new_logprobs)
        request.seq.logprob_ranks.extend(new_ranks)
        return new_logprobs, new_ranks

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.sampling_params
        may_stop = seq.num_output_tokens >= params.min_tokens
        if may_stop and not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if may_stop and token_id in params.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    @staticmethod
    def _output(request: _Request, token_ids, delta, reason, new_logprobs=()) -> RequestOutput:
        seq = request.seq
        return RequestOutput(seq.request_id, list(token_ids), delta, reason is not None, reason,
                             seq.num_prompt_tokens, seq.num_output_tokens, seq.cumulative_logprob,
                             list(new_logprobs), seq.num_cached_tokens)

    @staticmethod
    def _final_output(request: _Request, reason: str) -> RequestOutput:
        """The one output of a request that is not streamed: all its tokens, text and logprobs."""
        seq, detokenizer = request.seq, request.detokenizer
        if not request.needs_text:
            detokenizer.add(seq.output_token_ids)
        detokenizer.flush()
        return RequestOutput(seq.request_id, seq.output_token_ids, detokenizer.text, True, reason,
                             seq.num_prompt_tokens, seq.num_output_tokens,
                             seq.cumulative_logprob if request.watched else None, list(seq.logprobs),
                             seq.num_cached_tokens, list(seq.logprob_ranks))

    # ---- introspection --------------------------------------------------------------------------
    def stats(self) -> dict:
        blocks = self.block_manager
        return {
            "num_total_blocks": blocks.num_total_blocks,
            "num_free_blocks": blocks.num_free_blocks,
            "num_used_blocks": blocks.num_total_blocks - blocks.num_free_blocks,
            "num_cached_blocks": blocks.num_cached_blocks,
            "prefix_cache_hit_tokens": blocks.prefix_cache_hit_tokens,
            "prompt_tokens_computed": self.scheduler.prompt_tokens_computed,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "generation_tokens": self.num_generation_tokens,
        }

    def shutdown(self) -> None:
        self.model_runner.shutdown()


def _eos_token_ids(config: EngineConfig, tokenizer) -> set[int]:
    """EOS ids from config.json, generation_config.json (Qwen lists two there) and the tokenizer."""
    from transformers import GenerationConfig

    sources = [getattr(config.hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    try:
        sources.append(GenerationConfig.from_pretrained(config.model).eos_token_id)
    except OSError:  # no generation_config.json
        pass
    ids = set()
    for eos in sources:
        ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return ids

