"""Sampler: greedy, truncation masks, temperature, penalties, min_tokens, seeds, logprobs."""
import pytest
import torch

from qserve.engine.sampler import Sampler, SamplingRow, apply_penalties
from qserve.sampling_params import SamplingParams

EOS = 0


def row(prompt=(), output=(), seed=None, **kw) -> SamplingRow:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(SamplingParams(seed=seed, **kw), list(prompt), list(output), gen)


def draw(logits_1d: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """n independent samples from one row of logits (V,), as one batch of n identical rows."""
    rows = [row(**kw)] * n  # unseeded, so sharing one row object is harmless
    out = Sampler({EOS})(logits_1d.expand(n, -1).contiguous(), rows)
    return torch.tensor(out.token_ids)


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def test_greedy_is_argmax_and_ties_go_to_lowest_id():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 83, generator=g)
    logits[3, [5, 40, 70]] = 100.0  # a three-way tie
    out = Sampler()(logits, [row(temperature=0) for _ in range(7)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[3] == 5 and out.logprobs == [None] * 7


def test_top_k_1_is_greedy_at_any_temperature():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    out = Sampler()(logits, [row(top_k=1, temperature=t) for t in (0.1, 0.5, 1, 1.5, 2)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_mixed_batch_greedy_rows_unaffected_and_logits_untouched():
    logits = torch.randn(6, 31, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    rows = [row(temperature=0), row(top_p=0.5, seed=3), row(temperature=0, logprobs=2),
            row(repetition_penalty=1.5, prompt=[1], output=[2]), row(temperature=0),
            row(min_tokens=4, output=[1])]
    out = Sampler({EOS})(logits, rows)
    assert torch.equal(logits, before)
    for i in (0, 2, 4):
        assert out.token_ids[i] == int(logits[i].argmax())


@pytest.mark.parametrize("kw, allowed", [
    (dict(top_k=3), {0, 1, 2}),
    (dict(top_k=-1), set(range(8))),
    (dict(top_p=0.35), {0}),  # mass before token 1 is 0.40 >= 0.35
    (dict(top_p=0.65), {0, 1}),  # 0.40 < 0.65, then 0.70 >= 0.65
    (dict(top_p=0.75), {0, 1, 2}),  # smallest set reaching 0.75 is 0.4 + 0.3 + 0.1
    (dict(top_p=1.0), set(range(8))),
    # top-k renormalises before top-p: {0,1,2} -> 4/8, 3/8, 1/8, and 0.875 >= 0.8
    (dict(top_k=3, top_p=0.8), {0, 1}),
    (dict(min_p=0.2), {0, 1, 2}),  # threshold 0.2 * 0.4 = 0.08
    (dict(min_p=0.5), {0, 1}),  # threshold 0.2: token 2 (0.1) goes
    (dict(top_k=2, min_p=0.7), {0, 1}),  # after top-k: 4/7, 3/7 and 0.7 * 4/7 = 0.4 < 3/7
])
def test_truncation_keeps_exactly_the_allowed_tokens(kw, allowed):
    probs = [0.4, 0.3, 0.1, 0.05, 0.05, 0.04, 0.03, 0.03]
    torch.manual_seed(0)
    # 20000 draws: every allowed token here has probability >= 0.03, so each is missed with
    # probability < (0.97)^20000; a masked one would show up unless the mask works.
    seen = set(draw(logits_of(probs), 20000, **kw).tolist())
    assert seen == allowed


@pytest.mark.parametrize("kws, allowed", [
    ([dict(top_k=2), dict()], [{0, 1}, set(range(8))]),  # only the top-2 are sorted
    ([dict(top_k=2), dict(top_p=0.35), dict(), dict(min_p=0.5, top_k=5)],
     [{0, 1}, {0}, set(range(8)), {0, 1}]),
])
def test_truncation_is_per_row_in_a_mixed_batch(kws, allowed):
    probs = [0.4, 0.3, 0.1, 0.05, 0.05, 0.04, 0.03, 0.03]
    n = 10000
    rows = [row(**kw) for kw in kws] * n
    torch.manual_seed(0)
    ids = Sampler()(logits_of(probs).expand(len(rows), -1).contiguous(), rows).token_ids
    for j, want in enumerate(allowed):
        assert set(ids[j::len(kws)]) == want


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# Chi-square critical value for 4 degrees of freedom at p = 0.001. With fixed seeds the test is
# deterministic; the threshold says that the result is not a fluke of the seed.
CHI2_DF4_P001 = 18.47


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax_of_scaled_logits(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    torch.manual_seed(1)
    counts = torch.bincount(draw(logits, 20000, temperature=temperature), minlength=5).float()
    assert chi_square(counts, torch.softmax(logits / temperature, -1)) < CHI2_DF4_P001


def test_seeded_stream_matches_softmax():
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.5]])
    sampler, r = Sampler(), row(seed=7, temperature=0.8)
    ids = [sampler(logits, [r]).token_ids[0] for _ in range(4000)]
    counts = torch.bincount(torch.tensor(ids), minlength=5).float()
    assert chi_square(counts, torch.softmax(logits[0] / 0.8, -1)) < CHI2_DF4_P001


def test_penalties_follow_the_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0],
                           [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    rows = [row(prompt=[0, 1], output=[1, 3, 3], repetition_penalty=2.0,
                presence_penalty=0.5, frequency_penalty=0.25),
            row(prompt=[0, 1], output=[1, 3, 3])]
    apply_penalties(logits, rows, [0])
    # token 0: prompt only, positive: 2 / 2.  token 1: seen, negative: -1 * 2, then once in the
    # output: - 0.25 - 0.5.  token 3: 3 / 2, twice in the output: - 2 * 0.25 - 0.5.
    assert logits[0].tolist() == [1.0, -2.75, 0.5, 0.5, -2.0, 0.0]
    assert logits[1].tolist() == [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]


def test_repetition_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])

    def greedy(**kw):
        return Sampler()(logits, [row(temperature=0, **kw)]).token_ids[0]

    assert greedy(prompt=[1]) == 1
    assert greedy(prompt=[1], repetition_penalty=2) == 2
    # presence/frequency look at the output only, not the prompt
    assert greedy(prompt=[1], presence_penalty=2) == 1
    assert greedy(output=[1], frequency_penalty=1.5) == 2


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.tensor([[5.0, 1.0, 4.0, 3.0]])  # EOS (0) is the argmax, then stop id 2
    s = Sampler({EOS})
    kw = dict(temperature=0, min_tokens=2, stop_token_ids=[2])
    assert s(logits, [row(output=[1], **kw)]).token_ids == [3]
    assert s(logits, [row(output=[1, 1], **kw)]).token_ids == [0]  # min_tokens reached
    # ignore_eos: EOS does not end the sequence, so it is not masked; stop ids still are
    assert s(logits, [row(output=[1], ignore_eos=True, **kw)]).token_ids == [0]
    logits = torch.tensor([[1.0, 2.0, 5.0, 3.0]])  # stop id 2 is the argmax
    assert s(logits, [row(output=[1], ignore_eos=True, **kw)]).token_ids == [3]


def test_min_tokens_never_samples_eos():
    logits = logits_of([0.9, 0.05, 0.05])
    torch.manual_seed(0)
    assert EOS not in draw(logits, 2000, min_tokens=1).tolist()


def seeded_stream(position: int, others: list[SamplingRow], steps=25) -> list[int]:
    """Tokens drawn for one seeded row at batch `position`, among `others`, over `steps` steps.
    The row's own logits come from a fixed generator; the neighbours' from the global one."""
    g = torch.Generator().manual_seed(123)
    target = row(seed=42, temperature=1.3, top_p=0.9, output=[1])
    out = []
    for _ in range(steps):
        mine, theirs = torch.randn(1, 1000, generator=g), torch.randn(len(others), 1000)
        logits = torch.cat([theirs[:position], mine, theirs[position:]])
        rows = others[:position] + [target] + others[position:]
        tok = Sampler({EOS})(logits, rows).token_ids[position]
        target.output_token_ids.append(tok)
        out.append(tok)
    return out


def test_seeded_row_ignores_batch_position_and_neighbours():
    alone = seeded_stream(0, [])
    assert len(set(alone)) > 5  # really sampling
    neighbours = [row(temperature=0), row(seed=7), row(top_k=5), row(min_p=0.1, logprobs=3),
                  row(repetition_penalty=1.2, output=[3, 4]), row(seed=42)]
    torch.manual_seed(999)
    assert seeded_stream(3, neighbours) == alone
    assert seeded_stream(6, neighbours[::-1]) == alone
    torch.manual_seed(5)
    assert seeded_stream(1, [row(), row()]) == alone


def test_logprobs_are_log_softmax_of_raw_logits_with_chosen_and_top_n():
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(3))
    top = int(logits[2].argmax())
    rows = [row(temperature=0, logprobs=3), row(logprobs=0, temperature=2.0, seed=0),
            row(temperature=0, logprobs=5, repetition_penalty=3.0, prompt=[top]),
            row(temperature=0)]
    out = Sampler()(logits, rows)
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[3] is None
    for i, n in [(0, 3), (1, 0), (2, 5)]:
        d, chosen = out.logprobs[i], out.token_ids[i]
        top = ref[i].topk(n).indices.tolist()
        assert set(d) == set(top) | {chosen}
        assert list(d)[:n] == top  # rank order first
        for t, lp in d.items():
            assert lp == pytest.approx(float(ref[i, t]), abs=1e-6)
    assert list(out.logprobs[1]) == [out.token_ids[1]]
    # the penalty moved row 2 off the raw argmax, so its chosen token is one of the top-5
    assert out.token_ids[2] != int(logits[2].argmax()) and out.token_ids[2] in out.logprobs[2]


