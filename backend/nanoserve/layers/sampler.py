"""Logits -> next tokens, from tensors only (docs/architecture.md, "Sampler"). Unseeded rows draw by inverse CDF,
one uniform per row (Exp(1) noise for every vocabulary entry costs more than the rest of the sampler); seeded rows
by an exponential race whose noise depends only on (seed, tokens generated). Filtered-out tokens are never drawn."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from xgrammar import apply_token_bitmask_inplace

GREEDY_TEMPERATURE = 1e-5  # below this, logits / T can overflow float32: treat the row as greedy
_MASK64 = (1 << 64) - 1
Scalar = float | int


@dataclass
class Penalties:
    """Repetition penalty (HF/vLLM: over prompt + output tokens, positive logits divided, negative multiplied)
    and presence / frequency penalties (over output tokens: logit -= presence * (count > 0) + frequency * count)."""
    rows: torch.Tensor  # [P] batch rows that use any penalty
    all_ids: torch.Tensor | None  # [P, L] prompt + output ids, padded with -1; None without repetition penalty
    output_ids: torch.Tensor | None  # [P, L] output ids, -1 elsewhere; None without presence/frequency
    repetition: torch.Tensor  # [P, 1]
    presence: torch.Tensor  # [P, 1]
    frequency: torch.Tensor  # [P, 1]

    def apply(self, logits: torch.Tensor) -> None:
        vocab_size = logits.shape[1]
        rows = logits[self.rows]
        if self.all_ids is not None:
            seen = token_counts(self.all_ids, vocab_size) > 0
            penalized = torch.where(rows > 0, rows / self.repetition, rows * self.repetition)
            rows = torch.where(seen, penalized, rows)
        if self.output_ids is not None:
            counts = token_counts(self.output_ids, vocab_size)
            rows = rows - self.presence * (counts > 0) - self.frequency * counts
        logits[self.rows] = rows


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of the N rows sampled in one step. A parameter that is the same on every
    row is a Python number (cheaper to apply); otherwise a [N, 1] tensor. None: no row uses the feature."""
    num_rows: int
    all_greedy: bool
    greedy: torch.Tensor | None = None  # bool [N]; only for a batch that mixes greedy and sampled rows
    temperatures: Scalar | torch.Tensor = 1.0  # 1.0 on greedy rows
    top_ks: Scalar | torch.Tensor | None = None  # huge where top-k is off
    max_top_k: int | None = None  # the largest top-k when every sampled row sets one: only that many candidates
    top_ps: Scalar | torch.Tensor | None = None  # +inf where top-p is off
    log_min_ps: Scalar | torch.Tensor | None = None  # -inf where min-p is off
    seeds: list[tuple[int, int]] = field(default_factory=list)  # (row, seed in [0, 2**64)) of seeded sampled rows
    seed_steps: list[int] = field(default_factory=list)  # per seeds entry: how many tokens the row has generated
    penalties: Penalties | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) masked, e.g. by min_tokens
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, token ids, added to the logit)
    # structured outputs: (bitmask [N, ceil(V / 32)] int32, the rows it constrains); bit j % 32 of word j // 32
    # allows token j, every other token of those rows is masked
    token_bitmask: tuple[torch.Tensor, list[int]] | None = None
    logprob_rows: list[int] = field(default_factory=list)  # rows that want top logprobs
    max_logprobs: int = 0  # how many top logprobs the most demanding of them wants


