"""Configuration: what the model is, and how the engine should run it.

One object per concern, validated on construction with messages a user understands. CLI flags
map onto these fields one to one; `EngineConfig` bundles them and is passed down whole.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from qserve.errors import ConfigError

def is_count(value, least: int = 1) -> bool:
    """Whether a value read from a model file is an integer (not a bool) of at least `least`."""
    return not isinstance(value, bool) and isinstance(value, int) and value >= least


def is_positive(value) -> bool:
    """Whether a value read from a model file is a finite number above 0 (not a bool)."""
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value) and value > 0)


def rope_type(scaling: dict | None) -> str:
    """A rope scaling's type, as transformers names it (Phi-3's old "su" is longrope)."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type")) or "default"
    return "longrope" if kind == "su" else kind


KV_DTYPES = ("auto", "fp32", "fp16", "bf16", "int8", "int4")
PREEMPTION_MODES = ("recompute", "swap")
KV_OFFLOAD_MODES = ("off", "layerwise")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class ModelArchConfig:
    """The shape of a decoder, read from config.json or GGUF metadata. Which model family runs
    it is `architecture`'s entry in qserve/models/registry.py."""

    architecture: str  # Hugging Face model_type: "llama", "mistral", "qwen2", "qwen3", "phi3", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style dict, e.g. {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    # "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, or None.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    # False: a backbone saved without the output layer its config names (an embedding model,
    # e.g. Qwen3-Embedding-8B): it embeds, and refuses to generate (its tied table stands in
    # for the missing layer only so that the model builds)
    generates: bool = True
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    sliding_window: int | None = None  # Mistral v0.1; None means full attention
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Per layer, as transformers' config.layer_types: "sliding_attention" layers see the last
    # `sliding_window` positions, "full_attention" layers all of them (Gemma 2/3 alternate).
    # None: every layer alike, windowed when sliding_window is set.
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None  # sliding layers' rope base, unscaled (Gemma 3)
    partial_rotary_factor: float = 1.0  # rope turns the first head_dim * this dims (Phi-4-mini)
    # layers that apply no rope at all (SmolLM3: every fourth); None: every layer rotates
    nope_layers: list[int] | None = None
    # Granite's scales: the embedding's output, each layer's attention and MLP output before
    # its residual add, and the logits (divided by logits_scaling)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    hidden_act: str = "silu"  # the MLP gate's activation: silu or gelu_pytorch_tanh (Gemma)
    query_pre_attn_scalar: float | None = None  # scores scale by its -1/2 power; None: head_dim
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    # Llama 4's attention temperature (Ministral 3): after rope, the query of position p is
    # scaled by 1 + beta * log(1 + floor(p / length)), so 1 below `length`; beta None: off
    attn_temperature_beta: float | None = None
    attn_temperature_length: int | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE): each layer's MLP is num_experts gated MLPs of
    # moe_intermediate_size, num_experts_per_tok of them run per token; 0 experts: dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True  # the chosen experts' weights are rescaled to sum to 1
    # gpt-oss: each attention head has a learned sink, a logit that joins every query's
    # softmax with a zero value (it takes probability from the context's scores)
    attention_sinks: bool = False
    # gpt-oss's clamped SwiGLU: gate clamped above and up on both sides at the limit, then
    # (up + 1) * gate * sigmoid(alpha * gate); None: the plain gated MLP
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0

    def __post_init__(self):
        # A corrupt file's metadata (a count of 0, a string, NaN) fails here in one line, not
        # as a division by zero or an empty tensor deep in the engine.
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if not is_count(getattr(self, name)):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a positive integer")
        if self.head_dim > MAX_HEAD_DIM:  # (rope's tables are built before the memory plan)
            raise ConfigError(f"head_dim={self.head_dim} is larger than qserve runs (at most "
                              f"{MAX_HEAD_DIM})")
        if not is_positive(self.rope_theta):
            raise ConfigError(f"rope_theta={self.rope_theta!r} must be a positive finite number")
        if not (self.rms_norm_eps == 0 or is_positive(self.rms_norm_eps)):
            raise ConfigError(f"rms_norm_eps={self.rms_norm_eps!r} must be a non-negative "
                              f"finite number")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ConfigError(f"layer_types lists {len(self.layer_types)} layers, but the "
                                  f"model has num_layers={self.num_layers}")
            bad = set(self.layer_types) - set(LAYER_TYPES)
            if bad:
                raise ConfigError(f"layer type {sorted(bad)[0]!r} is not supported; qserve runs "
                                  f"{' and '.join(LAYER_TYPES)} layers")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ConfigError(f"hidden activation {self.hidden_act!r} is not supported; qserve "
                              f"runs {', '.join(HIDDEN_ACTS)}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be from 1 "
                              f"to num_experts={self.num_experts}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ConfigError(f"partial_rotary_factor={self.partial_rotary_factor} must give an "
                              f"even number of rotated dims out of head_dim={self.head_dim}")
        self._check_rope_scaling()
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
            if not is_positive(getattr(self, name)):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a positive number")
        if self.nope_layers is not None and not all(
                isinstance(i, int) and 0 <= i < self.num_layers for i in self.nope_layers):
            raise ConfigError(f"layers without rope {self.nope_layers!r} must be layer "
                              f"indexes below num_layers={self.num_layers}")
        if self.attn_temperature_beta is not None:
            if not is_positive(self.attn_temperature_beta):
                raise ConfigError(f"attention temperature beta={self.attn_temperature_beta!r} "
                                  f"must be a positive number")
            if not is_count(self.attn_temperature_length):
                raise ConfigError(f"attention temperature length="
                                  f"{self.attn_temperature_length!r} must be a positive integer")
            if rope_type(self.rope_scaling) == "longrope":  # its rope rows are not positions
                raise ConfigError("attention temperature with longrope scaling is not supported")
        if self.swiglu_limit is not None:
            for name in ("swiglu_limit", "swiglu_alpha"):
                if not is_positive(getattr(self, name)):
                    raise ConfigError(f"{name}={getattr(self, name)!r} must be a positive number")

    def _check_rope_scaling(self) -> None:
        """The scaling's numbers are what its type needs: a positive finite factor, an
        original context of at least 2 positions (longrope and YaRN divide by its log), one
        positive factor per rotated frequency (longrope)."""
        scaling, kind = self.rope_scaling, rope_type(self.rope_scaling)
        if kind not in ROPE_TYPES:
            raise ConfigError(f"rope scaling {kind!r} is not supported; qserve runs "
                              f"{', '.join(ROPE_TYPES[1:])}")
        if kind == "default":
            return
        if not is_positive(scaling.get("factor")):
            raise ConfigError(f"rope scaling {kind!r} has factor {scaling.get('factor')!r}; it "
                              f"must be a positive number")
        original = scaling.get("original_max_position_embeddings")
        if (kind in ("longrope", "yarn") or original is not None) and not is_count(original, 2):
            raise ConfigError(f"rope scaling {kind!r} has original_max_position_embeddings "
                              f"{original!r}; it must be an integer of at least 2")
        for name in ("beta_fast", "beta_slow") if kind == "yarn" else ():
            if scaling.get(name) is not None and not is_positive(scaling[name]):
                raise ConfigError(f"YaRN's {name} is {scaling[name]!r}; it must be a positive "
                                  f"number")
        for name in ("long_factor", "short_factor") if kind == "longrope" else ():
            values = scaling.get(name)
            if (not isinstance(values, list) or len(values) != self.rotary_dim // 2
                    or not all(is_positive(v) for v in values)):
                got = f"{len(values)} values" if isinstance(values, list) else repr(values)
                raise ConfigError(f"longrope's {name} must be {self.rotary_dim // 2} positive "
                                  f"numbers, one per rotated frequency (it is {got})")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of one layer (None: it attends to the whole context)."""
        if self.layer_types is not None and self.layer_types[layer] == "full_attention":
            return None
        return self.sliding_window

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


LAYER_TYPES = ("sliding_attention", "full_attention")
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")  # qserve/models/rope.py
MAX_HEAD_DIM = 4096  # 16x the largest of the families qserve runs (Gemma's 256)
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


def parse_size(text: str | int | float, what: str) -> int:
    """'4GiB', '512MiB', '1.5G', '1000000' -> bytes."""
    if isinstance(text, (int, float)):
        if not math.isfinite(text):
            raise ConfigError(f"{what}={text!r} is not a size; use e.g. 512MiB or 2GiB")
        return int(text)
    s = text.strip().lower().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "b": 1}
    for unit, mult in units.items():
        if s.endswith(unit):
            num = s[: -len(unit)]
            break
    else:
        num, mult = s, 1
    try:
        value = float(num)
    except ValueError:
        raise ConfigError(f"{what}={text!r} is not a size; use e.g. 512MiB or 2GiB") from None
    if not math.isfinite(value * mult):  # nan, inf, 1e400
        raise ConfigError(f"{what}={text!r} is not a size; use e.g. 512MiB or 2GiB")
    if value < 0:
        raise ConfigError(f"{what}={text!r} must not be negative")
    return int(value * mult)


@dataclass
class CacheConfig:
    """The paged KV cache: block size, dtype, and the two pools' budgets."""

    block_size: int = 16
    kv_dtype: str = "auto"
    # Device pool budget in bytes; None means `kv_cache_fraction` of the memory free at start-up.
    kv_cache_memory: int | None = None
    kv_cache_fraction: float = 0.1
    swap_space: int = 1 << 30  # host pool for swapped-out blocks, bytes
    # Blocks the scheduler keeps free when admitting new requests, so running ones can grow.
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    # Layer-wise KV admission and offload (engine/layerwise.py): "off" or "layerwise".
    kv_offload: str = "off"
    # Layers whose staged K/V may be in flight at once during a layer-wise prefill (the one
    # being computed, the next ones being fetched, the previous ones being written to host).
    kv_offload_lookahead: int = 4
    # The policy knob: the fraction of the device pool that new full admissions and bringing
    # offloaded sequences back for decode must leave free, so layer-wise prefills can always
    # stage. Higher: lower time-to-first-token under load; lower: larger decode batches.
    kv_offload_reserve: float = 0.1

    def __post_init__(self):
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ConfigError(f"--block-size={self.block_size} must be a power of two from 1 to 256")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"--kv-dtype={self.kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"--kv-cache-memory={self.kv_cache_memory} must be positive")
        if not 0 < self.kv_cache_fraction <= 1:
            raise ConfigError(f"kv_cache_fraction={self.kv_cache_fraction} must be in (0, 1]")
        if self.swap_space < 0:
            raise ConfigError(f"--swap-space={self.swap_space} must not be negative")
        if not 0 <= self.watermark < 1:
            raise ConfigError(f"watermark={self.watermark} must be in [0, 1)")
        if self.kv_offload not in KV_OFFLOAD_MODES:
            raise ConfigError(f"--kv-offload={self.kv_offload!r}; choose off or layerwise")
        if self.kv_offload_lookahead < 1:
            raise ConfigError(
                f"--kv-offload-lookahead={self.kv_offload_lookahead} must be at least 1")
        if not 0 <= self.kv_offload_reserve < 1:
            raise ConfigError(
                f"--kv-offload-reserve={self.kv_offload_reserve} must be in [0, 1)")


