"""The streaming engine: add / abort requests and step the continuous batch (docs/architecture.md, "Streaming
engine API"). Not thread-safe: one thread owns an LLMEngine and calls add_request / abort_request between steps."""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from itertools import compress

from transformers import AutoTokenizer, GenerationConfig
from xgrammar import CompiledGrammar

from nanoserve.config import EngineConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.executor import Executor
from nanoserve.engine.lora import LoRAAdapter, LoRASlots
from nanoserve.engine.model_runner import LaunchedStep, RunnerOutput
from nanoserve.engine.output_processor import OutputProcessor
from nanoserve.engine.outputs import RequestOutput
from nanoserve.engine.scheduler import SampledSeqs, Scheduler
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.structured_output import Grammar, StructuredOutputManager, TokenBitmask
from nanoserve.engine.tokenize import encode_prompt_text, max_prompt_bytes
from nanoserve.errors import RequestError
from nanoserve.models.lora import check_peft_adapter
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
        self.loras: dict[str, LoRAAdapter] = {}  # by name (add_lora)
        lora_slots = LoRASlots(config.max_loras) if config.enable_lora else None
        self.scheduler = Scheduler(config, self.block_manager, lora_slots, config.speculative_config,
                                   config.async_scheduling)
        self.output_processor = OutputProcessor(self.tokenizer, eos, config.hf_config.vocab_size)
        self.vocab_size = config.hf_config.vocab_size
        self.structured_outputs = StructuredOutputManager(self.tokenizer, self.vocab_size, eos)
        self.pending_outputs: list[RequestOutput] = []  # abort notices, emitted by the next step()
        self.last_step = StepStats()
        self.num_generation_tokens = 0
        self.in_flight: LaunchedStep | None = None  # async scheduling: the step launched, its tokens not read

    @classmethod
    def from_engine_args(cls, model: str, **engine_args) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model, **engine_args))

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams,
                    stream: bool = True, grammar: CompiledGrammar | None = None) -> None:
        """Queue a request; ValueError (message starting with the field) for bad input. stream=True: an output
        every step, False: one at the end. grammar: structured_outputs compiled already (else compiled here)."""
        sequence_ids = [request_id] if sampling_params.n == 1 else \
            [f"{index}_{request_id}" for index in range(sampling_params.n)]  # vLLM's names for the samples
        in_use = self.output_processor
        if request_id in in_use.samples or not in_use.requests.keys().isdisjoint(sequence_ids):
            raise RequestError("request_id", f"{request_id!r} is already running")
        sampling_params.check_against_model(self.config.max_model_len, self.vocab_size, self.config.max_logprobs)
        lora = self._lora(sampling_params.lora_name)
        prompt_ids = self.tokenize(prompt)
        max_tokens = sampling_params.max_tokens_for(len(prompt_ids), self.config.max_model_len)
        self.scheduler.check_admissible(len(prompt_ids), max_tokens)
        if grammar is None:
            grammar = self.compile_grammar(sampling_params)
        seqs = [Sequence(sequence_id, prompt_ids, sampling_params.for_sample(index), max_tokens,
                         None if grammar is None else Grammar(grammar), lora)
                for index, sequence_id in enumerate(sequence_ids)]
        self.output_processor.add(request_id, seqs, stream)
        for seq in seqs:
            self.scheduler.add(seq, fork_of=seqs[0] if seq is not seqs[0] else None)

    def compile_grammar(self, sampling_params: SamplingParams) -> CompiledGrammar | None:
        """The request's structured_outputs compiled (None without); ValueError naming structured_outputs when it
        does not compile. Thread-safe: the serving path calls it on the request's thread."""
        spec = sampling_params.structured_outputs
        return None if spec is None else self.structured_outputs.compile(spec)

    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT LoRA adapter in directory path to requests whose lora_name is name. Raises ValueError (an
        adapter this engine cannot run, a name already taken, enable_lora off)."""
        if not self.config.enable_lora:
            raise RequestError("enable_lora", "LoRA adapters need the engine argument enable_lora=True")
        if not isinstance(name, str) or not name:
            raise RequestError("lora_name", f"expected a non-empty string, got {name!r}")
        if name in self.loras:
            raise RequestError("lora_name", f"an adapter named {name!r} is already being served")
        try:
            check_peft_adapter(path, self.config.model, self.config.max_lora_rank)
        except ValueError as e:
            raise ValueError(f"LoRA adapter {name!r}: {e}") from None
        self.loras[name] = LoRAAdapter(len(self.loras) + 1, name, os.path.abspath(path))

    def _lora(self, name: str | None) -> LoRAAdapter | None:
        if name is None:
            return None
        if name not in self.loras:
            known = ", ".join(sorted(self.loras)) or "none"
            enabled = "" if self.config.enable_lora else "; the engine runs without enable_lora"
            raise RequestError("lora_name", f"unknown LoRA adapter {name!r} (known: {known}{enabled})")
        return self.loras[name]

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return encode_prompt_text(self.tokenizer, prompt, self.max_prompt_bytes)
        if not isinstance(prompt, (list, tuple)):
            raise RequestError("prompt", "expected a string or a list of token ids")
        self.scheduler.check_admissible(len(prompt), 1)  # a huge prompt is rejected before the per-id checks
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise RequestError("prompt", "expected a string or a list of token ids")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError("prompt", f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return list(prompt)

    def abort_request(self, request_id: str) -> bool:
        """Free the request's blocks now; its final outputs (reason "abort") come with the next step()."""
        outputs = self._abort(request_id)
        self.pending_outputs += outputs
        return bool(outputs)

    def _abort(self, request_id: str) -> list[RequestOutput]:
        """Drop every sequence of the request: their final outputs (none for an unknown request)."""
        sequence_ids = self.output_processor.sequence_ids(request_id)
        outputs = self.output_processor.abort(request_id)
        for sequence_id in sequence_ids if outputs else ():
            self.scheduler.abort(sequence_id)
        return outputs

    def abort_all(self) -> list[str]:
        """Abort every request, dropping their final outputs; returns their ids. The runners' batches start empty
        again, so this also recovers from a step that raised half-way."""
        request_ids = sorted(self.output_processor.request_ids())
        for request_id in request_ids:
            self.abort_request(request_id)
        self.pending_outputs.clear()
        self._reset_batch()
        return request_ids

    def fail_and_recover(self, request_ids) -> list[str]:
        """After step() raised: drop the suspects in request_ids (blocks freed, no output) and preempt every other
        running request by recompute, so step() can be retried without them. Returns the ids dropped. A step that
        failed before its results were applied is repeated: seeded and greedy requests get the same tokens."""
        self.pending_outputs += self.output_processor.emit_deferred()  # not lost with the suspects' outputs
        dropped = [request_id for request_id in request_ids if self._abort(request_id)]
        self._reset_batch()
        # a request the failed step finished before it raised is gone from the output processor: it leaves too
        for request_id in {seq.request_id for seq in self.scheduler.waiting} - self.output_processor.requests.keys():
            self.scheduler.abort(request_id)
        return dropped

    def _reset_batch(self) -> None:
        """Every running request back to waiting and the runners' batches empty, whatever part of a step failed."""
        self.scheduler.preempt_all()
        self.in_flight = None
        self.executor.call("reset_batch")
        for seq in self.scheduler.waiting:  # a step that failed in the output processor advanced only some
            if seq.grammar is not None:
                seq.grammar.catch_up(seq.output_token_ids)

    def has_unfinished_requests(self) -> bool:
        processor = self.output_processor
        return bool(processor.requests) or bool(self.pending_outputs) or bool(processor.deferred) or \
            self.in_flight is not None

    # ---- stepping -------------------------------------------------------------------------------
    def step(self, overlap: bool = False) -> list[RequestOutput]:
        """The abort notices queued since the last step (kept if the step raises), then this step's outputs.
        overlap: a stream whose end its token ids decide gets its output from the next step, which makes it while
        its own forward runs (on a GPU, the host's detokenization then overlaps the device's work). With
        async_scheduling every output comes from the next step (overlap does not matter)."""
        outputs: list[RequestOutput] = []
        processor = self.output_processor
        if self.config.async_scheduling:
            self._step_async(outputs)
        elif overlap and not processor.requests:  # only deferred outputs are left
            outputs = processor.emit_deferred()
        else:
            self._step(outputs, overlap)
        if self.pending_outputs:
            outputs, self.pending_outputs = self.pending_outputs + outputs, []
        return outputs

    def _step(self, outputs: list[RequestOutput], overlap: bool) -> None:
        started = time.perf_counter()
        scheduled = self.scheduler.schedule()
        processor = self.output_processor
        emit_deferred = (lambda: outputs.extend(processor.emit_deferred())) if overlap else None
        try:
            sampled = self.executor.execute(scheduled, self._token_bitmask, emit_deferred)
        except BaseException:
            self.pending_outputs += outputs  # made before the step failed: they come with the next one
            raise
        sampled_seqs = self.scheduler.update(scheduled, sampled.token_ids, sampled.num_tokens)
        self._apply(sampled_seqs, sampled, outputs, overlap)
        if sampled.num_tokens is not None:  # tokens of accepted runs after a stop are not output
            self.num_generation_tokens -= self.output_processor.take_dropped_tokens()
        self._record(scheduled, started)

    def _apply(self, sampled_seqs: SampledSeqs, sampled: RunnerOutput, outputs: list[RequestOutput],
               defer: bool) -> None:
        """A step's tokens, appended by the scheduler: their outputs, and the sequences they finish."""
        for seq, reason in self.output_processor.process(sampled_seqs, sampled, outputs, defer=defer):
            self.scheduler.finish(seq, reason)
        for seq in sampled_seqs.scored:
            outputs.append(self.output_processor.scored(seq))
            self.scheduler.finish(seq, "length")
        self.num_generation_tokens += len(sampled_seqs.seqs)

    def _record(self, scheduled: SchedulerOutput, started: float) -> None:
        prefill = scheduled.num_prefill_tokens
        self.last_step = StepStats(prefill, scheduled.num_batched_tokens - prefill, time.perf_counter() - started)

    def _step_async(self, outputs: list[RequestOutput]) -> None:
        """Async scheduling: schedule and launch the next step while the one launched by the last call runs (its
        tokens are placeholders to the scheduler), then read that one's tokens and make its outputs while the new
        one runs. A row whose sequence finished meanwhile computes in vain; its token is dropped."""
        started = time.perf_counter()
        previous, self.in_flight = self.in_flight, None
        scheduled = self.scheduler.schedule()
        try:
            launched = self.executor.launch(scheduled, previous)
            if previous is not None:
                self._apply_launched(previous, outputs)
            step_seqs = self.scheduler.scheduled[0].seqs
            self.executor.sample_launched(launched, self._token_bitmask(scheduled, step_seqs))
            if scheduled.num_batched_tokens:
                self.in_flight = launched
            else:  # nothing runs (the step only removed rows): done at once
                self._apply_launched(launched, outputs)
        except BaseException:
            self.pending_outputs += outputs  # made before the step failed: they come with the next one
            raise
        self._record(scheduled, started)

    def _apply_launched(self, launched: LaunchedStep, outputs: list[RequestOutput]) -> None:
        sampled = self.executor.result(launched)
        sampled_seqs, keep = self.scheduler.update_scheduled(sampled.token_ids)
        if not keep.all():
            sampled = sampled.select(keep)
        self._apply(sampled_seqs, sampled, outputs, defer=False)

    def _token_bitmask(self, scheduled: SchedulerOutput, seqs: list[Sequence] | None = None) -> TokenBitmask | None:
        """The tokens the step's sampling rows with structured outputs may take (None when no request has them),
        at each proposed position too (a draft model's proposals are in `scheduled` by the time the runner asks).
        seqs: the step's rows (default: the running sequences); a finished one's row is not constrained."""
        if not self.output_processor.constrained:
            return None
        step_seqs = self.scheduler.running if seqs is None else seqs
        grammars = [None if seq.is_finished else seq.grammar for seq in compress(step_seqs, scheduled.samples)]
        if not len(scheduled.num_draft_tokens):
            return self.structured_outputs.bitmask(grammars)
        return self.structured_outputs.bitmask(grammars, scheduled.num_draft_tokens[scheduled.samples],
                                               scheduled.draft_token_ids)

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
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "generation_tokens": self.num_generation_tokens,
            **(self.scheduler.spec_stats.as_dict() if self.scheduler.spec_stats is not None else {}),
        }

    def shutdown(self) -> None:
        self.executor.shutdown()


def eos_token_ids(config: EngineConfig, tokenizer) -> set[int]:
    """EOS ids from config.json, generation_config.json (Qwen lists two there) and the tokenizer."""
    sources = [getattr(config.hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    with contextlib.suppress(OSError):  # no generation_config.json
        sources.append(GenerationConfig.from_pretrained(config.model).eos_token_id)
    ids = set()
    for eos in sources:
        ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return ids
