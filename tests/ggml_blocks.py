"""Random GGML blocks for the format tests, with no gguf import (the GPU machine has no gguf
package, and tests/test_triton_ggml.py runs there)."""
from __future__ import annotations

import torch

from qserve.formats import ggml


def random_rows(name: str, out: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """(out, in_features / block * block_bytes) uint8: random blocks of type `name` whose fp16
    fields hold randn * 0.01 (finite: NaN != NaN would hide a mismatch)."""
    t = ggml.TYPES[name]
    g = torch.Generator().manual_seed(seed)
    n = out * in_features // t.block
    blocks = torch.randint(0, 256, (n, t.block_bytes), dtype=torch.uint8, generator=g)
    for off in t.fp16_fields:
        d = (torch.randn(n, 1, generator=g) * 0.01).half()
        blocks[:, off:off + 2] = d.view(torch.uint8)
    return blocks.view(out, -1)