@dataclass
class SchedulerConfig:
    """Budgets for one engine step, and what to do when blocks run out."""

    max_num_seqs: int = 256
    # None: chosen for the device when the EngineConfig is built (batched_tokens_for)
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's own context length
    preemption_mode: str = "recompute"
    enable_chunked_prefill: bool = True
    max_waiting: int | None = None  # None: unbounded; the server sets a bound for back-pressure

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs={self.max_num_seqs} must be at least 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"--max-num-batched-tokens={self.max_num_batched_tokens} must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max-model-len={self.max_model_len} must be at least 2")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(
                f"--preemption-mode={self.preemption_mode!r}; choose recompute or swap")


def batched_tokens_for(device: str) -> int:
    """The default token budget of one step on `device` (cpu or cuda).

    On a CPU a step's activations are its cost beyond the weights: at 4096 tokens a Llama-3.2-1B
    step holds a 268 MB gate/up output, and the prompt path's elementwise work and the int8
    GEMM's activation records leave the caches. 32 prompts of 128 tokens (1B Q4_K_M, 2 threads,
    scripts/bench_step_budget.py) prefilled at 379 / 396 / 300 / 254 / 216 tok/s with budgets
    of 256 / 512 / 1024 / 2048 / 4096 tokens. 512 is also llama.cpp's physical batch
    (n_ubatch). A GPU fills its cores better with larger steps, as vLLM's 2048.
    """
    return 512 if device == "cpu" else 2048


