"""The process heap (glibc's malloc; elsewhere these do nothing): freed memory handed back to
the OS after a load (trim_heap), and kept for the next step while a CPU engine runs
(keep_step_buffers)."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
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
