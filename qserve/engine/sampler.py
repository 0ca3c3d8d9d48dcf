"""Turn a batch of next-token logits into one token id per sequence.

Order, as in vLLM:
    penalties (on raw logits) -> min_tokens mask -> constraint mask (a grammar's)
    -> temperature -> top-k -> top-p -> min-p -> sample
Greedy rows take the argmax (ties go to the lowest id). Random rows use the exponential race,
argmax(p / E) with E ~ Exponential(1), which draws a token with probability p. A seeded row draws
E from its own generator only, so its token does not depend on the rest of the batch.

A constrained row whose sampling has no cut that the mask could move (greedy, or temperature
alone) samples first and asks its constraint after (`allows`); only a refused token costs a mask,
and the row samples again from the masked logits. This is exact: an allowed token that wins
unmasked also wins masked (greedy), and drawing from p until the draw is allowed draws from p
restricted to the allowed tokens (random). A grammar's mask can cost milliseconds per row (xgrammar
inside a length-bounded JSON string: ~10 ms), while a model asked for JSON mostly writes what the
grammar allows anyway.

Logprobs are log_softmax of the raw logits, before penalties, temperature and truncation (vLLM's
default): they describe the model, not the sampling settings.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from qserve.kernels import cpu_ops
from qserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One sequence to sample a token for. The sampler reads only these attributes, so the
    engine passes its Sequences themselves, whose prompt / output ids are slices made when
    read: a step that samples without penalties or a constraint copies no token list (at
    32 sequences of 2,000 output tokens, two copies each were ~0.4 ms of host time a step)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None  # set iff params.seed is set; best on the logits'
    # device (one on another device is drawn there and copied, so a CPU seed still works)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # per row: {chosen id: lp, top-N ids: lp} when params.logprobs is not None, else None
    logprobs: list[dict[int, float] | None]


class Sampler:
    """Samples one token per row; `eos_token_ids` are masked while a row is under min_tokens."""

    def __init__(self, eos_token_ids: set[int] | frozenset[int] = frozenset()):
        self.eos_token_ids = frozenset(eos_token_ids)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: (B, V) fp32, one row per entry of `rows` (SamplingRows, or anything with
        their attributes: the engine's Sequences); not modified."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        raw = logits
        penalized = [i for i, r in enumerate(rows) if r.params.has_penalties]
        under_min = [i for i, r in enumerate(rows) if r.num_output_tokens < r.params.min_tokens
                     and r.params.constraint is None]
        constrained = [i for i, r in enumerate(rows) if r.params.constraint is not None]
        checked = [i for i in constrained if checks_after_sampling(rows[i].params)]
        masked = [i for i in constrained if not checks_after_sampling(rows[i].params)]
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        want_lp = [i for i, r in enumerate(rows) if r.params.logprobs is not None]

        if penalized or under_min or constrained:
            logits = logits.clone()
            if penalized:
                apply_penalties(logits, rows, penalized)
            if under_min:
                self._mask_stop_tokens(logits, rows, under_min)
            if masked:
                apply_constraints(logits, rows, masked)
        token_ids = _pick(logits, rows, rand)  # (B,)
        if checked:
            refused = refused_rows(token_ids.tolist(), rows, checked)
            if refused:
                apply_constraints(logits, rows, refused)
                idx = torch.tensor(refused, device=logits.device)
                again = [k for k, i in enumerate(refused) if not rows[i].params.greedy]
                token_ids[idx] = _pick(logits[idx], [rows[i] for i in refused], again)
        ids = token_ids.tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(rows)
        if want_lp:
            for i, d in zip(want_lp, _logprobs(raw, token_ids, rows, want_lp)):
                logprobs[i] = d
        return SamplerOutput(token_ids=ids, logprobs=logprobs)

    def _mask_stop_tokens(self, logits: torch.Tensor, rows: list[SamplingRow],
                          idx: list[int]) -> None:
        """In place: rows `idx` of logits (B, V) get -inf on their stop tokens (EOS unless
        ignore_eos, and stop_token_ids). Ids outside the vocabulary cannot be sampled anyway."""
        V = logits.shape[1]
        row_ids, tok_ids = [], []
        for i in idx:
            p = rows[i].params
            stops = set(p.stop_token_ids) if p.ignore_eos else self.eos_token_ids | set(
                p.stop_token_ids)
            stops = [t for t in stops if t < V]
            row_ids += [i] * len(stops)
            tok_ids += stops
        if tok_ids:
            logits[torch.tensor(row_ids, device=logits.device),
                   torch.tensor(tok_ids, device=logits.device)] = float("-inf")


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> None:
    """In place on rows `idx` of logits (B, V):
        repetition (HF):  l -> l / r if l > 0 else l * r, once per token seen in prompt or output;
        then presence, frequency (OpenAI):  l -> l - frequency * count - presence, per token
        seen in the output, count = its occurrences there.
    Only the (row, token) pairs that occur are touched: O(tokens), not O(B * V)."""
    V, device = logits.shape[1], logits.device
    rep = [i for i in idx if rows[i].params.repetition_penalty != 1]
    if rep:
        r, t, _ = _occurrences(rep + rep, [rows[i].prompt_token_ids for i in rep]
                               + [rows[i].output_token_ids for i in rep], V, device)
        f = torch.tensor([row.params.repetition_penalty for row in rows], device=device)[r]
        vals = logits[r, t]
        logits[r, t] = torch.where(vals > 0, vals / f, vals * f)
    pf = [i for i in idx if rows[i].params.presence_penalty or rows[i].params.frequency_penalty]
    if pf:
        r, t, count = _occurrences(pf, [rows[i].output_token_ids for i in pf], V, device)
        freq = torch.tensor([row.params.frequency_penalty for row in rows], device=device)
        pres = torch.tensor([row.params.presence_penalty for row in rows], device=device)
        logits[r, t] -= freq[r] * count + pres[r]


def _pick(logits: torch.Tensor, rows: list[SamplingRow], rand: list[int]) -> torch.Tensor:
    """logits (B, V), not modified -> one id per row (B,): the argmax, or for rows `rand` a
    random draw."""
    token_ids = _argmax(logits)
    if rand:
        idx = torch.tensor(rand, device=logits.device)
        token_ids[idx] = _sample(logits[idx], [rows[i] for i in rand])
    return token_ids


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B,) int64, logits.argmax(dim=-1): on a CPU through the C kernels where they
    are built (cpu_ops.argmax_rows, the same ids)."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[1] and logits.stride(1) == 1 and cpu_ops.lib() is not None):
        return cpu_ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def checks_after_sampling(params: SamplingParams) -> bool:
    """Whether a row with this constraint samples first and asks the constraint after (see
    the module docstring): its constraint can answer `allows`, and no top-k / top-p / min-p
    cut would differ between the masked and the unmasked distribution."""
    return (hasattr(params.constraint, "allows")
            and (params.greedy or (params.top_k <= 0 and params.top_p >= 1
                                   and params.min_p <= 0)))


def refused_rows(token_ids: list[int], rows: list[SamplingRow], idx: list[int]) -> list[int]:
    """The rows among `idx` whose token their constraint refuses; each constraint answers for
    all its rows at once (and takes the tokens it allows as the rows' next)."""
    groups: dict[int, list[int]] = {}
    for i in idx:
        groups.setdefault(id(rows[i].params.constraint), []).append(i)
    refused = []
    for members in groups.values():
        allowed = rows[members[0]].params.constraint.allows(
            [rows[i].output_token_ids for i in members], [token_ids[i] for i in members])
        refused += [i for i, ok in zip(members, allowed) if not ok]
    return sorted(refused)


def apply_constraints(logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> None:
    """In place on rows `idx` of logits (B, V): each request's TokenConstraint masks its own
    rows, all of them in one call."""
    groups: dict[int, list[int]] = {}
    for i in idx:
        groups.setdefault(id(rows[i].params.constraint), []).append(i)
    for members in groups.values():
        t = torch.tensor(members, device=logits.device)
        sub = logits[t]  # (R, V) a copy
        rows[members[0]].params.constraint.mask(sub, [rows[i].output_token_ids for i in members])
        logits[t] = sub


def _occurrences(row_ids: list[int], seqs: list[list[int]], V: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct (row, token) pairs over seqs[k] taken as tokens of row row_ids[k] (a row may
    appear more than once), with how often each occurs: rows (N,), tokens (N,), counts (N,)."""
    lengths = torch.tensor([len(s) for s in seqs], device=device)
    rows = torch.repeat_interleave(torch.tensor(row_ids, device=device), lengths)
    toks = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.long, device=device)
    keys, counts = torch.unique(rows * V + toks, return_counts=True)
    return keys // V, keys % V, counts


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logits (R, V) of non-greedy rows, a copy that is overwritten -> sampled ids (R,)."""
    probs = _filtered_probs(logits, [r.params for r in rows])
    return race(probs, [r.generator for r in rows])


def _filtered_probs(logits: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
    """logits (R, V), overwritten -> softmax(logits / T) cut by top-k, top-p and min-p, (R, V).
    The min-p cut is not renormalised (the race does not need it)."""
    x = logits.div_(torch.tensor([p.temperature for p in ps], device=logits.device)[:, None])
    if any(0 < p.top_k < x.shape[1] or p.top_p < 1 for p in ps):
        x = _truncate(x, ps)
    probs = x.softmax(dim=-1)  # (R, V)
    if any(p.min_p > 0 for p in ps):
        min_p = torch.tensor([p.min_p for p in ps], device=logits.device)[:, None]
        probs.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """probs (R, V), non-negative, rows need not sum to 1, overwritten -> one id per row (R,),
    row r drawn with probability probs[r] / sum(probs[r]), from generators[r] when it is set."""
    # Exponential race: with E_t = -log U_t ~ Exponential(1) independent, argmax_t p_t / E_t
    # is t with probability p_t / sum(p), so min-p needs no renormalisation. U is in [0, 1),
    # so E is in (0, inf] and p / E is never 0 / 0.
    u = torch.empty_like(probs)
    if any(g is None for g in generators):
        u.uniform_()  # one draw for the unseeded rows; seeded rows redraw below
    for j, g in enumerate(generators):
        if g is None:
            continue
        if g.device.type == u.device.type:
            u[j].uniform_(generator=g)
        else:  # a generator elsewhere (the engine makes them on its device): draw, then copy
            u[j].copy_(torch.empty(u.shape[1], device=g.device).uniform_(generator=g))
    return probs.div_(u.log_().neg_()).argmax(dim=-1)


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution the sampler draws each row's token from, for rows without penalties
    or a min_tokens mask: one-hot at the argmax for greedy rows, else softmax(logits / T) cut
    by top-k, top-p and min-p, renormalised. logits (R, V) is not modified -> probs (R, V)."""
    probs = torch.zeros_like(logits)
    probs.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    rand = [i for i, p in enumerate(params) if not p.greedy]
    if rand:
        idx = torch.tensor(rand, device=logits.device)
        filtered = _filtered_probs(logits[idx], [params[i] for i in rand])
        probs[idx] = filtered / filtered.sum(dim=-1, keepdim=True)
    return probs


def _truncate(x: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
    """x (R, V) scaled logits -> x with -inf outside each row's top-k, then outside its top-p
    nucleus. Both cuts are value thresholds, so tokens tied with the last kept one are kept too
    (deterministic, whatever order the sort leaves ties in)."""
    V, device = x.shape[1], x.device
    ks = [p.top_k if 0 < p.top_k < V else V for p in ps]
    cuts = [k < V or p.top_p < 1 for k, p in zip(ks, ps)]
    # Only the K largest values of each row matter; K < V unless a row has top-p without top-k.
    K = max(k for k, c in zip(ks, cuts) if c)
    srt = x.topk(K, dim=-1).values if K < V else x.sort(dim=-1, descending=True).values  # (R, K)
    k = torch.tensor([min(k, K) for k in ks], device=device)[:, None]  # (R, 1)
    thresh = srt.gather(1, k - 1)  # (R, 1) the k-th largest value
    if any(p.top_p < 1 for p in ps):
        # Keep sorted position j while the mass strictly before it is < top_p: the smallest
        # prefix whose mass reaches top_p. Always keeps j = 0; top_p = 1 keeps everything.
        srt = srt.masked_fill(torch.arange(K, device=device) >= k, float("-inf"))
        top_p = torch.tensor([p.top_p for p in ps], device=device)[:, None]  # (R, 1)
        probs = srt.softmax(dim=-1)  # renormalised over the top-k
        before = probs.cumsum(dim=-1) - probs  # non-decreasing, so `keep` is a prefix
        keep = (before < top_p) | (top_p >= 1)
        n_keep = keep.sum(dim=-1, keepdim=True).clamp_(1, K)  # (R, 1)
        thresh = torch.maximum(thresh, srt.gather(1, n_keep - 1))
    if not all(cuts):
        thresh.masked_fill_(~torch.tensor(cuts, device=device)[:, None], float("-inf"))
    return x.masked_fill_(x < thresh, float("-inf"))


def _logprobs(raw: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow],
              idx: list[int]) -> list[dict[int, float]]:
    """raw (B, V) logits, token_ids (B,) chosen ids -> per row in idx: {top-N ids in rank order,
    then the chosen id: logprob}."""
    t = torch.tensor(idx, device=raw.device)
    return logprob_dicts(torch.log_softmax(raw[t], dim=-1), token_ids[t],
                         [rows[i].params.logprobs for i in idx])


def logprob_dicts(lp: torch.Tensor, chosen: torch.Tensor, ns: list[int]
                  ) -> list[dict[int, float]]:
    """lp (L, V) log-probs, chosen (L,) ids, ns each row's N -> per row {top-N ids in rank
    order, then the chosen id: logprob} (a generated token's logprobs, and a prompt token's)."""
    top_lp, top_ids = lp.topk(max(ns), dim=-1)  # (L, N)
    chosen_lp = lp.gather(1, chosen[:, None])[:, 0]  # (L,)
    out = []
    for k, tl, ti, c, cl in zip(ns, top_lp.tolist(), top_ids.tolist(), chosen.tolist(),
                                chosen_lp.tolist()):
        d = dict(zip(ti[:k], tl[:k]))
        d.setdefault(c, cl)
        out.append(d)
    return out