@dataclass
class SpeculativeConfig:
    """Speculative decoding: a draft proposes up to K tokens, the target verifies them in one pass.

    draft: a model with the target's vocabulary (alias, .gguf, HF directory), `self:RECIPE`
    (the target's own weights quantized with a recipe) or `ngram` (prompt lookup, no model).
    """

    draft: str
    num_speculative_tokens: int = 4  # K, the most tokens proposed per sequence per step
    # Speculate only while at most this many sequences run: beyond it a decode step is no longer
    # bound by reading the weights, and verifying K extra tokens per sequence costs real compute.
    # On the 2-core CPU box, 4 made 16 concurrent requests 0.72x as fast (the tail of the batch
    # speculated at low acceptance); 1 measured 1.09x there and 2.2x at batch 1 on rewrites.
    spec_max_batch_size: int = 1
    # A sequence whose recent acceptance rate (an exponential average) falls below this stops
    # speculating for 2, 4, 8 ... 32 steps, then tries again.
    spec_min_acceptance: float = 0.3
    ngram_max: int = 3  # prompt lookup matches the last ngram_max .. ngram_min tokens
    ngram_min: int = 1

    def __post_init__(self):
        if not isinstance(self.draft, str) or not self.draft.strip():
            raise ConfigError(f"--draft={self.draft!r}; give a model, self:RECIPE or ngram")
        if self.draft.startswith("self:") and not self.draft[5:]:
            raise ConfigError("--draft=self: needs a recipe name, e.g. self:w4g64")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(f"--num-speculative-tokens={self.num_speculative_tokens} must be "
                              f"from 1 to 16")
        if self.spec_max_batch_size < 1:
            raise ConfigError(f"spec_max_batch_size={self.spec_max_batch_size} must be at least 1")
        if not 0 <= self.spec_min_acceptance < 1:
            raise ConfigError(f"spec_min_acceptance={self.spec_min_acceptance} must be in [0, 1)")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"ngram_min={self.ngram_min} and ngram_max={self.ngram_max} must "
                              f"satisfy 1 <= ngram_min <= ngram_max")

    @property
    def kind(self) -> str:
        """"ngram", "self" or "model"."""
        if self.draft == "ngram":
            return "ngram"
        return "self" if self.draft.startswith("self:") else "model"


