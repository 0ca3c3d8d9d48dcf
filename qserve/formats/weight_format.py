"""WeightFormat: one row of the weight-format table (llama.cpp keeps one type-traits row per
quantization type), and the table itself. The rows are registered by registry.py."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

# C kinds (enum wkind in kernels/cpu_ops.c): dense fp32 is 0; GGML in-place types are
# GGML_KIND_BASE + their GGML type id.
KIND_F32, KIND_INT4, KIND_INT8, KIND_F16, KIND_BF16, KIND_INT4Z = 0, 1, 2, 3, 4, 5
# q4_k / q6_k / int4, 16 rows interleaved: the CPU's layouts
KIND_Q4_K_X16, KIND_Q6_K_X16, KIND_INT4_X16 = 6, 7, 8
GGML_KIND_BASE = 16


@dataclass(frozen=True)
class WeightFormat:
    name: str
    kind: int  # the id the C and Triton kernels switch on
    bits: float  # bits per weight, codes and scales counted (for display and planning)
    block: int  # inputs per block/group; 0: chosen per tensor (int4/int8 group size)
    dequantize: Callable[[Any], torch.Tensor]  # -> (out, in) fp32 reference
    validate: Callable[[Any], str | None]  # a problem with the tensors, or None
    ggml_type: int | None = None  # the GGML type it holds blocks of, in place
    # rows(qt, idx) -> QuantizedTensor where a row is not one slice of the tensors (interleaved
    # layouts); None: QuantizedTensor.rows slices them
    rows: Callable[[Any, Any], Any] | None = None
    description: str = ""

    def __str__(self) -> str:
        return self.name


FORMATS: dict[str, WeightFormat] = {}


def register(fmt: WeightFormat) -> WeightFormat:
    assert fmt.name not in FORMATS and all(f.kind != fmt.kind for f in FORMATS.values())
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str) -> WeightFormat:
    fmt = FORMATS.get(name)
    if fmt is None:
        raise KeyError(f"unknown weight format {name!r} (known: {', '.join(FORMATS)})")
    return fmt
