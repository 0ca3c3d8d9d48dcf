"""Scheduler on a tiny pool, with the forward pass faked: budgets, chunked prefill, admission
order, preemption by recompute and by swap, and that every block comes back."""
import pytest

from qserve.config import SchedulerConfig
from qserve.engine.block_manager import BlockManager
from qserve.engine.scheduler import Scheduler
from qserve.engine.sequence import Sequence, SequenceStatus
from qserve.sampling_params import SamplingParams

BS = 4


def make(num_blocks=11, host=0, **cfg):
    bm = BlockManager(num_blocks, BS, host, watermark=0.0)
    cfg.setdefault("max_num_batched_tokens", 2048)
    return Scheduler(SchedulerConfig(**cfg), bm, max_model_len=64), bm


def seq(n, rid):
    return Sequence(rid, 0, list(range(1000 * ord(rid), 1000 * ord(rid) + n)), n,
                    SamplingParams(max_tokens=100))


def step(sched):
    """schedule -> (fake) run -> postprocess, appending token 7 to each sampling sequence."""
    out = sched.schedule()
    for s in sched.postprocess(out):
        s.append_token(7)
    return out


def test_token_budget_chunks_prefill():
    sched, bm = make(max_num_batched_tokens=8)
    a, b = seq(10, "a"), seq(3, "b")
    sched.add(a)
    sched.add(b)
    out = step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 8)]
    out = step(sched)  # a finishes its prompt (2), b gets the rest of the budget (3)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 2), ("b", 3)]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    out = step(sched)  # both decode, one token each
    assert [s.num_new_tokens for s in out.scheduled] == [1, 1]


def test_max_num_seqs_limits_running():
    sched, _ = make(max_num_seqs=2)
    seqs = [seq(2, r) for r in "abc"]
    for s in seqs:
        sched.add(s)
    step(sched)
    assert [s.status for s in seqs] == [SequenceStatus.RUNNING] * 2 + [SequenceStatus.WAITING]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_when_blocks_run_out(mode):
    # 4 blocks of 4 tokens; two sequences of 6 tokens each take 2 blocks, then both grow
    sched, bm = make(num_blocks=4, host=8, preemption_mode=mode)
    a, b = seq(6, "a"), seq(6, "b")
    sched.add(a)
    sched.add(b)
    step(sched)
    assert bm.num_free_blocks == 0
    for _ in range(3):
        step(sched)  # a reaches 9 tokens and needs a third block: b (the newest) is preempted
    assert sched.num_preemptions == 1
    if mode == "swap":
        assert b.status is SequenceStatus.SWAPPED and len(bm.host_block_table(b.seq_id)) == 2
        assert sched.num_swap_outs == 1
    else:
        assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
        assert sched.num_recomputes == 1
    bm.check_invariants([a, b])
    sched.finish(a, "length")
    out = step(sched)  # b comes back: swapped in (copies listed) or recomputed from scratch
    assert b.status is SequenceStatus.RUNNING
    if mode == "swap":
        assert len(out.swap_in) == 2
        assert [s.num_new_tokens for s in out.scheduled] == [1]
    else:
        # b's 9 tokens are recomputed, except its head block, which a's growth did not evict
        # and which is still in the prefix cache
        assert [s.num_new_tokens for s in out.scheduled] == [9 - BS]
    sched.finish(b, "length")
    bm.check_invariants([])
    assert bm.num_free_blocks == 4 and bm.num_free_host_blocks == 8


def test_swap_falls_back_to_recompute_without_host_space():
    sched, bm = make(num_blocks=4, host=1, preemption_mode="swap")
    a, b = seq(6, "a"), seq(6, "b")
    sched.add(a)
    sched.add(b)
    for _ in range(4):
        step(sched)
    assert b.status is SequenceStatus.WAITING and sched.num_recomputes == 1


def test_swapped_resume_before_new_requests():
    sched, bm = make(num_blocks=4, host=8, preemption_mode="swap")
    a, b = seq(6, "a"), seq(6, "b")
    sched.add(a)
    sched.add(b)
    for _ in range(4):
        step(sched)
    assert b.status is SequenceStatus.SWAPPED
    c = seq(2, "c")
    sched.add(c)
    sched.finish(a, "stop")
    out = step(sched)
    ids = [s.seq.request_id for s in out.scheduled]
    assert ids[0] == "b"


def test_prefix_hit_skips_computed_tokens():
    sched, bm = make()
    a = seq(9, "a")
    sched.add(a)
    step(sched)
    b = Sequence("b", 0, list(a.prompt_token_ids), 9, SamplingParams())
    sched.add(b)
    out = step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 1)]
    assert b.num_cached_tokens == 8



