"""The process heap (glibc's malloc; elsewhere these do nothing): freed memory handed back to
the OS after a load (trim_heap), kept for the next step while a CPU engine runs
(keep_step_buffers), and, when asked, a model's weights in 2 MiB pages (weight_buffer)."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and arm64 (4 KiB base pages)
STEP_MMAP_THRESHOLD = 32 << 20  # the most glibc takes on a 64-bit machine
STEP_TRIM_THRESHOLD = 256 << 20


def trim_heap() -> None:
    """Hand the pages of freed heap memory back to the OS (glibc's malloc_trim). A load frees
    temporaries per tensor (a file copy; a q/k matrix re-ordered; parts stacked; a layout
    interleaved), and glibc keeps freed holes between live tensors resident: measured after
    building an 8B Q4_K_M model, 40-300 MiB, varying from run to run. LazyWeights trims before
    every read: 1B Q4_K_M's `qserve generate` then peaked at 944-952 MiB against 1,012-1,029
    trimming only at the end, and loaded in 1.6 s against 1.0 (the pages given back are faulted
    in again by the next tensor). Trimming only when mallinfo2 showed 16 MiB more free heap
    cost 0.2 s and peaked at 956-994."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def keep_step_buffers() -> bool:
    """Keep a CPU step's freed buffers in the heap for the next step. By default glibc maps
    each allocation above a threshold that it adapts (at most 32 MiB) afresh and unmaps it when
    freed, and gives the heap's top back above twice that: a prefill step's activations (512
    tokens of the 1B: a 32 MiB gate_up output, its records, the MLP's product) were zeroed
    pages faulted in on every step, 6-7% of a 32-prompt prefill's profile in the kernel. With
    the mapping threshold at its most and 256 MiB of freed heap kept (64 MiB kept too little),
    the 1B's 32 x 128 prefill ran at 168-181 against 141-154 tokens/s, peak RSS 1,578-1,588
    MiB against 1,546-1,562 (AVX2, 2 threads). The thresholds are the process's: set once,
    when a CPU engine is built (explicit trims still trim). Returns whether glibc took them."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, STEP_MMAP_THRESHOLD)
                and libc.mallopt(_M_TRIM_THRESHOLD, STEP_TRIM_THRESHOLD))


def weight_buffer(shape: tuple[int, ...], dtype: torch.dtype | None = None,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialized tensor (torch.empty; dtype uint8 by default) for a weight matrix the
    CPU kernels stream at every step. With QSERVE_HUGE_PAGES=1, on Linux, one of 2 MiB or more
    gets its own anonymous mapping, starting on a 2 MiB boundary and advised for transparent
    huge pages (MADV_HUGEPAGE) before anything writes it, so a load's first touch maps it 2
    MiB at a time wherever the kernel's THP setting is `madvise` or `always` (not `never`);
    the mapping is unmapped when the tensor and its views are freed. (From malloc, a weight
    below glibc's mapping threshold would reuse heap pages the load's temporaries had
    faulted in 4 KiB at a time: 500 of the 1B Q4_K_M's ~700 MB of weights in huge pages that
    way, 604 in its own mappings.)

    Off by default, for what it costs here. On this project's 2-core Zen 4 VM (AVX2 build, 2
    threads) a decode step's weights stream faster from 2 MiB pages (a TLB miss there walks
    the guest's and the host's page tables): 600 MB of 8192 x 2048 matrices cycled from DRAM,
    one process alternating a copy in 4 KiB pages and one in 2 MiB, q4_k_x16 read at 27.7
    against 29.9 GB/s, q6_k_x16 22.4 against 26.4, int4_x16 24.8 against 29.5; the 1B Q4_K_M
    decoded at batch 1 4% faster (40.2 against 38.5 tokens/s, two engines in one process,
    alternated). But its load took 2.2-3.0 s against 1.0-1.6: a fresh 2 MiB page cost the VM
    2-7 ms to fault in (0.1 ms where the host still backed it: the host takes back a guest's
    free 2 MiB blocks, while 4 KiB pages come from memory it still backs). A server that runs
    for long gains; a one-off `qserve generate` loses."""
    import torch

    dtype = dtype or torch.uint8
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if (nbytes < HUGE_PAGE or torch.device(device).type != "cpu"
            or not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE")
            or os.environ.get("QSERVE_HUGE_PAGES", "0") != "1"):
        return torch.empty(shape, dtype=dtype, device=device)
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # anonymous, untouched
    base = torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr()
    offset = -base % HUGE_PAGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, as torch.empty's
        pass
    # the tensor holds the mapping (frombuffer keeps its buffer alive)
    return torch.frombuffer(m, dtype=dtype, count=count, offset=offset).view(shape)


@functools.lru_cache(maxsize=None)
def _libc():
    """glibc, or None (another C library has neither malloc_trim nor these mallopt codes)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not (hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt")):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc
