"""LLMEngine's forward pass on a CPU: a step mixing one-token decodes with prompt chunks runs
the decodes as their own pass (the fused decode kernel), and the logits come back in the
step's order. A fake runner stands in for the model, so this needs no weights."""
from types import SimpleNamespace

import torch

from qserve.engine.llm_engine import LLMEngine
from qserve.engine.scheduler import ScheduledSeq, SchedulerOutput


class _Runner:
    """Returns one row per sampling sequence, holding the sequence's tag; records each call's
    query lengths."""

    def __init__(self):
        self.calls: list[list[int]] = []

    def run(self, out: SchedulerOutput) -> torch.Tensor:
        self.calls.append([s.num_new_tokens for s in out.scheduled])
        return torch.tensor([[float(s.seq.tag)] for s in out.scheduled if s.samples]
                            ).reshape(-1, 1)


def _scheduled(tag: int, computed: int, total: int, new: int) -> ScheduledSeq:
    seq = SimpleNamespace(tag=tag, num_computed_tokens=computed, num_tokens=total,
                          pooling=None)
    return ScheduledSeq(seq, new)


def _engine(device: str = "cpu") -> LLMEngine:
    engine = LLMEngine.__new__(LLMEngine)  # only what _run reads
    engine.device, engine.runner = torch.device(device), _Runner()
    return engine


def test_mixed_step_runs_decodes_first_and_keeps_row_order():
    engine = _engine()
    out = SchedulerOutput(scheduled=[
        _scheduled(1, 30, 40, 10),  # the last chunk of a prompt: samples
        _scheduled(2, 9, 10, 1),  # a decode
        _scheduled(3, 0, 50, 8),  # a first chunk: does not sample
        _scheduled(4, 19, 20, 1),  # a decode
        _scheduled(5, 0, 6, 6),  # a whole prompt
    ], copies=[(1, 2)])
    logits = engine._run(out)
    assert engine.runner.calls == [[1, 1], [10, 8, 6]]
    assert logits[:, 0].tolist() == [1, 2, 4, 5]


def test_unmixed_steps_and_other_devices_run_once():
    for scheduled, device in [([_scheduled(1, 9, 10, 1), _scheduled(2, 4, 5, 1)], "cpu"),
                              ([_scheduled(1, 0, 10, 10), _scheduled(2, 0, 5, 5)], "cpu"),
                              ([_scheduled(1, 9, 10, 1), _scheduled(2, 0, 5, 5)], "meta")]:
        engine = _engine(device)
        logits = engine._run(SchedulerOutput(scheduled=scheduled))
        assert len(engine.runner.calls) == 1
        assert logits[:, 0].tolist() == [1, 2]


def test_table_rows_follow_every_kind_of_table_change():
    """TableRows (the step's block tables as one tensor, converted incrementally) against the
    padded tables converted whole, over random steps that change tables the ways the block
    manager does: appending blocks, copy-on-write of the block a step starts writing, trim,
    and a new list (freed and re-admitted, swapped back, forked); sequences come and go."""
    import random

    from qserve.engine.model_runner import TableRows

    rng = random.Random(0)
    rows = TableRows()
    tables: dict[int, list[int]] = {}
    computed: dict[int, int] = {}
    next_block = iter(range(10**6))
    for step in range(400):
        for sid in range(6):
            if sid not in tables or rng.random() < 0.03:  # (re)admitted / swapped in / forked
                tables[sid] = [next(next_block) for _ in range(rng.randint(1, 5))]
                computed[sid] = rng.randint(0, 16 * len(tables[sid]) - 1)
                continue
            t = tables[sid]
            r = rng.random()
            if r < 0.5:  # decode: maybe a new block
                computed[sid] += 1
                if computed[sid] >= 16 * len(t):
                    t.append(next(next_block))
            elif r < 0.6:  # copy-on-write of the block the step writes into
                t[computed[sid] // 16] = next(next_block)
            elif r < 0.65 and len(t) > 1:  # trim: rejected drafts' blocks given back
                del t[rng.randint(1, len(t) - 1):]
                computed[sid] = min(computed[sid], 16 * len(t) - 1)
        batch = rng.sample(sorted(tables), rng.randint(1, 6))
        got = rows.tensor([(sid, tables[sid], computed[sid] // 16) for sid in batch])
        width = max(len(tables[sid]) for sid in batch)
        want = torch.tensor([tables[sid] + [0] * (width - len(tables[sid])) for sid in batch])
        assert torch.equal(got, want), step
