"""The streaming engine: add / abort requests and step the continuous batch.

Not thread-safe: one thread owns an LLMEngine (the Triton backend's engine thread, or `LLM.generate`)
and calls add_request / abort_request between steps.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from transformers import AutoTokenizer, GenerationConfig

from nanoserve.config import EngineConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.executor import Executor
from nanoserve.engine.output_processor import OutputProcessor, RequestOutput
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.tokenize import encode_prompt_text, max_prompt_bytes
from nanoserve.sampling_params import SamplingParams

__all__ = ["LLMEngine", "RequestOutput", "StepStats"]


@dataclass
class StepStats:
    """Token counts and time of the last step, for progress bars and benchmarks."""
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    seconds: float = 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
        self.max_prompt_bytes = max_prompt_bytes(self.tokenizer, config.max_model_len)  # longer texts cannot fit
        eos = eos_token_ids(config, self.tokenizer)
        self.executor = Executor(config, eos)
        self.block_manager = BlockManager(self.executor.num_kv_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.output_processor = OutputProcessor(self.tokenizer, eos, config.hf_config.vocab_size)
        self.vocab_size = config.hf_config.vocab_size
        self.pending_outputs: list[RequestOutput] = []  # abort notices, emitted by the next step()
        self.last_step = StepStats()
        self.num_generation_tokens = 0

    @classmethod
    def from_engine_args(cls, model: str, **engine_args) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model, **engine_args))

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams,
                    stream: bool = True) -> None:
        """Queue a request. Raises ValueError (message starting with the field) for bad input. stream=True: a
        RequestOutput every step (new tokens, text delta); False: one when it finishes, with all of them."""
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        sampling_params.check_against_model(self.config.max_model_len, self.vocab_size, self.config.max_logprobs)
        prompt_ids = self.tokenize(prompt)
        max_tokens = sampling_params.max_tokens
        if max_tokens is None:  # documented default: generate until a stop condition or max_model_len
            max_tokens = max(self.config.max_model_len - len(prompt_ids), 1)
        self.scheduler.check_admissible(len(prompt_ids), max_tokens)
        seq = Sequence(request_id, prompt_ids, sampling_params, max_tokens)
        self.output_processor.add(seq, stream)
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
        output = self.output_processor.abort(request_id)
        if output is None:
            return False
        self.scheduler.abort(request_id)
        self.pending_outputs.append(output)
        return True

    def abort_all(self) -> list[str]:
        """Abort every request, dropping their final outputs; returns their ids. The runners' batches start
        empty again, so this also recovers from a step that raised half-way."""
        request_ids = list(self.output_processor.requests)
        for request_id in request_ids:
            self.abort_request(request_id)
        self.pending_outputs.clear()
        self._reset_batch()
        return request_ids

    def fail_and_recover(self, request_ids) -> list[str]:
        """After step() raised: drop the requests in request_ids (the suspects: those admitted or changed since
        the last step that succeeded; their blocks are freed and no output comes for them) and preempt every
        other running request by recompute (blocks freed, back to waiting, its tokens kept), so step() can be
        retried without the suspects. Returns the ids dropped (the caller fails them).
        The retry repeats the failed step for the others when it failed before its results were applied
        (scheduling, the forward pass, sampling): seeded and greedy requests then get the same tokens."""
        dropped = [request_id for request_id in request_ids if self.output_processor.abort(request_id) is not None]
        for request_id in dropped:
            self.scheduler.abort(request_id)
        self._reset_batch()
        # a request the failed step finished before it raised is gone from the output processor: it leaves too
        for request_id in self.scheduler.waiting_ids() - set(self.output_processor.requests):
            self.scheduler.abort(request_id)
        return dropped

    def _reset_batch(self) -> None:
        """Every running request back to waiting and the runners' batches empty: the scheduler and the runners
        agree again whatever part of a step failed."""
        self.scheduler.preempt_all()
        self.executor.call("reset_batch")

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests) or bool(self.pending_outputs)

    # ---- stepping -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """The abort notices queued since the last step, then this step's outputs. The notices are taken only
        once the step has succeeded: a step that raises loses none of them."""
        outputs: list[RequestOutput] = []
        started = time.perf_counter()
        scheduled = self.scheduler.schedule()
        sampled = self.executor.execute(scheduled)
        sampled_seqs = self.scheduler.update(scheduled, sampled.token_ids)
        for seq, reason in self.output_processor.process(sampled_seqs, sampled, outputs):
            self.scheduler.finish(seq, reason)
        self.num_generation_tokens += len(sampled_seqs.seqs)
        prefill = scheduled.num_prefill_tokens
        self.last_step = StepStats(prefill, scheduled.num_batched_tokens - prefill, time.perf_counter() - started)
        if self.pending_outputs:
            outputs, self.pending_outputs = self.pending_outputs + outputs, []
        return outputs

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
        self.executor.shutdown()


def eos_token_ids(config: EngineConfig, tokenizer) -> set[int]:
    """EOS ids from config.json, generation_config.json (Qwen lists two there) and the tokenizer."""
    sources = [getattr(config.hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    try:
        sources.append(GenerationConfig.from_pretrained(config.model).eos_token_id)
    except OSError:  # no generation_config.json
        pass
    ids = set()
    for eos in sources:
        ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return ids
