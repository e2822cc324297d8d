"""Sampler against plain-Python references: greedy, filtered sampling sets, frequencies, seeds, penalties,
min_tokens and logprobs. The per-row metadata comes from the InputBatch, as in the engine."""
import math
from types import SimpleNamespace

import pytest
import torch
from sampling_metadata import metadata as batch_metadata

from nanoserve.engine.sequence import Sequence
from nanoserve.engine.structured_output import TokenBitmask
from nanoserve.layers.sampler import Sampler, apply_top_k_top_p, argmax, sample_inverse_cdf, step_seed
from nanoserve.sampling_params import SamplingParams

EOS = 2


def make_seq(prompt=(5, 6, 7), output=(), request_id="r", **params) -> Sequence:
    seq = Sequence(request_id, list(prompt), SamplingParams(**params), max_tokens=64)
    seq.token_ids += output
    return seq


def metadata(seqs, eos=EOS, bitmask=None):
    return batch_metadata(seqs, eos, bitmask)


def sample(logits, seqs, sampler=None, eos=EOS, bitmask=None):
    """Sample, then read the tensors as the engine does: token ids, sampled logprobs, and per row that asks for
    them, the top-n logprobs with the sampled token's."""
    meta = metadata(seqs, eos, bitmask)
    out = (sampler or Sampler())(logits, meta)
    token_ids, logprobs = out.token_ids.tolist(), out.sampled_logprobs.tolist()
    top, ranks = [None] * len(seqs), [None] * len(seqs)
    for i, row in enumerate(meta.logprob_rows):
        n = seqs[row].sampling_params.logprobs
        entry = dict(zip(out.top_token_ids[i, :n].tolist(), out.top_logprobs[i, :n].tolist())) if n else {}
        entry[token_ids[row]] = logprobs[row]
        top[row], ranks[row] = entry, int(out.sampled_ranks[i])
    return SimpleNamespace(token_ids=token_ids, sampled_logprobs=logprobs, top_logprobs=top, sampled_ranks=ranks)


