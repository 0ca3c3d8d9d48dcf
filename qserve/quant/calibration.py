"""Calibration text, one-sequence forward passes outside the engine, and output-quality metrics.

The default calibration text ships with Python itself: pydoc_data.topics, the help topics of
the language reference (about 460k characters of English and code).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch.nn import functional as F

from qserve.errors import QServeError


def read_text(path: str | Path | None) -> str:
    """--calib-text FILE, or the default text."""
    if path is None:
        from qserve.eval import default_text

        return default_text()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise QServeError(f"--calib-text {str(path)!r} cannot be read: {why}") from None
    if not text.strip():
        raise QServeError(f"--calib-text {str(path)!r} is empty; give a file of plain text")
    return text


def build_model(arch, weights: dict[str, torch.Tensor], max_positions: int,
                dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """A LlamaForCausalLM from HF-named (dense or packed) weights, as the engine builds it."""
    from qserve.models.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(arch, max_positions, dtype, torch.device(device))
    model.load_weights(weights)
    return model.eval()


@torch.inference_mode()
def prefill(model, ids: list[int]) -> torch.Tensor:
    """Run one sequence through the model in one step -> final hidden states (T, hidden)."""
    from qserve.config import CacheConfig
    from qserve.engine.cache_engine import CacheEngine
    from qserve.kernels.paged_attention import PagedAttentionMetadata

    T, bs = len(ids), 16
    nb = -(-T // bs)
    caches = CacheEngine(model.arch, CacheConfig(block_size=bs), nb, 0, model.device, model.dtype)
    dev = model.device
    meta = PagedAttentionMetadata(
        slot_mapping=torch.arange(T, device=dev), query_start_loc=torch.tensor([0, T], device=dev),
        seq_lens=torch.tensor([T], device=dev), block_tables=torch.arange(nb, device=dev)[None],
        query_lens_list=[T], seq_lens_list=[T], max_seq_len=T, decode_only=False,
        sliding_window=model.arch.sliding_window)
    x = torch.tensor(ids, device=dev)
    layers = [caches.layer(i) for i in range(model.arch.num_layers)]
    return model(x, torch.arange(T, device=dev), layers, meta)


def logits(model, ids: list[int]) -> torch.Tensor:
    """(T, vocab) fp32 logits of every position."""
    with torch.inference_mode():
        return model.compute_logits(prefill(model, ids))


def compare(ref: torch.Tensor, test: torch.Tensor, ids: list[int]) -> dict[str, float]:
    """Quality of `test` logits against `ref` (both (T, vocab)) on the text `ids`:
    mean KL(ref || test) per token, and each model's perplexity on the next tokens."""
    lp_ref, lp_test = F.log_softmax(ref, -1), F.log_softmax(test, -1)
    kl = (lp_ref.exp() * (lp_ref - lp_test)).sum(-1).mean().item()
    target = torch.tensor(ids[1:])
    ppl = [torch.exp(F.nll_loss(lp[:-1], target)).item() for lp in (lp_ref, lp_test)]
    return {"kl": kl, "ppl_ref": ppl[0], "ppl": ppl[1]}
