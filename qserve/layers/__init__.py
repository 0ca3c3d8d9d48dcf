"""Runtime modules shared by the model families: above the kernels, below the models."""
from qserve.layers.quant_linear import FileEmbedding, QuantEmbedding, QuantLinear

__all__ = ["QuantLinear", "QuantEmbedding", "FileEmbedding"]
