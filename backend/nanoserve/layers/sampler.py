"""Logits -> next tokens for a batch of sequences.

Per step: penalties and min_tokens masking edit the logits; logprobs are read there (before temperature,
top-k, top-p and min-p, so they describe the model's distribution, not the sampling one); then greedy rows
take the argmax and the others sample from the tempered, filtered distribution:
- unseeded rows by inverse CDF, one uniform draw per row from the Sampler's generator (drawing Exp(1) noise
  for every vocabulary entry, as the exponential race does, costs far more than the rest of the sampler);
- a seeded row by the exponential race argmax(probs / Exp(1) noise), its noise drawn only from (seed, number
  of tokens it has generated), so it gets the same tokens whatever else shares the batch.
Filtered-out tokens have probability exactly 0, and neither method can pick one.
"""
from __future__ import annotations

import copy
import math
from array import array
from dataclasses import dataclass, field

import numpy as np
import torch

from nanoserve.engine.sequence import Sequence

GREEDY_TEMPERATURE = 1e-5  # below this, logits / T can overflow float32: treat the row as greedy
_NO_TOP_K = 1 << 30
_MAX_TOKEN_ID = 1 << 31  # larger stop_token_ids cannot be in any vocabulary (and would overflow int64)
_MASK64 = (1 << 64) - 1
Scalar = float | int


@dataclass
class SamplerOutput:
    token_ids: list[int]
    token_array: np.ndarray = field(compare=False)  # the same ids, int64 [N], for checks over the batch
    sampled_logprobs: list[float]  # log-softmax of the penalized logits at the sampled token
    top_logprobs: list[dict[int, float] | None]  # the n most likely tokens plus the sampled one, when asked
    # when logprobs are asked: the sampled token's rank in the vocabulary (1 + tokens with a higher logprob;
    # vLLM counts ties as higher too), else None
    sampled_ranks: list[int | None] = field(default_factory=list)


