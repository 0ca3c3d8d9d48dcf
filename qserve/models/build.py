"""Building a model from its weights, and running one sequence through it outside the engine
(calibration and offline quality checks need a forward pass, not a scheduler)."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from qserve.config import ModelArchConfig
from qserve.kernels.paged_attention import PagedAttentionMetadata
from qserve.models.base import CausalLM
from qserve.models.registry import model_class


def build_model(arch: ModelArchConfig, weights: Mapping, max_positions: int,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
                ) -> CausalLM:
    """The model of `arch` (its family's class, models/registry.py) from HF-named weights
    (dense tensors or QuantizedTensors), built on the meta device so no parameter is
    allocated twice."""
    device = torch.device(device)
    family = model_class(arch.architecture)
    with torch.device("meta"):
        model = family(arch, max_positions, dtype, device)
    model.load_weights(weights)
    return model.eval()


@torch.inference_mode()
def prefill(model: CausalLM, ids: list[int]) -> torch.Tensor:
    """Run one sequence through the model in one step, with a KV cache of its own in the
    model's dtype (blocks of 16 in order) -> final hidden states (T, hidden)."""
    arch, dev = model.arch, model.device
    T, bs = len(ids), 16
    nb = -(-T // bs)
    shape = (nb, bs, arch.num_kv_heads, arch.head_dim)  # (blocks, block_size, hkv, d)
    caches = [{"k": torch.zeros(shape, dtype=model.dtype, device=dev),
               "v": torch.zeros(shape, dtype=model.dtype, device=dev)}
              for _ in range(arch.num_layers)]
    meta = PagedAttentionMetadata(
        slot_mapping=torch.arange(T, device=dev), query_start_loc=torch.tensor([0, T], device=dev),
        seq_lens=torch.tensor([T], device=dev), block_tables=torch.arange(nb, device=dev)[None],
        query_lens_list=[T], seq_lens_list=[T], max_seq_len=T, decode_only=False,
        sliding_window=arch.sliding_window)
    return model(torch.tensor(ids, device=dev), torch.arange(T, device=dev), caches, meta)
