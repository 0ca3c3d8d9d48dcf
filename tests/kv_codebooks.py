"""Key codebooks for kernel tests: int4 keys are coded per channel with calibrated widths
(kernels/kv_quant.py), and a kernel must handle any valid codebook, not only the uniform one."""
from __future__ import annotations

import torch

from qserve.kernels.kv_quant import KEY_BITS, MAX_KEY_WIDTH, key_codebook


def random_key_codebook(num_kv_heads: int, d: int, seed: int = 0, layers: int | None = None
                        ) -> dict[str, torch.Tensor]:
    """Random widths in 0..MAX_KEY_WIDTH summing to KEY_BITS d per head (some channels get no
    bits, some the full 8), random RMS over two orders of magnitude; tensors (hkv, d), or
    (layers, hkv, d) when `layers` is given."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_kv_heads,) if layers is None else (layers, num_kv_heads)
    width = torch.zeros(*shape, d, dtype=torch.int32)
    flat = width.view(-1, d)
    for row in flat:  # hand out KEY_BITS d bits one at a time to random channels not yet full
        for _ in range(KEY_BITS * d):
            open_ = (row < MAX_KEY_WIDTH).nonzero().flatten()
            row[open_[torch.randint(len(open_), (1,), generator=g)]] += 1
        # and move every bit of a few channels elsewhere, so some widths are 0
        for j in torch.randperm(d, generator=g)[: max(1, d // 8)].tolist():
            while row[j] > 0:
                open_ = (row < MAX_KEY_WIDTH).nonzero().flatten()
                open_ = open_[open_ != j]
                row[j] -= 1
                row[open_[torch.randint(len(open_), (1,), generator=g)]] += 1
    sigma = torch.exp(torch.rand(*shape, d, generator=g) * 4.6 - 2.3)  # 0.1 .. 10
    return key_codebook(sigma, width)
