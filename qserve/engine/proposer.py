"""Proposers for speculative decoding: where draft tokens come from.

    --draft ngram         prompt lookup: continue the latest earlier occurrence of the last n
                          tokens of prompt + output; no model, nearly free, good when the output
                          repeats its input (rewriting, summarising, code edits)
    --draft self:RECIPE   the target's own weights quantized with a recipe (recipes/*.yaml)
    --draft MODEL         any model with the target's vocabulary

A proposer's `propose(want)` appends up to want[seq] provisional tokens to each sequence
(Sequence.add_spec_tokens) and sets seq.spec_probs when it sampled them; `release(live)` drops
whatever it keeps for sequences no longer running.

A draft model keeps its own paged KV cache, with its own block manager over a pool that holds
as many tokens as the target's. Its view of a sequence (DraftSeq) shares the sequence's tokens;
after verification it rolls its computed count back to the tokens the target kept, lazily, at
the next proposal. When the target preempts a sequence (swap or recompute), its draft blocks
are freed with it; the draft recomputes them when the sequence runs again.
"""
from __future__ import annotations

import torch

from qserve.config import CacheConfig, ModelArchConfig, SpeculativeConfig
from qserve.engine.block_manager import BlockManager
from qserve.engine import kv_codebook
from qserve.engine.cache_engine import CacheEngine
from qserve.engine.model_runner import ModelRunner
from qserve.engine.sampler import race, sampling_probs
from qserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from qserve.engine.sequence import Sequence
from qserve.errors import ConfigError
from qserve.models.build import build_model


# ---- n-gram prompt lookup ----------------------------------------------------------------------
def ngram_lookup(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens, for the
    largest n in [n_min, n_max] that occurs; [] when none does."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix, last = tokens[L - n:], tokens[-1]
        for start in range(L - n - 1, -1, -1):  # latest first; the suffix itself is excluded
            if tokens[start + n - 1] == last and tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.n_max, self.n_min = config.ngram_max, config.ngram_min

    def propose(self, want: dict[Sequence, int]) -> None:
        for seq, k in want.items():
            ids = ngram_lookup(seq.token_ids, k, self.n_max, self.n_min)
            if ids:
                seq.add_spec_tokens(ids)

    def release(self, live: set[int]) -> None:
        pass


# ---- a draft model with its own paged cache ------------------------------------------------------
class DraftSeq:
    """The draft model's view of a sequence: the sequence's id and tokens, the draft's own
    computed count (its blocks are under the same id in the draft's block manager)."""

    wants_prompt_logprobs = False  # the runner reports the target's, never the draft's
    pooling = None  # nor pools: an embedding request never reaches the draft

    def __init__(self, seq: Sequence):
        self.seq = seq
        self.num_computed_tokens = 0
        self.num_final = 0  # tokens that were final when it last proposed
        self.drafted: list[int] = []  # what it proposed after them

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.seq.token_ids)


