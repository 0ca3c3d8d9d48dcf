"""qserve: quantization-first LLM inference on one workstation GPU or a CPU box."""
import os as _os

# OpenMP threads (the C kernels' and torch's: one libgomp pool) wait for the next parallel
# region by spinning GOMP_SPINCOUNT pause instructions, then sleep. libgomp's default, 300,000
# (milliseconds of spinning), keeps a waiting thread on its core through whole time slices: when
# another process also wants the cores, the thread that has work waits for the core the spinner
# holds, and decode collapsed ~8x on a 2-core box with other work running
# (scripts/bench_contention.py). A few thousand (tens of microseconds) still bridges the gaps
# between the regions of one decode step. Read once, when libgomp starts (torch's import), so
# it applies where qserve is imported before torch; a user's own setting wins.
if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & _os.environ.keys():
    _os.environ["GOMP_SPINCOUNT"] = "10000"

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name):
    # Imported lazily so that `qserve --help` and the CLI's argument errors do not pay for torch.
    if name == "LLM":
        from qserve.llm import LLM
        return LLM
    if name == "SamplingParams":
        from qserve.sampling_params import SamplingParams
        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from qserve import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'qserve' has no attribute {name!r}")
