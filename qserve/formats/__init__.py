"""Weight formats: the bottom layer. What a packed weight *is* (its tensors, how to
dequantize and validate it), with no kernel, model or engine in sight.

    qtensor.py    QuantizedTensor: one packed (out, in) matrix with an explicit format name
    weight_format.py  WeightFormat: one row per format (llama.cpp's type-traits table), FORMATS
    registry.py   the rows: int4, int4z, int8, f32/f16/bf16 and the GGML types
    ggml.py       GGML block types (Q4_0 ... Q6_K, IQ4_NL, IQ4_XS, MXFP4) read in place: layouts
                  and the pure-torch dequantize that is bit-exact with gguf-py

Kernels (qserve.kernels) look a format up by name and run its `kind` (the id cpu_ops.c and the
Triton dispatch switch on); nothing above this package guesses a format from a dtype.
"""
from qserve.formats.qtensor import QuantizedTensor, pack_int4, unpack_int4
from qserve.formats.registry import format_for_ggml
from qserve.formats.weight_format import FORMATS, WeightFormat, get_format

__all__ = ["QuantizedTensor", "pack_int4", "unpack_int4", "WeightFormat", "FORMATS",
           "get_format", "format_for_ggml"]
