"""Weight quantization (the offline tools above the engine). A weight scheme is a handler that
turns a state dict into a packed one, and the model swaps nn.Linear for QuantLinear when it
loads packed tensors.

    schemes.py      int8 per-channel / grouped, int4 grouped sym / asym: round-to-nearest
    recipe.py       recipes/*.yaml: a weight scheme and a default KV dtype, validated
    awq.py          activation-aware per-input-channel scales, folded into the previous op
    quantize.py     `qserve quantize`: plan per layer, quantize, write atomically, summarize
    calibration.py  calibration text, one-sequence forward passes, output-quality metrics
"""
from qserve.quant.quantize import quantize
from qserve.quant.recipe import Recipe, load_recipe
from qserve.formats import QuantizedTensor
from qserve.quant.schemes import WeightScheme

__all__ = ["QuantizedTensor", "WeightScheme", "Recipe", "load_recipe", "quantize"]
