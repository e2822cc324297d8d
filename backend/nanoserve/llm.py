"""Offline batch generation: `LLM(model_dir, **engine_args).generate(prompts, sampling_params)`.

LoRA adapters: `LLM(model_dir, enable_lora=True)`, `llm.add_lora("sql", "/adapters/sql")`, then
`SamplingParams(lora_name="sql")` for the prompts that use it."""
from __future__ import annotations

from dataclasses import dataclass, field

from tqdm.auto import tqdm

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.outputs import RequestOutput
from nanoserve.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    """One sequence generated for a prompt (one of its n samples)."""
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None  # with SamplingParams.logprobs set
    logprobs: list[dict[int, float]] | None = None  # per generated token, when SamplingParams.logprobs is set
    finish_reason: str | None = None  # "stop" | "length" | "abort"

    @classmethod
    def of(cls, out: RequestOutput, wants_logprobs: bool) -> "CompletionOutput":
        """A non-streamed sequence's one output: the engine joined its text, tokens and logprobs."""
        return cls(out.index, out.text_delta, list(out.new_token_ids), out.cumulative_logprob,
                   out.new_logprobs if wants_logprobs else None, out.finish_reason)


@dataclass
class PromptOutput:
    """What generate returns for one prompt: its SamplingParams.n sequences in `outputs` (in index order);
    `text`, `token_ids`, `cumulative_logprob`, `logprobs` and `finish_reason` are the first sequence's."""
    prompt: str | list[int]
    outputs: list[CompletionOutput] = field(default_factory=lambda: [CompletionOutput()])
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the first sequence took from the prefix cache
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then per prompt token {token_id:
    # logprob} of the most likely tokens and itself
    prompt_logprobs: list[dict[int, float] | None] | None = None

    text = property(lambda self: self.outputs[0].text)
    token_ids = property(lambda self: self.outputs[0].token_ids)
    cumulative_logprob = property(lambda self: self.outputs[0].cumulative_logprob)
    logprobs = property(lambda self: self.outputs[0].logprobs)
    finish_reason = property(lambda self: self.outputs[0].finish_reason)

    def add(self, out: RequestOutput, wants_logprobs: bool) -> None:
        self.outputs[out.index] = CompletionOutput.of(out, wants_logprobs)
        self.num_prompt_tokens = out.num_prompt_tokens
        if out.index == 0:
            self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = [None, *out.prompt_logprobs.logprobs]


class LLM:
    def __init__(self, model: str, **engine_args):
        self.engine = LLMEngine.from_engine_args(model, **engine_args)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[PromptOutput]:
        """prompts: a string, a list of token ids, or a list of either. Returns one output per prompt, in order."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        outputs: dict[str, PromptOutput] = {}
        try:
            for prompt, sp in zip(prompts, params):
                request_id = f"offline-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(request_id, prompt, sp, stream=False)
                outputs[request_id] = PromptOutput(prompt, [CompletionOutput(index) for index in range(sp.n)])
            self._run(outputs, params, use_tqdm)
        finally:
            self.engine.abort_all()  # an error mid-batch must not leak blocks
        return list(outputs.values())

    def _run(self, outputs: dict[str, PromptOutput], params: list[SamplingParams], use_tqdm: bool) -> None:
        wants_logprobs = {rid: sp.logprobs is not None for rid, sp in zip(outputs, params)}
        bar = tqdm(total=len(outputs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        with bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    outputs[out.request_id].add(out, wants_logprobs[out.request_id])
                    bar.update(1 if out.finished else 0)
                _show_throughput(bar, self.engine.last_step)

    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT LoRA adapter directory path (engine argument enable_lora=True) to the prompts whose
        SamplingParams have lora_name=name."""
        self.engine.add_lora(name, path)

    def stats(self) -> dict:
        return self.engine.stats()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _as_params_list(sampling_params, count: int) -> list[SamplingParams]:
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if len(sampling_params) != count:
        raise ValueError(f"sampling_params: got {len(sampling_params)} for {count} prompts")
    return list(sampling_params)


def _show_throughput(bar, step) -> None:
    if step.seconds <= 0 or bar.disable:
        return
    bar.set_postfix(prefill_tok_s=f"{step.num_prefill_tokens / step.seconds:.0f}",
                    decode_tok_s=f"{step.num_decode_tokens / step.seconds:.0f}", refresh=False)
