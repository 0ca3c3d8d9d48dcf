"""qserve/heap.py: a CPU engine's step buffers stay in the heap (keep_step_buffers), so the
buffers a step frees are not faulted in afresh by the next; weights asked for in 2 MiB pages
(weight_buffer) get their own advised mappings."""
import gc
import os
import subprocess
import sys

import pytest
import torch

from qserve.formats import QuantizedTensor, ggml
from qserve.formats.qtensor import cat_quantized
from qserve.heap import HUGE_PAGE, _libc, weight_buffer

# In a fresh interpreter (the thresholds are the process's), steps shaped like a prefill step's
# activations: a 30 MiB buffer mapped and freed once (which raises glibc's adaptive mapping
# threshold to it, and its trim threshold to twice that), then each step 8 buffers of 12 MiB
# live at once, written and freed. Prints the minor page faults of the third step.
CHILD = r"""
import ctypes, resource, sys
from qserve.heap import keep_step_buffers
if sys.argv[1] == "keep":
    assert keep_step_buffers()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
p = libc.malloc(30 << 20)
ctypes.memset(p, 1, 30 << 20)
libc.free(p)
for step in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    bufs = [libc.malloc(12 << 20) for _ in range(8)]
    for b in bufs:
        ctypes.memset(b, 1, 12 << 20)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    for b in bufs:
        libc.free(b)
print(faults)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return int(out.split()[-1])


@pytest.mark.skipif(_libc() is None, reason="glibc's malloc only")
def test_kept_step_buffers_are_not_faulted_in_again():
    pages = (8 * 12 << 20) // 4096
    # glibc's defaults: the 96 MiB freed at the heap's top is over the trim threshold (60
    # MiB), given back, and every page faulted in again the next step
    assert _faults("default") > pages // 2
    # kept: the third step writes the pages the first faulted in
    assert _faults("keep") < pages // 20


def _mapping(addr: int) -> tuple[int, int, str] | None:
    """(start, end, VmFlags) of this process's mapping holding addr, from /proc/self/smaps."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                found = (lo, hi) if lo <= addr < hi else None
            elif found and line.startswith("VmFlags:"):
                return (*found, line.split(":", 1)[1])
    return None


THP = "/sys/kernel/mm/transparent_hugepage/enabled"


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.exists(THP),
                    reason="Linux with transparent huge pages")
def test_weight_buffer_maps_asked_weights_in_huge_pages(monkeypatch):
    monkeypatch.setenv("QSERVE_HUGE_PAGES", "1")
    t = weight_buffer((3, 1 << 20), torch.float32)  # 12 MiB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(1.5)
    assert t.sum().item() == 1.5 * 3 * (1 << 20)
    lo, hi, flags = _mapping(t.data_ptr())
    assert "hg" in flags.split()  # advised: MADV_HUGEPAGE
    assert hi - lo >= 12 << 20  # its own mapping, every whole 2 MiB page of it
    view = t[1:]
    del t
    gc.collect()
    assert _mapping(view.data_ptr()) is not None  # a view keeps the mapping
    addr = view.data_ptr()
    del view
    gc.collect()
    still = _mapping(addr)
    assert still is None or "hg" not in still[2].split()  # unmapped with the last view


def test_weight_buffer_is_torch_empty_unless_asked(monkeypatch):
    monkeypatch.delenv("QSERVE_HUGE_PAGES", raising=False)
    t = weight_buffer((4 << 20,))
    assert t.dtype == torch.uint8 and t.shape == (4 << 20,)
    monkeypatch.setenv("QSERVE_HUGE_PAGES", "1")
    small = weight_buffer((1000,), torch.float16)  # under a huge page: malloc's
    assert small.dtype == torch.float16 and small.shape == (1000,)
    if sys.platform.startswith("linux"):
        for buf in (t, small):
            mapping = _mapping(buf.data_ptr())
            assert mapping is not None and "hg" not in mapping[2].split()


def test_a_load_lays_large_weights_out_in_huge_page_buffers(monkeypatch):
    """The load's stacks (ggml.empty_rows, cat_quantized) take weight_buffer's memory."""
    monkeypatch.setenv("QSERVE_HUGE_PAGES", "1")
    g = torch.Generator().manual_seed(0)
    rows = ggml.random_rows("q4_k", 256, 4096 * 4, g)  # 256 x 9216 bytes: 2.25 MiB
    qt = QuantizedTensor("q4_k", rows, None, None, 4096 * 4)
    stack = ggml.empty_rows(qt, 512)
    assert stack.qweight.data_ptr() % HUGE_PAGE == 0
    cat = cat_quantized([qt, qt])
    assert cat.qweight.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(cat.qweight[:256], rows) and torch.equal(cat.qweight[256:], rows)
