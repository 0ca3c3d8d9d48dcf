"""Activation-aware weight quantization (AWQ, Lin et al. 2023): per-input-channel scales.

A few input channels carry much larger activations than the rest, and the weights that meet
them matter most. Scaling input channel j of W up by s_j before rounding (and the activation
down by s_j) gives those weights finer steps relative to their size:

    y = x W^T = (x / s) (W * s)^T          exact in real numbers; only W * s is quantized
    s = mean|x|^alpha, normalised to geometric-mean-ish 1; alpha in [0, 1) chosen per group of
    linears by a grid search minimising || x W^T - x (Q(W * s) / s)^T ||^2 on calibration x

alpha = 0 is plain round-to-nearest, so the search never does worse on its own loss. The 1 / s
is folded into whatever produces x, so the runtime module is unchanged. Per decoder layer:

    group     linears sharing x (W * s)          producer of x (takes 1 / s)
    qkv       q/k/v (Phi-3: qkv_proj)            the norm before attention: w / s, or for
                                                 Gemma's (1 + w) norms, 1 + w' = (1 + w) / s
    o         o_proj                             v's output rows (and bias); only when heads ==
                                                 kv heads: with GQA a v row feeds several o inputs
    gate_up   gate/up (Phi-3: gate_up_proj);     the norm before the MLP: post_attention_layernorm,
              a mixture: the router and every    Gemma's pre_feedforward_layernorm (its
              expert's gate/up                   post_attention_layernorm scales attention's output)
    down      down_proj (each expert's own)      up's output rows: act(g) * u / s = act(g) * (u / s);
                                                 none for gpt-oss's clamped SwiGLU, whose
                                                 (clamp(u) + 1) act(g) is not linear in u

A mixture's router and experts all read the norm's output, so they share one s, taken from
the statistics of every token; the loss sums each expert's error on the tokens routed to it
(and the router's, which is zero when the recipe keeps it dense). The router's W * s leaves its
logits as they were, up to rounding.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from qserve.layers.moe import SparseMoE
from qserve.models.base import MLP, Attention, DecoderLayer, RMSNorm
from qserve.models.gemma2 import GemmaDecoderLayer, GemmaRMSNorm
from qserve.models.gpt_oss import ClampedSwiGLUExpert

FakeQuant = Callable[[str, torch.Tensor], torch.Tensor]  # (HF linear name, W) -> Q(W) dequantized


# How each norm takes 1 / s on its output channels
_NORM_FOLDS = {RMSNorm: lambda w, s: w / s,  # w * norm(x) / s
               GemmaRMSNorm: lambda w, s: (1 + w) / s - 1}  # (1 + w') = (1 + w) / s


@dataclass
class Group:
    """Linears that read the same input x, and where x / s comes from. Module names are the
    model's ("layers.3.mlp.gate_up_proj"), not the checkpoint's."""
    key: str  # the alphas' key, after "<layer prefix>."
    consumers: list[str]  # linear modules reading x; the first reads every token (statistics)
    producer: str  # a norm module, or a linear module whose output rows `rows` are x
    rows: slice | None = None


def calibrate(arch, weights: dict[str, torch.Tensor], ids: list[int], fake_quant: FakeQuant,
              n_grid: int = 20, loss_tokens: int = 128, progress=None
              ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Scale `weights` (HF names, dense) for quantization by `fake_quant`.

    Args:
        ids: calibration token ids, run through the model as one sequence.
        loss_tokens: how many of each linear's input rows the grid search measures its loss on.
    Returns:
        the new weights (same names; untouched tensors shared) and the chosen alpha per group,
        keyed "<layer prefix>.<qkv|o|gate_up|down>" (a mixture's down:
        "<layer prefix>.experts.<e>.down").
    """
    from qserve.models.build import build_model, prefill

    check(arch)
    w = {k: v.float() for k, v in weights.items()}
    model = build_model(arch, w, len(ids))
    layers = [groups(model, i) for i in range(arch.num_layers)]
    inputs = _capture_inputs(model, [c for gs in layers for g in gs for c in g.consumers],
                             ids, prefill)
    alphas = {}
    for i, layer_groups in enumerate(layers):
        for g in layer_groups:
            if g.consumers[0] not in inputs:  # an expert no calibration token was routed to
                continue
            parts = [(name, inputs.get(c)) for c in g.consumers for name in _parts(model, c)]
            s, alpha = _search(inputs[g.consumers[0]], parts, w, fake_quant, n_grid,
                               loss_tokens)
            for name, _ in parts:
                w[name + ".weight"] = w[name + ".weight"] * s  # (out, in) columns
            _fold(model, g, s, w)
            alphas[f"model.layers.{i}.{g.key}"] = alpha
        if progress is not None:
            progress(i)
    return w, alphas


def check(arch) -> None:
    """Raise ConfigError, in one line, unless AWQ knows where every layer of `arch`'s model
    takes its scales (groups below)."""
    from qserve.errors import ConfigError
    from qserve.models.registry import meta_model

    model = meta_model(arch)
    if any(groups(model, i) is None for i in range(arch.num_layers)):
        raise ConfigError(f"AWQ does not calibrate {arch.architecture} yet (quant/awq.py does "
                          f"not know which tensors its layers' scales fold into); use a "
                          f"round-to-nearest recipe such as w4g64")