class _MaskOnly:
    """A constraint allowing a fixed token set, counting the rows it masks."""

    def __init__(self, allowed: set[int]):
        self.allowed, self.mask_rows, self.checked = allowed, 0, 0

    def mask(self, logits, outputs):
        self.mask_rows += len(outputs)
        for t in range(logits.shape[1]):
            if t not in self.allowed:
                logits[:, t] = float("-inf")


class _Allowed(_MaskOnly):
    """The same, which can also check a sampled token."""

    def allows(self, outputs, tokens):
        self.checked += len(tokens)
        return [t in self.allowed for t in tokens]


def test_greedy_constrained_row_masks_only_a_refused_token():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [0.0, 3.0, 1.0, 2.0]])
    ok, refused = _Allowed({1, 2}), _Allowed({2, 3})
    out = Sampler()(logits, [row(temperature=0, constraint=ok),
                             row(temperature=0, constraint=refused)])
    assert out.token_ids == [1, 3]  # the argmax; the best token the grammar allows
    assert (ok.checked, ok.mask_rows) == (1, 0)
    assert (refused.checked, refused.mask_rows) == (1, 1)


@pytest.mark.parametrize("kw", [dict(top_p=0.9), dict(top_k=2), dict(min_p=0.1)])
def test_a_cut_the_mask_moves_masks_first(kw):
    c = _Allowed({0, 2})
    ids = draw(torch.tensor([3.0, 2.0, 1.0, 0.0]), 200, temperature=1.0, constraint=c, **kw)
    assert set(ids.tolist()) <= {0, 2}
    assert c.checked == 0 and c.mask_rows == 200


def test_checked_random_rows_draw_from_the_masked_distribution():
    # draw, and draw again from the masked logits when refused: p restricted to the allowed
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    allowed = {1, 2, 4}
    checked, masked = _Allowed(allowed), _MaskOnly(allowed)
    for c in (checked, masked):
        torch.manual_seed(2)
        counts = torch.bincount(draw(logits, 20000, temperature=1.0, constraint=c),
                                minlength=5).float()
        want = torch.softmax(logits, -1)[[1, 2, 4]]
        assert counts[[0, 3]].sum() == 0
        assert chi_square(counts[[1, 2, 4]], want / want.sum()) < 13.82  # 2 df, p = 0.001
    assert masked.mask_rows == 20000  # without `allows`, every row masked first
    assert 0 < checked.mask_rows < 0.7 * 20000  # only the refused: P(0 or 3) = 0.54
