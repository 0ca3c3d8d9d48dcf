"""AWQ against plain round-to-nearest, int4 g64 asymmetric, on the real default model:
calibrated on the head of pydoc_data.topics, measured on held-out text from its tail, against
the fp32 model's logits (mean KL per token, and the perplexity increase)."""
import pytest

from qserve.quant import awq, calibration
from qserve.quant.quantize import plan_layers, quantize_weights
from qserve.quant.recipe import load_recipe
from qserve.quant.schemes import quantize as rtn

pytestmark = pytest.mark.slow


def test_awq_beats_round_to_nearest(loaded_model):
    text, tok = calibration.read_text(None), loaded_model.tokenizer
    calib = tok.encode(text[:8000], add_special_tokens=False)[:256]
    held_out = tok.encode(text[-8000:], add_special_tokens=False)[-256:]
    recipe = load_recipe("w4g64")  # the same scheme as w4g64-awq, without calibration
    plans = {p.name: p for p in plan_layers(loaded_model.arch, recipe)}
    arch = loaded_model.arch

    def fake_quant(name, w):
        return rtn(w, plans[name].scheme, plans[name].group_size).dequantize()

    # a lighter search than the recipe's (10 alphas, 128 loss tokens), to keep the test short
    scaled, alphas = awq.calibrate(arch, loaded_model.weights, calib, fake_quant,
                                   n_grid=10, loss_tokens=128)
    assert len(alphas) == 3 * arch.num_layers  # GQA: o_proj is not scaled
    ref = calibration.logits(calibration.build_model(arch, loaded_model.weights, 300), held_out)
    # AWQ's scaling alone (no rounding) is an exact rewrite of the model, up to fp32 rounding
    same = calibration.logits(calibration.build_model(arch, scaled, 300), held_out)
    assert calibration.compare(ref, same, held_out)["kl"] < 1e-6
    result = {}
    for name, weights in (("rtn", loaded_model.weights), ("awq", scaled)):
        loaded_model_like = type(loaded_model)(arch, weights, tok, loaded_model.path, "gguf")
        tensors, _ = quantize_weights(loaded_model_like, recipe, list(plans.values()))
        test = calibration.logits(calibration.build_model(arch, tensors, 300), held_out)
        result[name] = calibration.compare(ref, test, held_out)
    rtn_ppl_up = result["rtn"]["ppl"] - result["rtn"]["ppl_ref"]
    awq_ppl_up = result["awq"]["ppl"] - result["awq"]["ppl_ref"]
    # the bar: at least 40% less perplexity increase (measured: ~75% less, KL ~60% less)
    assert awq_ppl_up < 0.6 * rtn_ppl_up, result
    assert result["awq"]["kl"] < 0.6 * result["rtn"]["kl"], result