def test_prefix_hits_count_once_per_request_across_preemption():
    # a's prompt leaves 2 full blocks in the prefix cache; b has the same prompt and hits
    # them, is preempted by recompute (c grows), waits (its admission is tried and undone
    # for lack of blocks) and is re-admitted, hitting them again each time it is tried
    sched, bm = make(num_blocks=5, preemption_mode="recompute")
    a = seq(9, "a")
    sched.add(a)
    step(sched)
    sched.finish(a, "stop")
    c = seq(6, "c")
    b = Sequence("b", 0, list(a.prompt_token_ids), 9, SamplingParams(max_tokens=100))
    sched.add(c)
    sched.add(b)
    for _ in range(5):
        step(sched)
    assert sched.num_recomputes == 1 and b.status is SequenceStatus.WAITING
    sched.finish(c, "stop")
    step(sched)
    assert b.status is SequenceStatus.RUNNING
    # counted at b's first admission only: 8 of its 9 prompt tokens, never more than its
    # prompt (the block manager attached the 2 blocks 3 times, the old count of 24 tokens)
    assert b.num_cached_tokens == 8 and sched.num_prefix_hit_tokens == 8
    assert bm.prefix_hits == 6

def test_speculative_tokens_run_whole_or_are_dropped():
    sched, bm = make(max_num_batched_tokens=6)
    a, b = seq(3, "a"), seq(3, "b")
    for s in (a, b):
        sched.add(s)
    step(sched)  # both prompts; each gets a sampled token (4 tokens, 3 computed)
    a.add_spec_tokens([1, 2, 3])  # a: 1 + 3 tokens fit the budget of 6
    b.add_spec_tokens([4, 5, 6])  # b: only 2 tokens of budget left, so its drafts go
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens, s.num_spec_tokens) for s in out.scheduled] \
        == [("a", 4, 3), ("b", 1, 0)]
    assert b.num_tokens == 4 and b.num_spec_tokens == 0
    assert bm.block_table(a.seq_id) == [0, 2]  # drafts up to position 6: two blocks
    sampled = sched.postprocess(out)
    assert sampled == [a, b]
    assert out.scheduled[0].spec_token_ids == [1, 2, 3]
    assert (a.num_tokens, a.num_computed_tokens) == (4, 4)  # drafts taken off again
    a.append_token(1)  # the first draft accepted, then the target's own token
    a.append_token(9)
    sched.accept_spec_tokens(a, 1)
    assert (a.num_tokens, a.num_computed_tokens) == (6, 5)
    assert bm.block_table(a.seq_id) == [0, 2]
    bm.check_invariants([a, b])


def test_drafts_are_dropped_before_and_by_preemption():
    sched, bm = make(num_blocks=2)
    a, b = seq(4, "a"), seq(3, "b")
    for s in (a, b):
        sched.add(s)
    step(sched)  # a: blocks [0], 5 tokens; b: blocks [1], 4 tokens
    a.add_spec_tokens([1, 2])
    b.add_spec_tokens([3, 4])
    out = sched.schedule()
    # a loses its drafts first, still needs a block, and b is preempted for it
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1)]
    assert a.num_spec_tokens == 0 and bm.block_table(a.seq_id) == [0, 1]
    assert b.status is SequenceStatus.WAITING
    assert (b.num_tokens, b.num_spec_tokens, b.num_computed_tokens) == (4, 0, 0)
    bm.check_invariants([a])


def test_step_budget_defaults_by_device():
    """No --max-num-batched-tokens: 512 tokens a step on a CPU (llama.cpp's physical batch; the
    1B prefill measured fastest there), 2048 on CUDA; a given budget is kept, 0 refused."""
    import torch

    from qserve.config import EngineConfig, engine_config
    from qserve.errors import ConfigError

    assert EngineConfig(device="cpu").scheduler.max_num_batched_tokens == 512
    assert EngineConfig(device="cuda").scheduler.max_num_batched_tokens == 2048
    auto = engine_config(None, max_num_batched_tokens=None).scheduler.max_num_batched_tokens
    assert auto == (2048 if torch.cuda.is_available() else 512)
    assert engine_config(None, device="cpu",
                         max_num_batched_tokens=4096).scheduler.max_num_batched_tokens == 4096
    with pytest.raises(ConfigError, match="--max-num-batched-tokens=0 must be at least 1"):
        engine_config(None, max_num_batched_tokens=0)
