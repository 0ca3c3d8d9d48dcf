"""The C kernels' thread count follows the cores other processes leave free (cpu_ops.ThreadBudget),
read from simulated /proc/stat and os.times() readings."""
from __future__ import annotations

import os

import pytest
import torch

from qserve.kernels import cpu_ops


class Clock:
    """Readings the budget sees: wall time, all cores' busy ticks, this process's CPU seconds."""

    def __init__(self):
        self.wall, self.busy, self.own = 1000.0, 0.0, 0.0

    def advance(self, seconds: float, own_cores: float, other_cores: float):
        self.wall += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores) * seconds * cpu_ops._TICKS


@pytest.fixture
def budget(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(cpu_ops.time, "monotonic", lambda: clock.wall)
    monkeypatch.setattr(cpu_ops, "_busy_ticks", lambda cpus: clock.busy)
    monkeypatch.setattr(cpu_ops.os, "times", lambda: os.times_result((clock.own, 0, 0, 0, 0)))
    threads = {"n": 2}
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads["n"])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: threads.update(n=n))
    monkeypatch.delenv("QSERVE_ADAPTIVE_THREADS", raising=False)
    b = cpu_ops.ThreadBudget()
    b.cores = [0, 1]
    b.torch_threads = threads
    return b, clock


@pytest.mark.parametrize("others,want", [(0.0, 2), (0.3, 2), (0.7, 1), (1.0, 1), (2.0, 1)])
def test_threads_leave_the_cores_others_use(budget, others, want):
    b, clock = budget
    assert b.threads() == 2  # no reading yet: torch's count
    clock.advance(0.6, own_cores=1.0, other_cores=others)
    assert b.threads() == want


def test_threads_come_back_when_the_others_stop(budget):
    b, clock = budget
    b.threads()
    clock.advance(0.6, own_cores=1.0, other_cores=1.0)
    assert b.threads() == 1
    clock.advance(0.3, own_cores=1.0, other_cores=0.0)
    assert b.threads() == 1  # read at most every INTERVAL seconds
    clock.advance(0.3, own_cores=1.0, other_cores=0.0)
    assert b.threads() == 2
    assert torch.get_num_threads() == 2


def test_torch_follows_and_a_users_count_is_kept(budget):
    b, clock = budget
    b.threads()
    clock.advance(0.6, own_cores=1.0, other_cores=1.0)
    assert b.threads() == 1 and torch.get_num_threads() == 1  # torch's ops follow
    torch.set_num_threads(4)  # the user's own setting: the new most
    clock.advance(0.6, own_cores=1.0, other_cores=0.0)
    assert b.threads() == 2  # 2 cores here
    clock.advance(0.6, own_cores=1.0, other_cores=0.0)
    b.cores = [0, 1, 2, 3]
    clock.advance(0.6, own_cores=1.0, other_cores=0.0)
    assert b.threads() == 4


def test_own_cpu_time_is_not_counted_as_others(budget):
    b, clock = budget
    b.threads()
    clock.advance(0.6, own_cores=2.0, other_cores=0.0)  # both our threads busy, or spinning
    assert b.threads() == 2


def test_switch_off(budget, monkeypatch):
    monkeypatch.setenv("QSERVE_ADAPTIVE_THREADS", "0")
    b = cpu_ops.ThreadBudget()
    _, clock = budget
    b.threads()
    clock.advance(0.6, own_cores=1.0, other_cores=2.0)
    assert b.threads() == 2
