"""qserve: quantization-first LLM inference on one workstation GPU or a CPU box."""

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