@dataclass
class SamplerOutput:
    """Tensors on the logits' device: token_ids [N], sampled_logprobs [N] (log-softmax of the penalized logits
    at the sampled token), and for metadata.logprob_rows the max_logprobs largest logprobs and their ids."""
    token_ids: torch.Tensor
    sampled_logprobs: torch.Tensor
    top_logprobs: torch.Tensor | None = None  # [len(logprob_rows), max_logprobs] float32
    top_token_ids: torch.Tensor | None = None  # [len(logprob_rows), max_logprobs] int64
    # [len(logprob_rows)] int64: the sampled token's rank, 1 + the tokens with a larger logprob (ties count as
    # larger, as in vLLM)
    sampled_ranks: torch.Tensor | None = None


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}  # shared by unseeded rows, per device
        self._row_generators: dict[torch.device, torch.Generator] = {}  # re-seeded for each seeded row

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if meta.penalties is not None or meta.banned is not None or meta.token_bitmask is not None or \
                meta.logit_bias is not None:
            logits = logits.clone()
            if meta.penalties is not None:
                meta.penalties.apply(logits)
            if meta.logit_bias is not None:
                rows, token_ids, biases = meta.logit_bias
                logits.index_put_((rows, token_ids), biases, accumulate=True)
            if meta.banned is not None:
                rows, token_ids = meta.banned
                in_vocab = token_ids < logits.shape[1]  # an out-of-vocab stop_token_id can never be sampled
                logits[rows[in_vocab], token_ids[in_vocab]] = float("-inf")
            if meta.token_bitmask is not None:
                bitmask, rows = meta.token_bitmask
                apply_token_bitmask_inplace(logits, bitmask, indices=rows)
        # row max, 0 where not finite (a row of -inf gives logsumexp -inf, as torch's does)
        row_max = logits.amax(dim=-1, keepdim=True).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        shifted = logits - row_max  # the row max becomes 0: exp never overflows
        weights = shifted.exp()  # unnormalized probabilities at temperature 1
        log_norm = weights.sum(dim=-1).log_().add_(row_max.squeeze(1))  # logsumexp(logits), in fewer passes
        if meta.all_greedy:
            token_ids = argmax(logits)
        else:
            token_ids = self._sample(logits, shifted, weights, meta)
        sampled_logprobs = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1).sub_(log_norm)
        out = SamplerOutput(token_ids, sampled_logprobs)
        if meta.logprob_rows:
            rows = torch.tensor(meta.logprob_rows, device=logits.device)
            row_logits = logits[rows]
            out.sampled_ranks = (row_logits >= row_logits.gather(1, token_ids[rows].unsqueeze(1))).sum(dim=-1)
            if meta.max_logprobs > 0:
                top = (row_logits - log_norm[rows].unsqueeze(1)).topk(min(meta.max_logprobs, logits.shape[1]), dim=-1)
                out.top_logprobs, out.top_token_ids = top.values, top.indices
        return out

    def _sample(self, logits: torch.Tensor, shifted: torch.Tensor, weights: torch.Tensor,
                meta: SamplingMetadata) -> torch.Tensor:
        """Sampled token ids [N]. shifted = logits - row max and weights = exp(shifted) are scratch: both are
        overwritten here. Temperature and the filters act on shifted logits (the same distributions)."""
        # once true, weights are no longer exp(scaled)
        reweighted = isinstance(meta.temperatures, torch.Tensor) or meta.temperatures != 1
        scaled = shifted.div_(meta.temperatures) if reweighted else shifted  # the row max stays 0
        if meta.top_ks is not None or meta.top_ps is not None:
            scaled, reweighted = apply_top_k_top_p(scaled, meta.top_ks, meta.top_ps, meta.max_top_k), True
        if meta.log_min_ps is not None:
            scaled, reweighted = apply_min_p(scaled, meta.log_min_ps), True
        if len(meta.seeds) < meta.num_rows:
            if reweighted:
                weights = torch.exp(scaled, out=weights)
            uniforms = torch.rand((meta.num_rows, 1), generator=self._generator(
                self._generators, logits.device, self.seed), device=logits.device)
            sampled = sample_inverse_cdf(weights, uniforms)
        else:
            sampled = torch.empty(meta.num_rows, dtype=torch.long, device=logits.device)
        if meta.seeds:
            rows = torch.tensor([row for row, _ in meta.seeds], device=logits.device)
            seeds = [step_seed(seed, step) for (_, seed), step in zip(meta.seeds, meta.seed_steps)]
            sampled[rows] = self._seeded_race(scaled[rows], seeds)
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
            cache[device] = torch.Generator(device=device).manual_seed(seed)
        return cache[device]


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> tuple[torch.Tensor, ...]:
    """Logprobs of given tokens (prompt logprobs: the model's distribution, no penalties or temperature): for
    logits [N, V] and token_ids [N], the tokens' logprobs [N], their ranks [N] (1 + the tokens with a larger
    logprob, ties counting as larger, as for sampled tokens), and the num_top largest logprobs [N, num_top] and
    their token ids."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs >= chosen).sum(dim=-1)
    top = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)
    return chosen.squeeze(1), ranks, top.values, top.indices


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


def token_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[P, L] ids, -1 where there is none -> [P, V] float occurrence counts."""
    ids = ids.masked_fill(ids < 0, vocab_size)
    counts = torch.zeros(ids.shape[0], vocab_size + 1, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab_size]