@dataclass
class Penalties:
    """Repetition penalty (HF/vLLM: over prompt + output tokens, positive logits divided, negative multiplied)
    and presence / frequency penalties (over output tokens: logit -= presence * (count > 0) + frequency * count)."""
    rows: torch.Tensor  # [P] batch rows that use any penalty
    all_ids: torch.Tensor | None  # [P, L] prompt + output ids, padded with -1; None without repetition penalty
    output_ids: torch.Tensor | None  # [P, L] output ids, padded with -1; None without presence/frequency
    repetition: torch.Tensor  # [P, 1]
    presence: torch.Tensor  # [P, 1]
    frequency: torch.Tensor  # [P, 1]

    def apply(self, logits: torch.Tensor) -> None:
        vocab_size = logits.shape[1]
        rows = logits[self.rows]
        if self.all_ids is not None:
            seen = _token_counts(self.all_ids, vocab_size) > 0
            penalized = torch.where(rows > 0, rows / self.repetition, rows * self.repetition)
            rows = torch.where(seen, penalized, rows)
        if self.output_ids is not None:
            counts = _token_counts(self.output_ids, vocab_size)
            rows = rows - self.presence * (counts > 0) - self.frequency * counts
        logits[self.rows] = rows


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of one batch. A parameter that is the same on every row is kept as a Python
    number (cheaper to build and to apply); otherwise it is a [N, 1] tensor. None: the feature is off."""
    num_rows: int
    all_greedy: bool
    greedy: torch.Tensor | None = None  # bool [N]; only for a batch that mixes greedy and sampled rows
    temperatures: Scalar | torch.Tensor = 1.0  # 1.0 on greedy rows
    top_ks: Scalar | torch.Tensor | None = None  # huge where top-k is off
    max_top_k: int | None = None  # the largest top-k when every sampled row sets one: only that many candidates
    top_ps: Scalar | torch.Tensor | None = None  # +inf where top-p is off
    log_min_ps: Scalar | torch.Tensor | None = None  # -inf where min-p is off
    seeded: list[tuple[int, int]] = field(default_factory=list)  # (row, generator seed for this step)
    penalties: Penalties | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) masked by min_tokens
    logprobs: list[tuple[int, int]] = field(default_factory=list)  # (row, number of top logprobs)
    # What the step-dependent parts (seeded, penalties, banned) are rebuilt from by refresh(): they follow
    # the sequences' tokens, the rest only their SamplingParams.
    seeds: list[tuple[int, int]] = field(default_factory=list)  # (row, user seed) of seeded sampled rows
    penalty_params: tuple[list, list, list] | None = None  # (repetition, presence, frequency) per row
    min_tokens: list[int] | None = None  # per row, when some row sets min_tokens
    eos_token_id: int | list[int] | None = None
    device: torch.device | str = "cpu"

    @property
    def edits_logits(self) -> bool:
        return self.penalties is not None or self.banned is not None

    @property
    def is_step_dependent(self) -> bool:
        return bool(self.seeds) or self.penalty_params is not None or self.min_tokens is not None

    @classmethod
    def from_seqs(cls, seqs: list[Sequence], eos_token_id: int | list[int] | None = None,
                  device: torch.device | str = "cpu") -> "SamplingMetadata":
        """Batch the sampling parameters of seqs (one row each); only features some row uses cost anything.
        Reads one attribute column at a time: list comprehensions beat a per-row tuple on the host."""
        params = [seq.sampling_params for seq in seqs]
        n = len(params)
        temps = [p.temperature for p in params]
        meta = cls(num_rows=n, all_greedy=n == 0 or max(temps) < GREEDY_TEMPERATURE, eos_token_id=eos_token_id,
                   device=device)
        if not meta.all_greedy:
            meta._set_sampling(params, temps, device)
        reps = [p.repetition_penalty for p in params]
        presences = [p.presence_penalty for p in params]
        frequencies = [p.frequency_penalty for p in params]
        if reps.count(1.0) != n or any(presences) or any(frequencies):
            meta.penalty_params = (reps, presences, frequencies)
        min_tokens = [p.min_tokens for p in params]
        if any(min_tokens):
            meta.min_tokens = min_tokens
        logprobs = [p.logprobs for p in params]
        if logprobs.count(None) != n:
            meta.logprobs = [(row, k) for row, k in enumerate(logprobs) if k is not None]
        meta._set_step_dependent(seqs)
        return meta

    def refresh(self, seqs: list[Sequence]) -> "SamplingMetadata":
        """The metadata of the same sequences one step later (the usual decode step): the per-request part is
        reused, only seeds, penalties and min_tokens masks are rebuilt, and only when some row uses them."""
        if not self.is_step_dependent:
            return self
        meta = copy.copy(self)
        meta._set_step_dependent(seqs)
        return meta

    def _set_step_dependent(self, seqs: list[Sequence]) -> None:
        if self.seeds:
            self.seeded = [(row, step_seed(seed, seqs[row].num_output_tokens)) for row, seed in self.seeds]
        if self.penalty_params is not None:
            self.penalties = _build_penalties(seqs, *self.penalty_params, self.device)
        if self.min_tokens is not None:
            self.banned = _build_banned(seqs, self.min_tokens, self.eos_token_id, self.device)

    def _set_sampling(self, params, temps, device) -> None:
        greedy = [t < GREEDY_TEMPERATURE for t in temps]
        if any(greedy):
            self.greedy = _tensor(greedy, torch.bool, device)
            temps = [1.0 if g else t for g, t in zip(greedy, temps)]
        self.temperatures = _column(temps, torch.float32, device)
        top_ks = [min(p.top_k, _NO_TOP_K) if p.top_k > 0 else _NO_TOP_K for p in params]  # > any vocabulary: off
        if min(top_ks) < _NO_TOP_K:
            self.top_ks = _column(top_ks, torch.long, device)
            sampled_ks = [k for k, g in zip(top_ks, greedy) if not g]  # greedy rows ignore their filters
            if max(sampled_ks) < _NO_TOP_K:
                self.max_top_k = max(sampled_ks)
        top_ps = [p.top_p for p in params]
        if min(top_ps) < 1.0:
            self.top_ps = _column([p if p < 1.0 else math.inf for p in top_ps], torch.float32, device)
        min_ps = [p.min_p for p in params]
        if max(min_ps) > 0.0:
            self.log_min_ps = _column([math.log(p) if p > 0 else -math.inf for p in min_ps], torch.float32, device)
        seeds = [p.seed for p in params]
        if seeds.count(None) != len(seeds):
            self.seeds = [(row, seed) for row, seed in enumerate(seeds) if seed is not None and not greedy[row]]


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}  # shared by unseeded rows, per device
        self._row_generators: dict[torch.device, torch.Generator] = {}  # re-seeded for each seeded row

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if meta.edits_logits:
            logits = logits.clone()
            if meta.penalties is not None:
                meta.penalties.apply(logits)
            if meta.banned is not None:
                rows, token_ids = meta.banned
                in_vocab = token_ids < logits.shape[1]  # an out-of-vocab stop_token_id can never be sampled
                logits[rows[in_vocab], token_ids[in_vocab]] = float("-inf")
        row_max = _finite_row_max(logits)
        shifted = logits - row_max  # the row max becomes 0: exp never overflows
        weights = shifted.exp()  # unnormalized probabilities at temperature 1
        log_norm = weights.sum(dim=-1).log_().add_(row_max.squeeze(1))  # logsumexp(logits), in fewer passes
        if meta.all_greedy:
            token_ids = argmax(logits)
        else:
            token_ids = self._sample(logits, shifted, weights, meta)
        sampled_logprobs = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1).sub_(log_norm)
        token_array = token_ids.cpu().numpy()
        token_list = token_array.tolist()
        logprob_list = sampled_logprobs.tolist()
        top = _top_logprobs(logits, log_norm, token_list, logprob_list, meta)
        return SamplerOutput(token_list, token_array, logprob_list, top, _sampled_ranks(logits, token_ids, meta))

    def _sample(self, logits: torch.Tensor, shifted: torch.Tensor, weights: torch.Tensor,
                meta: SamplingMetadata) -> torch.Tensor:
        """Sampled token ids [N]. shifted = logits - row max and weights = exp(shifted) are scratch: both are
        overwritten here. Temperature and the filters act on shifted logits (the same distributions)."""
        reweighted = not _is_one(meta.temperatures)  # once true, weights are no longer exp(scaled)
        scaled = shifted.div_(meta.temperatures) if reweighted else shifted  # the row max stays 0
        if meta.top_ks is not None or meta.top_ps is not None:
            scaled, reweighted = apply_top_k_top_p(scaled, meta.top_ks, meta.top_ps, meta.max_top_k), True
        if meta.log_min_ps is not None:
            scaled, reweighted = apply_min_p(scaled, meta.log_min_ps), True
        if len(meta.seeded) < meta.num_rows:
            if reweighted:
                weights = torch.exp(scaled, out=weights)
            uniforms = torch.rand((meta.num_rows, 1), generator=self._generator(
                self._generators, logits.device, self.seed), device=logits.device)
            sampled = sample_inverse_cdf(weights, uniforms)
        else:
            sampled = torch.empty(meta.num_rows, dtype=torch.long, device=logits.device)
        if meta.seeded:
            rows = torch.tensor([row for row, _ in meta.seeded], device=logits.device)
            sampled[rows] = self._seeded_race(scaled[rows], [seed for _, seed in meta.seeded])
        if meta.greedy is not None:
            sampled = torch.where(meta.greedy, argmax(logits), sampled)
        return sampled

    def _seeded_race(self, scaled: torch.Tensor, seeds: list[int]) -> torch.Tensor:
        """Exponential race for seeded rows: argmax(probs / Exp(1) noise), each row's noise from its own seed.
        A zero draw would turn probs / noise into inf or nan, so the noise is clamped."""
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs)
        generator = self._generator(self._row_generators, probs.device, 0)
        for i, seed in enumerate(seeds):
            generator.manual_seed(seed)
            noise[i].exponential_(generator=generator)
        return probs.div_(noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)

    @staticmethod
    def _generator(cache: dict, device: torch.device, seed: int) -> torch.Generator:
        if device not in cache:
            cache[device] = torch.Generator(device=device)
            cache[device].manual_seed(seed)
        return cache[device]


def sample_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One categorical draw per row of non-negative, unnormalized weights [N, V]: the first token whose
    cumulative weight exceeds u * total, for uniforms u [N, 1] in [0, 1). Zero-weight tokens are never drawn:
    their cumulative weight equals the previous token's, and a draw that rounding pushes to the total is
    clamped to the first index reaching it (the last token with nonzero weight)."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    token_ids = torch.minimum(torch.searchsorted(cdf, uniforms * total, right=True), torch.searchsorted(cdf, total))
    if cdf.device.type != "cpu":  # a parallel cumsum may round non-monotonically (the CPU one is sequential)
        drawn = weights.gather(1, token_ids) > 0
        token_ids = torch.where(drawn, token_ids, weights.argmax(dim=-1, keepdim=True))
    return token_ids.squeeze(1)


def argmax(values: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (first maximal index, as torch.argmax). On CPU through numpy: torch's CPU
    argmax over a row is a scalar loop, ~40x slower than numpy's at a 1k-150k vocabulary."""
    if values.device.type == "cpu" and values.dtype == torch.float32 and values.numel():
        return torch.from_numpy(values.numpy().argmax(axis=-1))
    return values.argmax(dim=-1)