def random_logits(rows, vocab, seed=0, scale=3.0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


# ---- plain references ------------------------------------------------------------------------------------

def softmax(values):
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    return [e / sum(exps) for e in exps]


def allowed_tokens(row_logits, temperature, top_k, top_p, min_p):
    """{token: probability} that sampling may return: top-k, then the smallest top-p nucleus, then min-p."""
    order = sorted(range(len(row_logits)), key=lambda t: -row_logits[t])
    if top_k > 0:
        order = order[:top_k]
    probs = softmax([row_logits[t] / temperature for t in order])
    kept, mass = [], 0.0
    for token, prob in zip(order, probs):
        if mass >= top_p:
            break
        kept.append((token, prob))
        mass += prob
    best = kept[0][1]
    kept = [(token, prob) for token, prob in kept if prob >= min_p * best]
    mass = sum(prob for _, prob in kept)
    return {token: prob / mass for token, prob in kept}


def penalized(row_logits, prompt, output, repetition=1.0, presence=0.0, frequency=0.0):
    out = list(row_logits)
    for token in set(prompt) | set(output):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token in set(output):
        out[token] -= presence + frequency * output.count(token)
    return out


def log_softmax(values):
    top = max(values)
    norm = top + math.log(sum(math.exp(v - top) for v in values))
    return [v - norm for v in values]


# ---- greedy ----------------------------------------------------------------------------------------------

def test_all_greedy_batch_is_argmax_and_builds_nothing():
    logits = random_logits(6, 50)
    seqs = [make_seq(temperature=0.0, top_k=5, top_p=0.5, request_id=str(i)) for i in range(6)]
    meta = metadata(seqs)
    assert meta.all_greedy and meta.top_ks is None and meta.top_ps is None and meta.penalties is None
    out = sample(logits, seqs)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.top_logprobs == [None] * 6


def test_greedy_rows_in_a_sampled_batch_take_the_argmax():
    logits = random_logits(8, 100, seed=1, scale=0.1)  # flat: sampled rows rarely hit the argmax
    seqs = [make_seq(temperature=0.0 if i % 2 else 1.5, request_id=str(i)) for i in range(8)]
    for step in range(5):
        out = sample(logits, seqs, Sampler(seed=step))
        for i in range(1, 8, 2):
            assert out.token_ids[i] == int(logits[i].argmax())


def test_tiny_temperature_is_greedy():
    logits = random_logits(3, 40)
    out = sample(logits, [make_seq(temperature=1e-7, request_id=str(i)) for i in range(3)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_empty_batch():
    out = sample(torch.empty(0, 10), [])
    assert out.token_ids == [] and out.sampled_logprobs == [] and out.top_logprobs == []


# ---- filtered sampling -----------------------------------------------------------------------------------

FILTERS = [  # temperature, top_k, top_p, min_p
    (1.0, 5, 1.0, 0.0),
    (0.7, -1, 0.6, 0.0),
    (1.3, 0, 1.0, 0.2),
    (1.0, 10, 0.8, 0.05),
    (2.0, 3, 0.3, 0.0),
    (0.5, 1, 1.0, 0.0),
]


def test_samples_stay_inside_the_reference_top_k_top_p_min_p_set():
    vocab, draws = 30, 400
    logits = random_logits(len(FILTERS), vocab, seed=2, scale=1.5)
    rows, seqs = [], []
    for i, (t, k, p, m) in enumerate(FILTERS):
        for j in range(draws):
            rows.append(i)
            seqs.append(make_seq(temperature=t, top_k=k, top_p=p, min_p=m, request_id=f"{i}-{j}"))
    out = sample(logits[rows], seqs, Sampler(seed=3))
    for i, (t, k, p, m) in enumerate(FILTERS):
        allowed = allowed_tokens(logits[i].tolist(), t, k, p, m)
        got = {tok for tok, row in zip(out.token_ids, rows) if row == i}
        assert set(got) <= set(allowed), (FILTERS[i], set(got) - set(allowed))
        likely = {token for token, prob in allowed.items() if prob > 0.03}  # P(never drawn in 400) < 1e-5
        assert likely <= got


def test_mixed_filters_do_not_leak_between_rows():
    """A row without top-k next to a top-k=1 row still samples freely (per-row parameters stay per row)."""
    logits = random_logits(1, 20, seed=4, scale=0.2).repeat(200, 1)
    seqs = [make_seq(top_k=1 if i % 2 else -1, request_id=str(i)) for i in range(200)]
    out = sample(logits, seqs)
    assert set(out.token_ids[1::2]) == {int(logits[0].argmax())}
    assert len(set(out.token_ids[0::2])) > 5


def chi_square(counts, probs, total):
    return sum((counts.get(t, 0) - total * p) ** 2 / (total * p) for t, p in enumerate(probs) if p > 0)


@pytest.mark.parametrize("seeded", [False, True])
def test_sampling_frequencies_match_softmax(seeded):
    """20k draws over a 6-token vocab at T=0.7: chi-square below the 0.1% critical value for 5 dof (20.5).
    Deterministic: the Sampler and the per-row seeds are fixed."""
    base = torch.tensor([[1.0, 0.5, 0.0, -0.5, 0.3, -1.0]])
    total = 20000
    seqs = [make_seq(temperature=0.7, seed=i if seeded else None, request_id=str(i)) for i in range(total)]
    out = sample(base.repeat(total, 1), seqs, Sampler(seed=11))
    counts = {t: out.token_ids.count(t) for t in set(out.token_ids)}
    probs = softmax([v / 0.7 for v in base[0].tolist()])
    assert chi_square(counts, probs, total) < 20.5


def test_top_k_frequencies_match_the_renormalized_distribution():
    base = torch.tensor([[2.0, 1.0, 0.5, 0.2, 0.1, 0.0]])
    total = 20000
    out = sample(base.repeat(total, 1), [make_seq(top_k=3, request_id=str(i)) for i in range(total)], Sampler(5))
    counts = {t: out.token_ids.count(t) for t in set(out.token_ids)}
    assert set(counts) == {0, 1, 2}
    probs = softmax(base[0, :3].tolist()) + [0.0] * 3
    assert chi_square(counts, probs, total) < 13.8  # 2 dof, 0.1%


# ---- seeds -----------------------------------------------------------------------------------------------

def test_seeded_row_ignores_batch_composition_and_position():
    vocab = 500
    target = random_logits(1, vocab, seed=6, scale=0.3)
    seeded = make_seq(output=[1, 2, 3], seed=1234, top_p=0.95, request_id="seeded")
    results = set()
    for trial in range(6):
        others = [make_seq(temperature=[0.0, 0.8, 1.2][j % 3], top_k=[-1, 7][j % 2], seed=None if j % 2 else j,
                           request_id=str(j)) for j in range(trial)]
        position = trial // 2
        seqs = others[:position] + [seeded] + others[position:]
        logits = torch.cat([random_logits(position, vocab, seed=trial), target,
                            random_logits(trial - position, vocab, seed=100 + trial)])
        out = sample(logits, seqs, Sampler(seed=trial))
        results.add(out.token_ids[position])
    assert len(results) == 1


def test_seeded_row_repeats_across_calls_and_varies_with_step_and_seed():
    logits = random_logits(1, 1000, seed=7, scale=0.1)
    sampler = Sampler()
    first = [sample(logits, [make_seq(seed=9)], sampler).token_ids[0] for _ in range(3)]
    assert len(set(first)) == 1
    by_step = {sample(logits, [make_seq(output=[4] * step, seed=9)]).token_ids[0] for step in range(10)}
    by_seed = {sample(logits, [make_seq(seed=seed)]).token_ids[0] for seed in range(10)}
    assert len(by_step) > 5 and len(by_seed) > 5


def test_unseeded_rows_follow_the_sampler_seed():
    logits = random_logits(4, 1000, seed=8, scale=0.1)
    seqs = [make_seq(request_id=str(i)) for i in range(4)]
    assert sample(logits, seqs, Sampler(seed=1)).token_ids == sample(logits, seqs, Sampler(seed=1)).token_ids
    sampler = Sampler(seed=1)
    assert sample(logits, seqs, sampler).token_ids != sample(logits, seqs, sampler).token_ids


def test_step_seed_is_distinct():
    values = {step_seed(seed, step) for seed in range(50) for step in range(50)}
    assert len(values) == 2500 and all(0 <= v < 2 ** 64 for v in values)
    assert 0 <= step_seed(2 ** 64 - 1, 2 ** 20) < 2 ** 64  # the largest seed still fits a generator


def test_seeds_that_differ_only_in_high_bits_give_different_streams():
    """torch's CPU generator keeps only the low 32 bits of its seed: seeds 2**32 or 2**63 apart must not alias."""
    logits = random_logits(1, 1000, seed=11, scale=0.1)

    def stream(seed):
        return [sample(logits, [make_seq(output=[4] * step, seed=seed)]).token_ids[0] for step in range(8)]

    streams = {tuple(stream(seed)) for seed in (5, 5 + 2 ** 32, 5 + 2 ** 63, 2 ** 64 - 1)}
    assert len(streams) == 4


def test_top_k_beyond_the_vocabulary_keeps_every_token():
    logits = random_logits(1, 50, seed=12).repeat(2, 1)
    seqs = [make_seq(top_k=2 ** 63 - 1, seed=3, request_id="a"), make_seq(top_k=-1, seed=3, request_id="b")]
    meta = metadata(seqs, EOS)
    assert meta.top_ks is None and meta.max_top_k is None
    out = Sampler()(logits, meta)
    assert out.token_ids[0] == out.token_ids[1]  # same seed, same logits: the huge top-k filtered nothing


# ---- penalties, min_tokens -------------------------------------------------------------------------------

PENALTY_ROWS = [  # prompt, output, repetition, presence, frequency
    ([1, 2, 3], [3, 4, 4, 9], 1.3, 0.0, 0.0),
    ([1, 2, 3], [3, 4, 4, 9], 1.0, 0.5, 0.0),
    ([0, 7], [7, 7, 7, 1], 1.0, 0.0, 0.4),
    ([5, 6], [6, 8, 8], 0.8, -0.3, 0.25),
    ([1, 2], [2], 1.0, 0.0, 0.0),  # no penalty: untouched
    ([4], [], 1.5, 1.0, 1.0),
]


def penalty_batch():
    seqs = [make_seq(prompt=p, output=o, repetition_penalty=r, presence_penalty=pr, frequency_penalty=f,
                     temperature=0.0, logprobs=3, request_id=str(i))
            for i, (p, o, r, pr, f) in enumerate(PENALTY_ROWS)]
    return random_logits(len(PENALTY_ROWS), 12, seed=9), seqs


def test_penalties_match_the_formulas():
    logits, seqs = penalty_batch()
    meta = metadata(seqs)
    edited = logits.clone()
    meta.penalties.apply(edited)
    for i, (prompt, output, r, pr, f) in enumerate(PENALTY_ROWS):
        expected = penalized(logits[i].tolist(), prompt, output, r, pr, f)
        assert edited[i].tolist() == pytest.approx(expected, abs=1e-5)


def test_logprobs_and_greedy_choice_see_the_penalized_logits():
    logits, seqs = penalty_batch()
    out = sample(logits, seqs)
    for i, (prompt, output, r, pr, f) in enumerate(PENALTY_ROWS):
        expected = log_softmax(penalized(logits[i].tolist(), prompt, output, r, pr, f))
        best = max(range(12), key=lambda t: expected[t])
        assert out.token_ids[i] == best
        assert out.sampled_logprobs[i] == pytest.approx(expected[best], abs=1e-5)
    assert torch.equal(logits, penalty_batch()[0])  # the caller's logits are not modified


def test_no_penalty_metadata_without_penalties():
    assert metadata([make_seq(output=[1, 1])]).penalties is None


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.zeros(1, 10)
    logits[0, EOS], logits[0, 7], logits[0, 3] = 10.0, 9.0, 8.0
    for produced in range(4):
        seq = make_seq(output=[5] * produced, min_tokens=3, stop_token_ids=[7, 50], temperature=0.0, logprobs=0)
        out = sample(logits, [seq])
        assert out.token_ids == ([3] if produced < 3 else [EOS])
    seq = make_seq(min_tokens=2, stop_token_ids=[7], ignore_eos=True)
    meta = metadata([seq])
    assert sorted(meta.banned[1].tolist()) == [EOS, 7]
    for _ in range(20):
        assert sample(logits, [seq]).token_ids[0] not in (EOS, 7)


def test_min_tokens_without_eos_id_masks_stop_ids_only():
    logits = torch.zeros(1, 10)
    logits[0, EOS], logits[0, 7] = 10.0, 9.0
    assert sample(logits, [make_seq(min_tokens=1, stop_token_ids=[EOS], temperature=0.0)], eos=None).token_ids \
        == [7]


def test_min_tokens_with_several_eos_ids_and_out_of_vocab_stop_ids():
    logits = torch.zeros(1, 10)
    logits[0, EOS], logits[0, 4], logits[0, 7] = 10.0, 9.0, 8.0
    seq = make_seq(min_tokens=1, stop_token_ids=[12, 2 ** 70], temperature=0.0)
    assert sample(logits, [seq], eos=[EOS, 4]).token_ids == [7]


# ---- logprobs --------------------------------------------------------------------------------------------

def test_logprobs_are_log_softmax_and_top_n_are_the_largest():
    logits = random_logits(4, 40, seed=10)
    seqs = [make_seq(logprobs=n, temperature=t, request_id=str(i))
            for i, (n, t) in enumerate([(5, 1.0), (0, 1.0), (None, 0.0), (20, 0.0)])]
    out = sample(logits, seqs)
    for i, n in enumerate([5, 0, None, 20]):
        reference = log_softmax(logits[i].tolist())
        token = out.token_ids[i]
        assert out.sampled_logprobs[i] == pytest.approx(reference[token], abs=1e-5)
        if n is None:
            assert out.top_logprobs[i] is None and out.sampled_ranks[i] is None
            continue
        largest = sorted(range(40), key=lambda t: -reference[t])[:n]
        assert set(out.top_logprobs[i]) == set(largest) | {token}
        assert out.sampled_ranks[i] == sum(value >= reference[token] for value in reference)  # vLLM's rank
        for t, value in out.top_logprobs[i].items():
            assert value == pytest.approx(reference[t], abs=1e-5)


def test_logprobs_ignore_temperature_and_filters():
    """Returned logprobs describe the (penalized) model distribution, not the tempered/filtered one."""
    logits = random_logits(1, 30, seed=12)
    out = sample(logits, [make_seq(temperature=0.3, top_k=2, logprobs=3)])
    reference = log_softmax(logits[0].tolist())
    assert out.sampled_logprobs[0] == pytest.approx(reference[out.token_ids[0]], abs=1e-5)


# ---- metadata --------------------------------------------------------------------------------------------

def test_uniform_parameters_become_scalars_and_mixed_ones_tensors():
    same = [make_seq(temperature=0.8, top_p=0.9, request_id=str(i)) for i in range(3)]
    meta = metadata(same)
    assert meta.temperatures == pytest.approx(0.8) and meta.top_ps == pytest.approx(0.9) and meta.top_ks is None
    mixed = [make_seq(temperature=t, top_k=k, request_id=str(i)) for i, (t, k) in
             enumerate([(0.0, 2), (0.5, -1), (0.75, 3)])]
    meta = metadata(mixed)
    assert meta.greedy.tolist() == [True, False, False]
    assert meta.temperatures.view(-1).tolist() == [1.0, 0.5, 0.75] and meta.top_ks.view(-1).tolist()[2] == 3
    assert meta.max_top_k is None  # row 1 has no top-k
    assert metadata(mixed[:2]).top_ks is None  # only the greedy row sets one, and greedy rows ignore filters


# ---- inverse CDF (unseeded rows) -------------------------------------------------------------------------

def test_inverse_cdf_never_draws_a_zero_weight_token_even_at_the_edges():
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0, 0.0],
                            [5.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                            [0.0, 0.0, 0.0, 0.0, 0.0, 1e-30],
                            [1e-30, 3.0, 0.0, 1e-30, 0.0, 0.0]])
    top = 1.0 - 2.0 ** -24  # the largest float32 below 1: u * total may round up to the total
    for u in (0.0, 1e-9, 0.5, top, 1.0):  # 1.0 is outside [0, 1), still clamped to a drawable token
        token_ids = sample_inverse_cdf(weights, torch.full((4, 1), u)).tolist()
        for row, token in enumerate(token_ids):
            assert weights[row, token] > 0, (u, row, token)
    # the last token whose weight still moves the float32 running sum (3 + 1e-30 == 3)
    assert sample_inverse_cdf(weights, torch.full((4, 1), top)).tolist() == [3, 0, 5, 1]
    assert sample_inverse_cdf(weights, torch.zeros(4, 1)).tolist() == [1, 0, 5, 0]


def test_inverse_cdf_frequencies_match_the_weights():
    weights = torch.tensor([[3.0, 0.0, 1.0, 0.5, 0.0, 2.5]])
    total = 20000
    uniforms = torch.rand(total, 1, generator=torch.Generator().manual_seed(13))
    token_ids = sample_inverse_cdf(weights.repeat(total, 1), uniforms).tolist()
    counts = {t: token_ids.count(t) for t in set(token_ids)}
    assert set(counts) == {0, 2, 3, 5}
    assert chi_square(counts, (weights[0] / weights.sum()).tolist(), total) < 16.3  # 3 dof, 0.1%


def test_argmax_is_torch_argmax_including_ties():
    values = torch.tensor([[1.0, 3.0, 3.0, 0.0], [-1.0, -1.0, -2.0, -1.0], [float("-inf"), 0.0, 0.0, 7.0]])
    assert argmax(values).tolist() == values.argmax(dim=-1).tolist() == [1, 0, 3]
    big = random_logits(64, 1000, seed=14)
    assert torch.equal(argmax(big), big.argmax(dim=-1))


def test_sampled_logprobs_with_masked_tokens_are_log_softmax():
    """min_tokens puts -inf into the logits: the normalizer must still be the log-sum-exp over the rest."""
    logits = random_logits(3, 20, seed=15)
    seqs = [make_seq(min_tokens=2, stop_token_ids=[4, 9], temperature=t, request_id=str(i))
            for i, t in enumerate([0.0, 0.7, 1.0])]
    out = sample(logits, seqs)
    for row in range(3):
        masked = logits[row].tolist()
        for token in (EOS, 4, 9):
            masked[token] = float("-inf")
        reference = log_softmax([v for v in masked if v != float("-inf")])
        kept = [t for t, v in enumerate(masked) if v != float("-inf")]
        token = out.token_ids[row]
        assert token in kept
        assert out.sampled_logprobs[row] == pytest.approx(reference[kept.index(token)], abs=1e-5)


def test_top_k_candidates_give_the_same_filter_as_a_full_sort():
    logits = (random_logits(6, 200, seed=17) * 2).round() / 2  # coarse values: many ties at the cut
    logits[1, :150] = float("-inf")  # fewer finite logits than k
    top_ks = torch.tensor([[1], [60], [7], [25], [3], [40]])
    top_ps = torch.tensor([[1.0], [0.5], [0.9], [math.inf], [0.3], [0.99]])
    for ps in (None, top_ps):
        full = apply_top_k_top_p(logits, top_ks, ps)
        assert torch.equal(apply_top_k_top_p(logits, top_ks, ps, max_top_k=60), full)
    assert torch.equal(apply_top_k_top_p(logits, 5, 0.8, max_top_k=5), apply_top_k_top_p(logits, 5, 0.8))


def test_max_top_k_only_when_every_sampled_row_sets_top_k():
    def meta(*params):
        return metadata([make_seq(request_id=str(i), **p) for i, p in enumerate(params)])
    assert meta(dict(top_k=5), dict(top_k=20)).max_top_k == 20
    assert meta(dict(top_k=5), dict(top_k=-1)).max_top_k is None
    assert meta(dict(top_k=5), dict(top_k=-1, temperature=0.0)).max_top_k == 5  # a greedy row ignores filters


# ---- structured outputs -----------------------------------------------------------------------------------

def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[N, V] bool -> [N, ceil(V / 32)] int32, bit j % 32 of word j // 32 set where token j is allowed."""
    words = []
    for row in allowed.tolist():
        values = [sum(1 << bit for bit, ok in enumerate(row[start:start + 32]) if ok)
                  for start in range(0, len(row), 32)]
        words.append([value - (1 << 32) if value >= 1 << 31 else value for value in values])
    return torch.tensor(words, dtype=torch.int32)


def test_token_bitmask_confines_its_rows_and_no_other():
    vocab, rows = 100, [1, 3, 4]  # 100: the last word is partly past the vocabulary
    logits = random_logits(6, vocab, seed=21, scale=1.0)
    allowed = torch.rand(6, vocab, generator=torch.Generator().manual_seed(22)) < 0.1
    allowed[:, 7] = True  # every row allows something
    seqs = [make_seq(temperature=0.0 if row in (3, 5) else 1.0, request_id=str(row)) for row in range(6)]
    for seed in range(20):
        masked = sample(logits, seqs, Sampler(seed), bitmask=TokenBitmask(pack_bitmask(allowed), rows))
        plain = sample(logits, seqs, Sampler(seed))
        for row, token_id in enumerate(masked.token_ids):
            if row not in rows:
                assert token_id == plain.token_ids[row]
            elif row == 3:
                assert token_id == int(logits[row].masked_fill(~allowed[row], -math.inf).argmax())
            else:
                assert allowed[row, token_id]


def test_logit_bias_adds_to_its_rows_logits_only_before_sampling_and_logprobs():
    """OpenAI's logit_bias against the plain reference: the biased logits' argmax and log_softmax, with penalties
    applied first; other rows untouched; +-100 forces or bans a token."""
    logits = random_logits(3, 12, seed=5)
    bias = {3: 100.0, 4: -2.5}
    seqs = [make_seq(temperature=0.0, logprobs=2, logit_bias=bias, output=[4], presence_penalty=1.0),
            make_seq(temperature=0.0, logprobs=0, request_id="plain"),
            make_seq(temperature=0.0, logit_bias={int(logits[2].argmax()): -100.0}, request_id="ban")]
    out = sample(logits, seqs)
    expected = penalized(logits[0].tolist(), [5, 6, 7], [4], presence=1.0)
    for token, value in bias.items():
        expected[token] += value
    assert out.token_ids[0] == 3 and out.sampled_logprobs[0] == pytest.approx(log_softmax(expected)[3], abs=1e-5)
    assert out.token_ids[1] == int(logits[1].argmax())
    assert out.sampled_logprobs[1] == pytest.approx(log_softmax(logits[1].tolist())[out.token_ids[1]], abs=1e-5)
    assert out.token_ids[2] == int(logits[2].topk(2).indices[1])
    assert metadata([make_seq()]).logit_bias is None


@pytest.mark.parametrize("bias, message", [
    ({"x": 1.0}, "logit_bias: keys are token ids"), ({"-1": 1.0}, "logit_bias: must be >= 0"),
    ({"1": 101}, "logit_bias: must be <= 100.0"), ({"1": "a"}, "logit_bias: expected a number"),
    ([1], "logit_bias: expected a JSON object"),
])
def test_logit_bias_is_checked(bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)
    assert SamplingParams.from_dict({"logit_bias": '{"7": -1}'}).logit_bias == {7: -1.0}
    with pytest.raises(ValueError, match=r"logit_bias: token id 12 is outside the vocabulary \[0, 12\)"):
        SamplingParams(logit_bias={"12": 1}).check_against_model(64, 12, 5)