class DraftModelProposer:
    def __init__(self, model, cache_engine: CacheEngine, block_manager: BlockManager,
                 device: torch.device):
        self.runner = ModelRunner(model, cache_engine, block_manager, device)
        self.block_manager = block_manager
        self.drafts: dict[int, DraftSeq] = {}  # seq_id -> the draft's state

    def release(self, live: set[int]) -> None:
        for seq_id in [i for i in self.drafts if i not in live]:
            self.block_manager.free(self.drafts.pop(seq_id))

    def _sync(self, seq: Sequence) -> DraftSeq:
        """The draft state of `seq`, its computed count cut back to the tokens that stayed."""
        bm = self.block_manager
        d = self.drafts.get(seq.seq_id)
        if d is None:
            d = self.drafts[seq.seq_id] = DraftSeq(seq)
            d.num_computed_tokens = bm.match_prefix(d)
            return d
        kept = d.num_final
        for drafted, actual in zip(d.drafted, seq.token_ids[d.num_final:]):
            if drafted != actual:
                break
            kept += 1
        # the last token is always run again: its logits are where drafting starts
        d.num_computed_tokens = min(d.num_computed_tokens, kept, d.num_tokens - 1)
        bm.commit_computed_blocks(d)
        bm.trim(d)
        return d

    @torch.inference_mode()
    def propose(self, want: dict[Sequence, int]) -> None:
        """Run the draft autoregressively: the first pass catches each sequence up (its new
        tokens, or its whole prompt the first time), each further pass adds one draft token."""
        bm = self.block_manager
        active = {seq: self._sync(seq) for seq in want}
        for d in active.values():
            d.num_final, d.drafted = d.num_tokens, []
        probs: dict[Sequence, list[torch.Tensor]] = {seq: [] for seq in want}
        while active:
            batch = []
            for seq, d in list(active.items()):
                n = d.num_tokens - d.num_computed_tokens
                if bm.allocate_slots(d, n):
                    batch.append((seq, d, n))
                else:  # the draft pool is full: this sequence proposes what it has
                    del active[seq]
            if not batch:
                break
            out = SchedulerOutput(scheduled=[ScheduledSeq(d, n) for _, d, n in batch],
                                  copies=bm.take_pending_copies())
            logits = self.runner.run_speculative(out)  # (B, V): no drafts in a draft's step
            q = sampling_probs(logits, [seq.params for seq, _, _ in batch])  # (B, V)
            greedy = [seq.params.greedy for seq, _, _ in batch]
            ids = logits.argmax(dim=-1)
            rand = [j for j, g in enumerate(greedy) if not g]
            if rand:
                idx = torch.tensor(rand, device=q.device)
                ids[idx] = race(q[idx].clone(), [batch[j][0].generator for j in rand])
            for j, (seq, d, n) in enumerate(batch):
                d.num_computed_tokens += n
                token = int(ids[j])
                seq.add_spec_tokens([token])
                d.drafted.append(token)
                if not greedy[j]:
                    probs[seq].append(q[j])
                if len(d.drafted) == want[seq]:
                    del active[seq]
        for seq, rows in probs.items():
            if rows:
                seq.spec_probs = torch.stack(rows)  # (k, V)


# ---- construction ------------------------------------------------------------------------------
def draft_arch(config: SpeculativeConfig, target: ModelArchConfig) -> ModelArchConfig | None:
    """The draft's shape, without reading weights (None for n-gram lookup)."""
    if config.kind == "ngram":
        return None
    if config.kind == "self":
        return target
    from qserve.loader import load_arch

    return load_arch(config.draft)


def build_proposer(config: SpeculativeConfig, target_loaded, *, max_model_len: int,
                   dtype: torch.dtype, device: torch.device, cache: CacheConfig,
                   kv_dtype: torch.dtype, num_blocks: int, draft_weights=None):
    """The proposer for `config.draft`; a draft model gets a KV pool of `num_blocks`.
    A self-draft (self:RECIPE) runs `draft_weights`, the target's weights quantized by the
    caller (qserve/quant/self_draft.py via qserve.llm.make_engine): the engine never
    quantizes."""
    if config.kind == "ngram":
        return NgramProposer(config)
    if config.kind == "self":
        if draft_weights is None:
            raise ConfigError(f"--draft {config.draft}: the draft's weights were not made; "
                              f"build the engine with qserve.llm.make_engine")
        arch, weights = target_loaded.arch, draft_weights
    else:
        from qserve.loader import load_model

        loaded = load_model(config.draft)
        _check_vocabulary(config.draft, loaded, target_loaded)
        arch, weights = loaded.arch, loaded.weights
    if arch.max_position_embeddings < max_model_len:
        raise ConfigError(f"the draft {config.draft} handles {arch.max_position_embeddings} "
                          f"tokens of context, fewer than --max-model-len {max_model_len}; "
                          f"lower --max-model-len")
    model = build_model(arch, weights, max_model_len, dtype, device)
    codebook = kv_codebook.for_cache(model, target_loaded.tokenizer, kv_dtype)
    cache_engine = CacheEngine(arch, cache, num_blocks, 0, device, kv_dtype, codebook)
    block_manager = BlockManager(num_blocks, cache.block_size, 0, 0.0,
                                 cache.enable_prefix_caching)
    return DraftModelProposer(model, cache_engine, block_manager, device)


def _check_vocabulary(name: str, draft, target) -> None:
    d_vocab = draft.tokenizer.backend.get_vocab(with_added_tokens=True)
    t_vocab = target.tokenizer.backend.get_vocab(with_added_tokens=True)
    if draft.arch.vocab_size != target.arch.vocab_size or d_vocab != t_vocab:
        raise ConfigError(
            f"the draft {name} has a vocabulary of {len(d_vocab)} tokens ({draft.arch.vocab_size} "
            f"logits) that differs from the target's {len(t_vocab)} ({target.arch.vocab_size}); "
            f"a draft model must use the target's tokenizer")
