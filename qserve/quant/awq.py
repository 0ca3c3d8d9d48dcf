"""Activation-aware weight quantization (AWQ, Lin et al. 2023): per-input-channel scales.

A few input channels carry much larger activations than the rest, and the weights that meet
them matter most. Scaling input channel j of W up by s_j before rounding (and the activation
down by s_j) gives those weights finer steps relative to their size:

    y = x W^T = (x / s) (W * s)^T          exact in real numbers; only W * s is quantized
    s = mean|x|^alpha, normalised to geometric-mean-ish 1; alpha in [0, 1) chosen per group of
    linears by a grid search minimising || x W^T - x (Q(W * s) / s)^T ||^2 on calibration x

alpha = 0 is plain round-to-nearest, so the search never does worse on its own loss. The 1 / s
is folded into whatever produces x, so the runtime module is unchanged:

    q/k/v   <- input_layernorm.weight / s        gate/up <- post_attention_layernorm.weight / s
    down    <- rows of up_proj / s               o       <- rows of v_proj / s (only when
                                                          heads == kv heads: with GQA a v row
                                                          feeds several o inputs)
"""
from __future__ import annotations

from collections.abc import Callable

import torch

FakeQuant = Callable[[str, torch.Tensor], torch.Tensor]  # (HF linear name, W) -> Q(W) dequantized


def calibrate(arch, weights: dict[str, torch.Tensor], ids: list[int], fake_quant: FakeQuant,
              n_grid: int = 20, loss_tokens: int = 128, progress=None
              ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Scale `weights` (HF names, dense) for quantization by `fake_quant`.

    Args:
        ids: calibration token ids, run through the model as one sequence.
        loss_tokens: how many of them the grid search measures its loss on.
    Returns:
        the new weights (same names; untouched tensors shared) and the chosen alpha per group,
        keyed "<layer prefix>.<qkv|o|gate_up|down>".
    """
    from qserve.models.build import build_model, prefill

    check(arch)
    w = {k: v.float() for k, v in weights.items()}
    inputs = _capture_inputs(build_model(arch, w, len(ids)), ids, prefill)
    alphas = {}
    rows = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))[:loss_tokens]
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        x = {k: v[rows] for k, v in inputs[i].items()}
        groups = [  # (key, linears sharing the input, how to fold 1 / s into the producer)
            ("qkv", [p + f"self_attn.{n}_proj" for n in "qkv"], p + "input_layernorm.weight"),
            ("gate_up", [p + "mlp.gate_proj", p + "mlp.up_proj"],
             p + "post_attention_layernorm.weight"),
            ("down", [p + "mlp.down_proj"], p + "mlp.up_proj.weight"),
        ]
        if arch.num_heads == arch.num_kv_heads:
            groups.insert(1, ("o", [p + "self_attn.o_proj"], p + "self_attn.v_proj.weight"))
        for key, names, producer in groups:
            W = [w[n + ".weight"] for n in names]
            s, alpha = _search(inputs[i][key], x[key], W, names, fake_quant, n_grid)
            for n, m in zip(names, W):
                w[n + ".weight"] = m * s  # (out, in) columns
            prod = w[producer]
            w[producer] = prod / s if prod.dim() == 1 else prod / s[:, None]  # norm | rows
            alphas[p + key] = alpha
        if progress is not None:
            progress(i)
    return w, alphas


def check(arch) -> None:
    """Raise ConfigError, in one line, unless AWQ can calibrate `arch`."""
    from qserve.errors import ConfigError

    if arch.num_experts:  # the groups below are the dense MLP's
        raise ConfigError(f"AWQ does not calibrate a mixture of experts ({arch.architecture}) "
                          f"yet; use a round-to-nearest recipe such as w4g64")
    if not folds_into(arch):
        raise ConfigError(f"AWQ does not calibrate {arch.architecture} yet (its scales fold "
                          f"into Llama-style norms and separate q/k/v and gate/up tensors); use "
                          f"a round-to-nearest recipe such as w4g64")


def folds_into(arch) -> bool:
    """Whether every layer of `arch`'s model is what the folding above assumes: base.py's
    pre-norm DecoderLayer, whose post_attention_layernorm feeds the MLP, with norms that
    multiply (w * norm(x)), and q/k/v, gate/up as tensors of their own. Not Gemma (its norms
    scale by 1 + w, and its post_attention_layernorm follows attention), nor Phi-3 (q/k/v
    and gate/up stored fused)."""
    from qserve.models.base import MLP, DecoderLayer, RMSNorm
    from qserve.models.registry import meta_model

    model = meta_model(arch)
    shapes = model.checkpoint_shapes()
    return all(type(layer) is DecoderLayer and type(layer.mlp) is MLP
               and type(layer.input_layernorm) is type(layer.post_attention_layernorm) is RMSNorm
               and all(f"model.layers.{i}.{n}.weight" in shapes for n in (
                   "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                   "mlp.up_proj"))
               for i, layer in enumerate(model.layers))


def _search(x_all: torch.Tensor, x: torch.Tensor, W: list[torch.Tensor], names: list[str],
            fake_quant: FakeQuant, n_grid: int) -> tuple[torch.Tensor, float]:
    """x_all: (T, in) activations for the statistics, x: (t, in) for the loss; W: matrices
    (out_k, in) sharing that input. Returns the scales (in,) and alpha."""
    x_mean = x_all.abs().mean(0)  # (in,)
    ref = [x @ m.T for m in W]
    best = (float("inf"), None, 0.0)
    for a in range(n_grid):
        alpha = a / n_grid
        s = x_mean.pow(alpha).clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = sum((x @ (fake_quant(n, m * s) / s).T - r).pow(2).sum().item()
                  for n, m, r in zip(names, W, ref))
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


def _capture_inputs(model, ids: list[int], prefill) -> list[dict[str, torch.Tensor]]:
    """One forward pass; per layer, the input of each linear: {"qkv", "o", "gate_up", "down"}
    -> (T, in) fp32."""
    captured: list[dict[str, torch.Tensor]] = [{} for _ in model.layers]
    hooks = []
    for i, layer in enumerate(model.layers):
        for key, mod in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                         ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
            def hook(_, args, i=i, key=key):
                captured[i][key] = args[0].detach().float()
            hooks.append(mod.register_forward_pre_hook(hook))
    try:
        prefill(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return captured
