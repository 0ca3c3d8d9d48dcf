"""qserve: quantization-first LLM inference on one workstation GPU or a CPU box."""
import os as _os
import sys as _sys

# OpenMP threads (the C kernels' and torch's: one libgomp pool) wait for the next parallel
# region by spinning GOMP_SPINCOUNT pause instructions, then sleep. libgomp's default, 300,000
# (milliseconds of spinning), keeps a waiting thread on its core through whole time slices: when
# another process also wants the cores, the thread that has work waits for the core the spinner
# holds, and decode collapsed ~8x on a 2-core box with other work running
# (scripts/bench_contention.py). A few thousand (tens of microseconds) still bridges the gaps
# between the regions of one decode step. libgomp reads it once, when it is loaded (torch's
# import), so it is set only where qserve comes first; where torch came first, setting it would
# change nothing here and claim otherwise, so qserve leaves it and logs how to set it. A user's
# own setting wins.


def _openmp_loaded() -> bool:
    """Whether libgomp is in this process already (so it has read its environment)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return any("libgomp" in line for line in maps)
    except OSError:  # no /proc (macOS: torch's libomp reads KMP_*, not GOMP_*)
        return "torch" in _sys.modules


if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & _os.environ.keys():
    if _openmp_loaded():
        import logging as _logging

        _logging.getLogger("qserve").info(
            "libgomp was loaded before qserve (e.g. torch was imported first), so qserve's "
            "short OpenMP spin-wait could not be applied and threads keep libgomp's default "
            "(300,000 spins), which slows decode when other processes use the cores; set "
            "GOMP_SPINCOUNT=10000 in the environment before Python starts, or import qserve "
            "before torch")
    else:
        _os.environ["GOMP_SPINCOUNT"] = "10000"

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "__version__"]


def __getattr__(name):
    # Imported lazily so that `qserve --help` and the CLI's argument errors do not pay for torch.
    if name == "LLM":
        from qserve.llm import LLM
        return LLM
    if name == "SamplingParams":
        from qserve.sampling_params import SamplingParams
        return SamplingParams
    if name == "PoolingParams":
        from qserve.pooling_params import PoolingParams
        return PoolingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from qserve import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'qserve' has no attribute {name!r}")
