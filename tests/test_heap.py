"""qserve/heap.py: a CPU engine's step buffers stay in the heap (keep_step_buffers), so the
buffers a step frees are not faulted in afresh by the next."""
import subprocess
import sys

import pytest

from qserve.heap import _libc

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
