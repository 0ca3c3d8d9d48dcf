"""Rotary position embeddings (rotate-half layout, as Hugging Face), with linear, llama3 and
longrope scaling, and partial rotation (only the first `rotary_dim` dims of a head turn)."""
from __future__ import annotations

import math

import torch

from qserve.config import rope_type
from qserve.kernels.paged_attention import PagedAttentionMetadata


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None,
                    long: bool = False) -> torch.Tensor:
    """(head_dim // 2,) fp32 angular frequencies, adjusted by the config's rope scaling.
    `head_dim` is the rotated width. long: longrope's long factors instead of its short ones."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Wavelengths shorter than high_freq_wavelen keep their frequency, longer than
        # low_freq_wavelen are divided by `factor`, and the band between is interpolated.
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_mid, mid, scaled)
    if kind == "longrope":
        # Phi-3: each frequency divided by its own factor, one list for sequences within the
        # original context and one for longer ones; in transformers' order of operations.
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"],
                               dtype=torch.float32, device="cpu")
        return 1.0 / (factors * theta ** exponents)
    if kind == "yarn":
        # YaRN (Qwen 2.5 / 3 long context): a frequency that turns more than beta_fast times
        # within the original context keeps its value, one that turns fewer than beta_slow
        # times is divided by `factor`, and between those dims a linear ramp blends the two;
        # in transformers' order of operations (its `truncate`: the dims rounded outwards).
        factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
        fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def dim_turning(turns: float) -> float:  # the dim whose wavelength fits `turns` times
            return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))
        low, high = dim_turning(fast), dim_turning(slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:  # (a ramp of no width)
            high += 0.001
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low)
                / (high - low)).clamp(0, 1)
        kept = 1 - ramp  # (head_dim // 2,) the weight of the unscaled frequency
        return 1.0 / (factor * theta ** exponents) * (1 - kept) + inv_freq * kept
    raise ValueError(f"unsupported rope scaling type {kind!r}; qserve supports linear, llama3, "
                     f"longrope and yarn")


def attention_factor(scaling: dict | None) -> float:
    """The factor cos and sin are multiplied by, unless the config gives it: for a context
    stretched s times, longrope's sqrt(1 + ln(s) / ln(original)), YaRN's 0.1 ln(s) + 1 (or
    the ratio of two such terms with DeepSeek's mscale and mscale_all_dim); 1 otherwise."""
    kind = rope_type(scaling)
    if kind not in ("longrope", "yarn"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor = scaling["factor"]
    if kind == "yarn":
        mscale, all_dims = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and all_dims:
            return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dims)
        return yarn_mscale(factor)
    original = scaling["original_max_position_embeddings"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `factor` times: 0.1 m ln(s) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by absolute position.

    With longrope the tables hold the short factors' rows 0 .. P-1, then the long factors'
    rows P .. 2P-1; `table_rows` picks a token's row.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype, device: torch.device, rotary_dim: int | None = None):
        self.rotary_dim = rotary_dim or head_dim
        self.max_positions = max_positions
        pos = torch.arange(max_positions, dtype=torch.int64, device="cpu").float()
        longrope = rope_type(scaling) == "longrope"
        tables = []
        for long in ((False, True) if longrope else (False,)):
            inv_freq = inv_frequencies(self.rotary_dim, theta, scaling, long)  # CPU, fp32
            freqs = pos[:, None] * inv_freq[None, :]  # (P, r/2)
            tables.append(torch.cat((freqs, freqs), dim=-1))  # (P, r)
        emb = torch.cat(tables)  # (P or 2P, r)
        factor = attention_factor(scaling)
        self.cos = (emb.cos() * factor).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * factor).to(dtype=dtype, device=device)
        # longrope: a sequence takes the long factors once it is longer than this
        self.original_max = scaling["original_max_position_embeddings"] if longrope else None

    def table_rows(self, positions: torch.Tensor, meta: PagedAttentionMetadata) -> torch.Tensor:
        """(T,) positions -> (T,) rows of the tables. Longrope, as transformers decides per
        forward pass: every token of a sequence whose length after this step exceeds the
        original context takes the long factors (rows shifted by P)."""
        if self.original_max is None:
            return positions
        query_lens = meta.query_start_loc.diff()
        seq_len = torch.repeat_interleave(meta.seq_lens, query_lens,
                                          output_size=positions.shape[0])  # (T,)
        return positions + self.max_positions * (seq_len > self.original_max)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) (table rows); q (T, Hq, d); k (T, Hkv, d) -> rotated q, k."""
        cos = self.cos[positions].unsqueeze(1)  # (T, 1, r)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = cos.shape[-1]
    if r < x.shape[-1]:  # partial rotation: the last head_dim - r dims pass through
        return torch.cat((_rotate(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    half = r // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class NoRope:
    """A layer's rope where it applies none (SmolLM3's every fourth layer): q and k pass."""

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k
