"""The streaming engine: add / abort requests and step the continuous batch.

Not thread-safe: one thread owns an LLMEngine (the Triton backend's engine thread, or `LLM.generate`)
and calls add_request / abort_request between steps.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import AutoTokenizer

from nanoserve.config import EngineConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.detokenizer import IncrementalDetokenizer
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.tokenize import encode_prompt_text
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
    cumulative_logprob: float = 0.0
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_cached_tokens: int = 0


@dataclass
class StepStats:
    """Token counts and time of the last step, for progress bars and benchmarks."""
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    seconds: float = 0.0


_NO_TOKEN_IDS = frozenset()


class _Request:
    """A request's engine-side state: its sequence, detokenizer, and what the per-token stop check reads."""
    __slots__ = ("seq", "detokenizer", "stop_token_ids", "max_num_tokens", "wants_logprobs")

    def __init__(self, seq: Sequence, detokenizer: IncrementalDetokenizer, max_model_len: int):
        self.seq = seq
        self.detokenizer = detokenizer
        params = seq.sampling_params
        self.stop_token_ids = frozenset(params.stop_token_ids) if params.stop_token_ids else _NO_TOKEN_IDS
        self.max_num_tokens = min(seq.num_prompt_tokens + seq.max_tokens, max_model_len)  # "length" from here
        self.wants_logprobs = params.logprobs is not None


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
        IncrementalDetokenizer(self.tokenizer, [])  # builds the tokenizer's byte table now, not at the first request
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

    @classmethod
    def from_engine_args(cls, model: str, **engine_args) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model, **engine_args))

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams) -> None:
        """Queue a request. Raises ValueError (message starting with the field) for bad input."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        prompt_ids = self.tokenize(prompt)
        max_tokens = sampling_params.max_tokens
        if max_tokens is None:  # documented default: generate until a stop condition or max_model_len
            max_tokens = max(self.config.max_model_len - len(prompt_ids), 1)
        self.scheduler.check_admissible(len(prompt_ids), max_tokens)
        seq = Sequence(request_id, prompt_ids, sampling_params, max_tokens)
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, sampling_params.skip_special_tokens,
                                             sampling_params.stop, sampling_params.include_stop_str_in_output)
        self.requests[request_id] = _Request(seq, detokenizer, self.config.max_model_len)
        self.scheduler.add(seq)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return encode_prompt_text(self.tokenizer, prompt)
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
        self.pending_outputs.append(self._output(request, [], request.detokenizer.flush(), "abort"))
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.pending_outputs)

    # ---- stepping -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self.pending_outputs = self.pending_outputs, []
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan:
            self.last_step = StepStats()
            return outputs
        seqs = plan.sampling_seqs  # before the step appends tokens (which changes what "samples" means)
        sampled = self.model_runner.execute(plan)
        self.scheduler.postprocess(plan)
        self._append_tokens(seqs, sampled, outputs)
        self.num_generation_tokens += len(sampled.token_ids)
        prefill = plan.num_prefill_tokens
        self.last_step = StepStats(prefill, plan.num_batched_tokens - prefill, time.perf_counter() - started)
        return outputs

    def _append_tokens(self, seqs: list[Sequence], sampled, outputs: list[RequestOutput]) -> None:
        """Append each sequence's sampled token, detokenize, check stops, and add its RequestOutput.
        The loop body runs once per sequence per step, so the usual case (no logprobs, no stop) is kept to a
        few dictionary and set lookups; anything that may stop the request goes through _finish_reason."""
        requests, eos_token_ids = self.requests, self.eos_token_ids
        for seq, token_id, logprob, top in zip(seqs, sampled.token_ids, sampled.sampled_logprobs,
                                               sampled.top_logprobs):
            request = requests[seq.request_id]
            token_ids = seq.token_ids
            token_ids.append(token_id)
            cumulative_logprob = seq.cumulative_logprob = seq.cumulative_logprob + logprob
            new_logprobs = []
            if request.wants_logprobs:
                new_logprobs = [{**(top or {}), token_id: logprob}]
                seq.logprobs.extend(new_logprobs)
            detokenizer = request.detokenizer
            delta = detokenizer.add_token(token_id)
            reason = None
            if (token_id in eos_token_ids or token_id in request.stop_token_ids
                    or len(token_ids) >= request.max_num_tokens or detokenizer.stop_matched is not None):
                reason = "stop" if detokenizer.stop_matched is not None else self._finish_reason(seq, token_id)
                if reason is not None:
                    delta += detokenizer.flush()
                    self.scheduler.finish(seq, reason)
                    del requests[seq.request_id]
            outputs.append(RequestOutput(seq.request_id, [token_id], delta, reason is not None, reason,
                                         seq.num_prompt_tokens, len(token_ids) - seq.num_prompt_tokens,
                                         cumulative_logprob, new_logprobs, seq.num_cached_tokens))

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