def _finite_row_max(logits: torch.Tensor) -> torch.Tensor:
    """Row max [N, 1], 0 where it is not finite (so a row of -inf gives logsumexp -inf, as torch's does)."""
    return logits.amax(dim=-1, keepdim=True).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def apply_top_k_top_p(logits: torch.Tensor, top_ks: Scalar | torch.Tensor | None,
                      top_ps: Scalar | torch.Tensor | None, max_top_k: int | None = None) -> torch.Tensor:
    """Mask to -inf all tokens outside each row's top-k, then outside the smallest set whose probability
    mass reaches top_p (the top token always stays). Ties with the last kept logit are kept too.
    With max_top_k (every row has a top-k, none larger) only the max_top_k largest logits are sorted, by
    topk: nothing past them can be kept, and sorting the whole vocabulary costs far more."""
    if max_top_k is not None and max_top_k < logits.shape[1]:
        sorted_logits = logits.topk(max_top_k, dim=-1).values  # sorted, largest first
    else:
        sorted_logits = logits.sort(dim=-1, descending=True).values
    ranks = torch.arange(sorted_logits.shape[1], device=logits.device)
    keep = torch.isfinite(sorted_logits)
    if top_ks is not None:
        keep &= ranks < top_ks
    if top_ps is not None:
        probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        keep &= mass_before < top_ps
    num_kept = keep.sum(dim=-1, keepdim=True).clamp_(min=1)
    threshold = sorted_logits.gather(1, num_kept - 1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_min_p(logits: torch.Tensor, log_min_ps: Scalar | torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p * the row's top probability (compared in log space)."""
    limit = logits.max(dim=-1, keepdim=True).values + log_min_ps
    return logits.masked_fill(logits < limit, float("-inf"))


def step_seed(seed: int, step: int) -> int:
    """Generator seed for one seeded row (seed in [0, 2**64)) at one output position: splitmix64's mix of
    seed + step * golden-ratio constant, a bijection on 64 bits, so every bit of the seed matters. torch's CPU
    generator keeps only the low 32 bits of its seed (Philox on CUDA keeps all 64), so the high half is folded
    into the low one: seeds that differ only above bit 32 (or 63) still get different streams."""
    x = (seed + step * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x ^ (x >> 32)


def _top_logprobs(logits, log_norm, token_ids, sampled_logprobs, meta) -> list[dict[int, float] | None]:
    top: list[dict[int, float] | None] = [None] * meta.num_rows
    if not meta.logprobs:
        return top
    rows = [row for row, _ in meta.logprobs]
    max_n = max(n for _, n in meta.logprobs)
    values, ids = [], []
    if max_n > 0:
        row_index = torch.tensor(rows, device=logits.device)
        logprobs = logits[row_index] - log_norm[row_index].unsqueeze(1)
        found = logprobs.topk(min(max_n, logits.shape[1]), dim=-1)
        values, ids = found.values.tolist(), found.indices.tolist()
    for i, (row, n) in enumerate(meta.logprobs):
        entry = dict(zip(ids[i][:n], values[i][:n])) if n else {}
        entry[token_ids[row]] = sampled_logprobs[row]
        top[row] = entry
    return top


def _sampled_ranks(logits: torch.Tensor, token_ids: torch.Tensor, meta) -> list[int | None]:
    """For the rows asking for logprobs: how many tokens have a logit at least the sampled token's (vLLM's rank)."""
    ranks: list[int | None] = [None] * meta.num_rows
    if not meta.logprobs:
        return ranks
    rows = torch.tensor([row for row, _ in meta.logprobs], device=logits.device)
    chosen = logits[rows].gather(1, token_ids[rows].unsqueeze(1))
    for row, rank in zip(rows.tolist(), (logits[rows] >= chosen).sum(dim=-1).tolist()):
        ranks[row] = rank
    return ranks


def _build_penalties(seqs, reps, presences, frequencies, device) -> Penalties:
    rows = [i for i, (r, p, f) in enumerate(zip(reps, presences, frequencies)) if r != 1.0 or p or f]
    column = lambda values: _tensor([values[i] for i in rows], torch.float32, device).unsqueeze(1)  # noqa: E731
    uses_repetition = any(reps[i] != 1.0 for i in rows)
    uses_counts = any(presences[i] or frequencies[i] for i in rows)
    return Penalties(
        rows=_tensor(rows, torch.long, device),
        all_ids=_padded([seqs[i].token_ids for i in rows], device) if uses_repetition else None,
        output_ids=_padded([seqs[i].output_token_ids for i in rows], device) if uses_counts else None,
        repetition=column(reps), presence=column(presences), frequency=column(frequencies))


def _build_banned(seqs, min_tokens, eos_token_id, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    eos_ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    rows, token_ids = [], []
    for row, (seq, minimum) in enumerate(zip(seqs, min_tokens)):
        if minimum and seq.num_output_tokens < minimum:
            banned = [t for t in seq.sampling_params.stop_token_ids if t < _MAX_TOKEN_ID] + eos_ids
            rows += [row] * len(banned)
            token_ids += banned
    if not rows:
        return None
    return _tensor(rows, torch.long, device), _tensor(token_ids, torch.long, device)


def _token_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[P, L] ids padded with -1 -> [P, V] float occurrence counts."""
    ids = ids.masked_fill(ids < 0, vocab_size)
    counts = torch.zeros(ids.shape[0], vocab_size + 1, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab_size]


def _padded(lists: list[list[int]], device) -> torch.Tensor:
    """Ragged id lists -> [len(lists), longest] long tensor padded with -1."""
    width = max(1, max(len(ids) for ids in lists))
    flat = array("q")
    for ids in lists:
        flat.extend(ids)
        flat.extend([-1] * (width - len(ids)))
    return _tensor(flat, torch.long, device).view(len(lists), width)


def _is_one(value: Scalar | torch.Tensor) -> bool:
    return not isinstance(value, torch.Tensor) and value == 1


def _column(values: list, dtype, device) -> Scalar | torch.Tensor:
    """One value per row -> that value when all rows agree, else a [N, 1] tensor."""
    if values.count(values[0]) == len(values):
        return values[0]
    return _tensor(values, dtype, device).unsqueeze(1)


_ARRAY_CODES = {torch.float32: "f", torch.long: "q", torch.bool: "B"}


def _tensor(values: list | array, dtype, device) -> torch.Tensor:
    """Host list -> device tensor. array + frombuffer is several times faster than torch.tensor(list);
    on CUDA the copy goes through pinned memory so it does not block the host."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    if not isinstance(values, array):
        values = array(_ARRAY_CODES[dtype], values)
    tensor = torch.frombuffer(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
