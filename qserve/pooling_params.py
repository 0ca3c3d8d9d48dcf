"""How to turn one prompt into an embedding: which hidden states to pool, and how to finish the
vector. Names follow vLLM's PoolingParams and OpenAI's embeddings API.

    last  the final hidden state (after the final norm) of the prompt's last token: what
          decoder embedding models are trained for (Qwen3-Embedding, e5-mistral, gte-Qwen2)
    mean  the mean of every prompt token's final hidden state
    cls   the first token's
"""
from __future__ import annotations

from dataclasses import dataclass

from qserve.sampling_params import SamplingParamsError

POOLING_TYPES = ("last", "mean", "cls")


@dataclass
class PoolingParams:
    """Per-request embedding settings, validated on construction."""

    # None: the model's own (sentence-transformers' 1_Pooling config, a GGUF's pooling_type),
    # else "last"
    pooling: str | None = None
    normalize: bool = True  # scale the vector to unit length (after `dimensions`)
    # keep the first `dimensions` values (Matryoshka embeddings); None: all hidden_size
    dimensions: int | None = None

    def __post_init__(self):
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise SamplingParamsError(f"pooling={self.pooling!r} must be one of "
                                      f"{', '.join(POOLING_TYPES)}", "pooling")
        if not isinstance(self.normalize, bool):
            raise SamplingParamsError(f"normalize={self.normalize!r} must be true or false",
                                      "normalize")
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise SamplingParamsError(f"dimensions={self.dimensions!r} must be a positive "
                                      f"integer", "dimensions")
