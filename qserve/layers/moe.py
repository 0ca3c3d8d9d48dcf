"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks `top_k` of E expert
MLPs for each token, and the token's output is their weighted sum.

    logits = x @ gate^T                          (T, E), fp32
    p = softmax(logits);  w, ids = top_k(p)      (T, k) each
    w = w / sum(w)        if norm_topk_prob      (Mixtral always: the softmax of the top-k logits)
    y[t] = sum_j w[t, j] * expert[ids[t, j]](x[t])

The experts are modules of their own (the model's gated MLP: gate_up_proj and down_proj), so
their linears load, quantize and run like any other linear (QuantLinear in any weight format,
through kernels/dispatch.py). Tokens are grouped by the expert they picked and only experts that
some token picked run, each once over its tokens: a batch-1 decode step reads the weights of k
experts of E, a prefill step each picked expert's once.
"""
from __future__ import annotations

import torch
from torch import nn


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> (weights (T, k) fp32, expert ids (T, k) int64), highest first."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SparseMoE(nn.Module):
    """The router `gate` (a linear, hidden -> E) and E expert modules, each (n, hidden) ->
    (n, hidden)."""

    # the experts to run are read on the host each step, a sync no CUDA graph can capture
    # (engine/cuda_graph.py uncapturable): a mixture's decode steps run eagerly
    cuda_graph_safe = False

    def __init__(self, gate: nn.Module, experts: list[nn.Module], top_k: int,
                 norm_topk_prob: bool):
        super().__init__()
        assert 1 <= top_k <= len(experts)
        self.gate = gate
        self.experts = nn.ModuleList(experts)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden)."""
        T, k = x.shape[0], self.top_k
        weights, ids = route(self.gate(x), k, self.norm_topk_prob)  # (T, k) each
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # (T, hidden)
        if T == 1:  # decode at batch 1: no grouping needed
            for e, w in zip(ids[0].tolist(), weights[0]):
                out += w * self.experts[e](x).float()
            return out.to(x.dtype)
        # Group the T*k (token, choice) pairs by expert: a stable sort keeps tokens in order.
        flat = ids.flatten()  # (T*k,): pair t*k + j is token t's j-th choice
        order = torch.argsort(flat, stable=True)
        tokens = order // k  # (T*k,) the token of each pair, grouped by expert
        pair_weights = weights.flatten()[order, None]  # (T*k, 1)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start:start + n]
            y = self.experts[e](x[rows]).float()  # (n, hidden)
            out.index_add_(0, rows, y * pair_weights[start:start + n])
            start += n
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"
