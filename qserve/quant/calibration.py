"""Calibration text, and output-quality metrics of one-sequence forward passes outside the
engine (qserve/models/build.py).

The default calibration text ships with Python itself: pydoc_data.topics, the help topics of
the language reference (about 460k characters of English and code).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch.nn import functional as F

from qserve.errors import QServeError
from qserve.models.build import build_model, prefill  # noqa: F401  (re-exported for tools)


def default_text() -> str:
    """Python's own pydoc topics (the text `help('topics')` shows), in key order: ~465k
    characters, ~120k tokens for a 49k-vocabulary tokenizer."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def read_text(path: str | Path | None) -> str:
    """--calib-text FILE, or the default text."""
    if path is None:
        return default_text()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise QServeError(f"--calib-text {str(path)!r} cannot be read: {why}") from None
    if not text.strip():
        raise QServeError(f"--calib-text {str(path)!r} is empty; give a file of plain text")
    return text


def logits(model, ids: list[int]) -> torch.Tensor:
    """(T, vocab) fp32 logits of every position (models/build.py prefill)."""
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