def groups(model, i: int) -> list[Group] | None:
    """Layer i's groups (the table above), read off the model's modules; None for a layer
    whose kind this module does not know (nothing to fold into that it has checked exact)."""
    layer, p = model.layers[i], f"layers.{i}."
    norms = {DecoderLayer: ("input_layernorm", "post_attention_layernorm"),
             GemmaDecoderLayer: ("input_layernorm", "pre_feedforward_layernorm")}.get(type(layer))
    if norms is None or type(layer.self_attn) is not Attention or any(
            type(getattr(layer, n)) not in _NORM_FOLDS for n in norms):
        return None
    attn = layer.self_attn
    out = [Group("qkv", [p + "self_attn.qkv_proj"], p + norms[0])]
    if attn.num_heads == attn.num_kv_heads:
        v = slice(attn.q_size + attn.kv_size, attn.q_size + 2 * attn.kv_size)
        out.append(Group("o", [p + "self_attn.o_proj"], p + "self_attn.qkv_proj", v))
    if type(layer.mlp) is MLP:
        mlps = {"": layer.mlp}
        gate_up = [p + "mlp.gate_up_proj"]
    elif type(layer.mlp) is SparseMoE and all(type(e) in (MLP, ClampedSwiGLUExpert)
                                               for e in layer.mlp.experts):
        mlps = {f"experts.{e}.": m for e, m in enumerate(layer.mlp.experts)}
        gate_up = [p + "mlp.gate"] + [f"{p}mlp.{e}gate_up_proj" for e in mlps]
    else:
        return None
    out.append(Group("gate_up", gate_up, p + norms[1]))
    for e, mlp in mlps.items():
        if type(mlp) is not MLP:  # (table above: no down group)
            continue
        up = slice(mlp.intermediate, 2 * mlp.intermediate)  # gate_up_proj's rows: gate | up
        out.append(Group(e + "down", [f"{p}mlp.{e}down_proj"], f"{p}mlp.{e}gate_up_proj", up))
    return out


def _parts(model, name: str) -> list[str]:
    """Linear module `name` -> the checkpoint linears (HF names) stacked into it."""
    return [src for src, _ in model._sources(name, model.get_submodule(name))]


def _fold(model, g: Group, s: torch.Tensor, w: dict[str, torch.Tensor]) -> None:
    """Divide the producer's outputs that are g's input x by s (x's width,): in w (HF names),
    as new tensors."""
    module = model.get_submodule(g.producer)
    if g.rows is None:  # a norm
        name = model.hf_name(g.producer) + ".weight"
        w[name] = _NORM_FOLDS[type(module)](w[name], s)
        return
    start = 0  # the producer's output rows -> the checkpoint linears holding them
    for src, n in model._sources(g.producer, module):
        lo, hi = max(g.rows.start, start), min(g.rows.stop, start + n)
        if lo < hi:
            for suffix in (".weight", ".bias"):
                if src + suffix in w:
                    t = w[src + suffix].clone()  # (rows, in) | (rows,)
                    scale = s[lo - g.rows.start:hi - g.rows.start]
                    t[lo - start:hi - start] /= scale[:, None] if t.dim() == 2 else scale
                    w[src + suffix] = t
        start += n


def _search(x_all: torch.Tensor, parts: list[tuple[str, torch.Tensor | None]],
            w: dict[str, torch.Tensor], fake_quant: FakeQuant, n_grid: int, loss_tokens: int
            ) -> tuple[torch.Tensor, float]:
    """x_all: (T, in) activations for the statistics; parts: (HF linear name, its input
    (t, in), None if it saw no token) sharing that input channel space. Returns the scales
    (in,) and alpha."""
    x_mean = x_all.abs().mean(0)  # (in,)
    loss = []  # (name, W (out, in), x (t', in), x W^T): t' <= loss_tokens rows of x
    for name, x in parts:
        if x is not None:
            rows = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
            x = x[rows[:loss_tokens]]
            m = w[name + ".weight"]
            loss.append((name, m, x, x @ m.T))
    best = (float("inf"), None, 0.0)
    for a in range(n_grid):
        alpha = a / n_grid
        s = x_mean.pow(alpha).clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = sum((x @ (fake_quant(n, m * s) / s).T - r).pow(2).sum().item()
                  for n, m, x, r in loss)
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


def _capture_inputs(model, names: list[str], ids: list[int], prefill
                    ) -> dict[str, torch.Tensor]:
    """One forward pass: module name -> its input (n, in) fp32, for the modules in `names`
    that ran (an expert sees only the tokens routed to it, and may see none)."""
    captured: dict[str, torch.Tensor] = {}
    hooks = []
    for name in names:
        def hook(_, args, name=name):
            assert name not in captured, name  # each runs once per step
            captured[name] = args[0].detach().float()
        hooks.append(model.get_submodule(name).register_forward_pre_hook(hook))
    try:
        prefill(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return captured