@dataclass
class EngineConfig:
    """Everything the engine needs besides the weights."""

    model: str | None = None  # alias, GGUF file or HF directory; None: the default model
    device: str = "auto"
    # activations, and dense weights that are not kept as stored; auto: bf16 on CUDA (tensor
    # cores, fp32's range), fp32 on the CPU (whose kernels compute in fp32 anyway)
    dtype: str = "auto"
    weights: str = "native"  # native: the file's own precision; dense: dequantize to `dtype`
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ConfigError(f"--device={self.device!r}; choose auto, cpu or cuda")
        if self.dtype not in ("auto", "fp32", "fp16", "bf16"):
            raise ConfigError(f"--dtype={self.dtype!r}; choose auto, fp32, fp16 or bf16")
        if self.weights not in ("native", "dense"):
            raise ConfigError(f"--weights={self.weights!r}; choose native (the file's own "
                              f"precision) or dense (dequantized to --dtype)")
        if self.scheduler.max_num_batched_tokens is None:  # an explicit cuda is checked later
            device = self.resolved_device() if self.device == "auto" else self.device
            self.scheduler.max_num_batched_tokens = batched_tokens_for(device)

    def resolved_dtype(self) -> str:
        """fp32, fp16 or bf16: `dtype`, with auto resolved for the device."""
        if self.dtype != "auto":
            return self.dtype
        return "bf16" if self.resolved_device() == "cuda" else "fp32"

    def resolved_device(self) -> str:
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device=cuda but no CUDA device is visible; use --device cpu")
        return self.device


def engine_config(model: str | None = None, **flat) -> EngineConfig:
    """Build an EngineConfig from flat keyword arguments (the CLI flags' and LLM()'s names):
    each name is a field of CacheConfig, SchedulerConfig, SpeculativeConfig or EngineConfig
    itself (the speculative ones only together with `draft`).

    Sizes may be given as strings ('2GiB'). Unknown names raise ConfigError.
    """
    cache_fields = CacheConfig.__dataclass_fields__
    sched_fields = SchedulerConfig.__dataclass_fields__
    spec_fields = SpeculativeConfig.__dataclass_fields__
    engine_fields = (set(EngineConfig.__dataclass_fields__)
                     - {"cache", "scheduler", "speculative", "model"})
    cache, sched, spec, engine = {}, {}, {}, {}
    for name, value in flat.items():
        if value is None and name not in ("kv_cache_memory", "max_model_len", "max_waiting"):
            continue
        if name in ("kv_cache_memory", "swap_space") and value is not None:
            value = parse_size(value, "--" + name.replace("_", "-"))
        if name in cache_fields:
            cache[name] = value
        elif name in sched_fields:
            sched[name] = value
        elif name in spec_fields:
            spec[name] = value
        elif name in engine_fields:
            engine[name] = value
        else:
            raise ConfigError(f"unknown engine option {name!r}")
    if spec and "draft" not in spec:
        raise ConfigError(f"{', '.join(sorted(spec))}: speculative decoding needs a draft; "
                          f"pass --draft MODEL, self:RECIPE or ngram")
    return EngineConfig(model=model, cache=CacheConfig(**cache),
                        scheduler=SchedulerConfig(**sched),
                        speculative=SpeculativeConfig(**spec) if spec else None, **engine)


def model_home() -> Path:
    """qserve's cache directory (models, kernel builds, KV codebooks): $QSERVE_HOME, else
    $XDG_CACHE_HOME/qserve, else ~/.cache/qserve."""
    if os.environ.get("QSERVE_HOME"):
        return Path(os.environ["QSERVE_HOME"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "qserve"
    return Path.home() / ".cache" / "qserve"
