"""What every decoder family shares: the layers of a Llama-style transformer over a paged KV
cache, weight loading driven by the module tree, and the family's declaration.

A family (one file: llama.py, qwen3.py, phi3.py, gemma2.py, ...) subclasses `CausalLM`,
declares its names (Hugging Face architectures and model_types, GGUF architectures), which
checkpoint linears are stacked into one module (`packed_modules_mapping`), how GGUF names
its tensors, and builds its decoder layers. Everything else is derived from the model built on
the meta device: the tensors a checkpoint must hold and their shapes (`checkpoint_shapes`),
the linears that run fused (`fused_groups`), the parameter count.

Tokens arrive packed flat (T tokens from any number of sequences, no padding). The norm and
rope arithmetic follows Hugging Face's order of operations, so fp32 outputs match it to rounding.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from qserve.config import ModelArchConfig
from qserve.errors import ModelLoadError
from qserve.formats import QuantizedTensor
from qserve.formats.qtensor import cat_quantized
from qserve.kernels.dispatch import attention, output_logits
from qserve.kernels.paged_attention import PagedAttentionMetadata
from qserve.layers.quant_linear import FileEmbedding, QuantEmbedding, QuantLinear
from qserve.models.rope import RotaryEmbedding


class LayerHooks(Protocol):
    """What a step that moves KV blocks hands the model (engine/layerwise.py StepLayers): each
    layer's cache and metadata, and a call once the layer is done."""

    def before(self, i: int) -> tuple[dict[str, torch.Tensor], PagedAttentionMetadata]: ...

    def after(self, i: int) -> None: ...


class RMSNorm(nn.Module):
    """Llama's: the normalized activations are cast back to their dtype, then scaled by w."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class PackedLinear(nn.Linear):
    """A linear whose output rows stack several checkpoint linears (q/k/v, gate/up), of
    `output_sizes` rows each, in order."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)


_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class Attention(nn.Module):
    """Fused q/k/v, optional per-head q/k norms (Qwen3, Gemma 3), rope, paged attention with
    this layer's own window (soft-capped scores: Gemma 2; sinks: gpt-oss), and the output
    projection."""

    def __init__(self, arch: ModelArchConfig, rope: RotaryEmbedding, layer: int,
                 qk_norm: type[nn.Module] | None = None, o_bias: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads, arch.num_kv_heads, arch.head_dim)
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = PackedLinear(arch.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                                     bias=arch.attention_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=o_bias)
        if qk_norm is not None:
            self.q_norm = qk_norm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = qk_norm(arch.head_dim, arch.rms_norm_eps)
        self.qk_norm = qk_norm is not None
        self.rope = rope
        self.scale = (arch.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.window = arch.layer_window(layer)
        self.softcap = arch.attn_logit_softcapping
        self.temperature = (None if arch.attn_temperature_beta is None else
                            (arch.attn_temperature_beta, arch.attn_temperature_length))
        # gpt-oss: each head's sink logit (H,), one more softmax term with a zero value
        self.sinks = (nn.Parameter(torch.empty(arch.num_heads), requires_grad=False)
                      if arch.attention_sinks else None)
        # soft-capped scores and sinks take the reference path (kernels/dispatch.py attention),
        # which sizes each sequence's context from the metadata's host list, which a CUDA
        # graph would fix at its context bucket (engine/cuda_graph.py uncapturable)
        self.cuda_graph_safe = self.softcap is None and self.sinks is None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: dict[str, torch.Tensor],
                meta: PagedAttentionMetadata) -> torch.Tensor:
        """x (T, hidden); positions (T,) rope table rows -> (T, hidden)."""
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q, k)
        if self.temperature is not None:  # (positions: the rope rows are the positions here)
            beta, length = self.temperature
            scale = 1 + beta * torch.log1p(torch.floor(positions.float() / length))  # (T,)
            q = q * scale.to(q.dtype)[:, None, None]
        if meta.sliding_window != self.window:  # it carries arch.sliding_window; Gemma's
            # global layers have none
            meta = dataclasses.replace(meta, sliding_window=self.window)
        out = attention(q, k, v, cache, meta, self.scale, self.softcap, self.sinks)
        return self.o_proj(out.reshape(T, self.q_size))


class MLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)), intermediate_size wide unless told (an
    expert of a mixture, layers/moe.py, is moe_intermediate_size wide)."""

    def __init__(self, arch: ModelArchConfig, intermediate_size: int | None = None):
        super().__init__()
        self.intermediate = intermediate_size or arch.intermediate_size
        self.gate_up_proj = PackedLinear(arch.hidden_size, [self.intermediate] * 2)
        self.down_proj = nn.Linear(self.intermediate, arch.hidden_size, bias=False)
        self.act = _ACTIVATIONS[arch.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). `mlp`: the
    family's own (a mixture of experts), else the gated MLP."""

    def __init__(self, arch: ModelArchConfig, rope: RotaryEmbedding, layer: int,
                 qk_norm: type[nn.Module] | None = None, o_bias: bool = False,
                 mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, rope, layer, qk_norm, o_bias)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch) if mlp is None else mlp
        self.residual = arch.residual_multiplier  # Granite scales each output before its add

    def forward(self, x, positions, cache, meta):
        a = self.self_attn(self.input_layernorm(x), positions, cache, meta)
        x = x + (a if self.residual == 1.0 else a * self.residual)
        m = self.mlp(self.post_attention_layernorm(x))
        return x + (m if self.residual == 1.0 else m * self.residual)


# GGUF module names (llama.cpp's, gguf-py tensor_mapping) of the Hugging Face modules, for the
# Llama layout; a family overrides what it names otherwise. Layer modules drop "layers.{i}."
# on the Hugging Face side and "blk.{i}." on the GGUF side.
GGUF_NAMES = {
    "embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down"}


class CausalLM(nn.Module):
    """A decoder-only language model over a paged KV cache; subclasses are the families."""

    # --- the family's declaration ---------------------------------------------------------
    # config.json "architectures": one per model_type, or one for them all
    architectures: ClassVar[tuple[str, ...]] = ()
    model_types: ClassVar[tuple[str, ...]] = ()  # config.json "model_type"
    gguf_architectures: ClassVar[tuple[str, ...]] = ()  # GGUF general.architecture
    # GGUF architectures that run as another of the family's model_types: llama.cpp names the
    # language half of a vision-language model for the whole (qwen2vl: Qwen2-VL's Qwen2),
    # and gives a text token one position on every axis of its multimodal rope, the plain rope
    gguf_model_types: ClassVar[dict[str, str]] = {}
    # A mixture of experts: llama.cpp writes Mixtral as "llama" and tells them apart by
    # `{arch}.expert_count` (models/registry.py gguf_family)
    moe: ClassVar[bool] = False
    # module -> the checkpoint linears stacked (along out) into it, Hugging Face names
    packed_modules_mapping: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    gguf_names: ClassVar[dict[str, str]] = GGUF_NAMES
    # model_types whose GGUF q/k rows llama.cpp interleaves for its adjacent-pair rope
    gguf_permuted_qk: ClassVar[tuple[str, ...]] = ()
    # llama.cpp stores Gemma's norm weights as 1 + w (its norm multiplies by w): subtracted
    gguf_norm_offset: ClassVar[float] = 0.0
    # Defaults for config.json keys the family's transformers config defines (absent keys)
    hf_defaults: ClassVar[dict] = {}
    # Every n-th layer attends globally, the rest through the window, when neither config.json
    # nor the GGUF lists the layers (transformers' and llama.cpp's default for the family)
    sliding_window_pattern: ClassVar[int | None] = None
    norm_class: ClassVar[type[nn.Module]] = RMSNorm  # the final norm's

    @classmethod
    def fill_hf_config(cls, cfg: dict) -> dict:
        """config.json as the common reader should see it: the family's defaults filled in."""
        return cls.hf_defaults | cfg

    @classmethod
    def hf_config(cls, cfg: dict) -> dict:
        """ModelArchConfig fields the family reads from config.json (with its defaults filled
        in) beyond the common ones; a ConfigError names a bad key."""
        return {}

    @classmethod
    def gguf_config(cls, arch: dict, key: Callable, tensor: Callable) -> dict:
        """ModelArchConfig fields the family reads from GGUF metadata beyond the common ones in
        `arch` (key(name, default) reads `{arch}.name`; tensor(name) reads a tensor)."""
        return {}

    @classmethod
    def stored_tensors(cls, name: str, shape: tuple[int, ...],
                       shapes: dict[str, tuple[int, ...]]
                       ) -> list[tuple[str, tuple[int, ...], Callable, tuple[str, ...],
                                       str | None]] | None:
        """A checkpoint tensor (`name`, `shape`; `shapes`: all of the checkpoint's) that is
        not one of the model's as it is stored -> the model's tensors read from it, each
        (name, shape, take, reads, format): take(the safetensors slices of the stored tensors
        named `reads`, this one first) gives it, a tensor of the stored dtype (format None) or
        a QuantizedTensor of that format. gpt-oss stacks its experts (each read from one
        slice) and stores MXFP4 matrices as blocks and scales (read from both; the scales'
        own entry is then []). None: the tensor is the model's as it is."""
        return None

    # quantization_config quant_methods of checkpoints that stored_tensors reads natively
    # (gpt-oss: OpenAI's MXFP4 experts)
    stored_quant_methods: ClassVar[tuple[str, ...]] = ()

    # --- the model ----------------------------------------------------------------------
    def __init__(self, arch: ModelArchConfig, max_positions: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.arch = arch
        self.dtype, self.device = dtype, device
        self.rope = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta,
                                    arch.rope_scaling, dtype, device, arch.rotary_dim)
        # sliding layers' own rope base, unscaled (Gemma 3); they share the rows of self.rope
        self.local_rope = None
        if arch.rope_local_theta is not None:
            assert self.rope.original_max is None, "longrope rows are not the local rope's"
            self.local_rope = RotaryEmbedding(arch.head_dim, max_positions,
                                              arch.rope_local_theta, None, dtype, device,
                                              arch.rotary_dim)
        # no random init (load_weights replaces every parameter; a first normal_ on the meta
        # device also costs seconds of lazy imports)
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size,
                                         _weight=torch.empty(arch.vocab_size, arch.hidden_size))
        self.layers = nn.ModuleList(self.decoder_layer(arch, i) for i in range(arch.num_layers))
        self.norm = self.norm_class(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = (None if arch.tie_word_embeddings else
                        nn.Linear(arch.hidden_size, arch.vocab_size, bias=False))
        self.requires_grad_(False)

    def decoder_layer(self, arch: ModelArchConfig, i: int) -> nn.Module:
        return DecoderLayer(arch, self.layer_rope(i), i)

    def layer_rope(self, i: int) -> RotaryEmbedding:
        local = self.local_rope is not None and self.arch.layer_window(i) is not None
        return self.local_rope if local else self.rope

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) -> (T, hidden)."""
        return self.embed_tokens(input_ids)

    def fused_decode(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     caches: list[dict[str, torch.Tensor]], meta: PagedAttentionMetadata
                     ) -> torch.Tensor | None:
        """A decode step run by one fused kernel, from its token ids (T,) and rope table rows
        (positions): the final hidden states (T, hidden), after the final norm, as forward
        returns them; or None: the layers run one by one."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                caches: list[dict[str, torch.Tensor]], meta: PagedAttentionMetadata,
                layers: LayerHooks | None = None) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, hidden).

        `layers`, when the step moves KV blocks or stages layer-wise prefills
        (engine/layerwise.py), gives each layer its cache and metadata and waits for its copies.
        """
        positions = self.rope.table_rows(positions, meta)
        if layers is None and meta.decode_only:
            out = self.fused_decode(input_ids, positions, caches, meta)
            if out is not None:
                return out
        x = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            cache, m = (caches[i], meta) if layers is None else layers.before(i)
            x = layer(x, positions, cache, m)
            if layers is not None:
                layers.after(i)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, hidden) -> (S, vocab) fp32 logits."""
        if isinstance(self.lm_head, QuantLinear):
            logits = self.lm_head(hidden).float()
        elif self.lm_head is None and isinstance(self.embed_tokens, QuantEmbedding):
            logits = self.embed_tokens.logits(hidden)
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = output_logits(hidden, weight)
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # --- weights ------------------------------------------------------------------------
    @staticmethod
    def hf_name(name: str) -> str:
        """A module or parameter of this model -> its Hugging Face checkpoint name."""
        return name if name.split(".")[0] == "lm_head" else "model." + name

    def _sources(self, name: str, module: nn.Linear) -> list[tuple[str, int]]:
        """A linear module -> the checkpoint linears (HF names) stacked into it, with rows."""
        owner, _, leaf = name.rpartition(".")
        parts = self.packed_modules_mapping.get(leaf)
        if parts is None or not isinstance(module, PackedLinear):
            return [(self.hf_name(name), module.out_features)]
        assert len(parts) == len(module.output_sizes), name
        return [(self.hf_name(f"{owner}.{p}"), n) for p, n in zip(parts, module.output_sizes)]

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a Hugging Face checkpoint of this model holds -> its shape, linears
        (out_features, in_features). Read from the modules, so meta-built models answer."""
        shapes = {}
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                for src, rows in self._sources(name, module):
                    shapes[src + ".weight"] = (rows, module.in_features)
                    if module.bias is not None:
                        shapes[src + ".bias"] = (rows,)
                continue
            for pname, p in module.named_parameters(recurse=False):
                shapes[self.hf_name(f"{name}.{pname}")] = tuple(p.shape)
        return shapes

    def fused_groups(self) -> list[tuple[str, ...]]:
        """The checkpoint linears (HF names, no ".weight") that run as one matrix."""
        return [tuple(src for src, _ in self._sources(name, module))
                for name, module in self.named_modules()
                if isinstance(module, PackedLinear) and len(self._sources(name, module)) > 1]

    def load_weights(self, weights: dict[str, torch.Tensor | QuantizedTensor]) -> None:
        """Take Hugging Face-named weights; fuse stacked linears (packed_modules_mapping) as
        they go in. The module may have been built on the meta device: every parameter is
        replaced.

        A weight is a dense tensor or a QuantizedTensor (any format of qserve.formats: a qserve
        checkpoint's int4/int8, a GGUF's blocks, fp16 kept as stored). A linear with any packed
        part becomes a QuantLinear whose parts keep their own formats, as row segments (parts
        of one format are stacked, which is exact); so does an fp16/bf16 one in an fp32 model,
        which would otherwise double its memory. Dense parts otherwise take the model's dtype."""
        dtype, device = self.dtype, self.device
        params = dict(self.named_parameters())
        seen = set()

        def put(name: str, tensor: torch.Tensor) -> None:
            p = params[name]
            if p.shape != tensor.shape:
                raise ModelLoadError(f"weight {self.hf_name(name)}: shape "
                                     f"{tuple(tensor.shape)}, expected {tuple(p.shape)}")
            owner, _, attr = name.rpartition(".")
            value = tensor.to(dtype=dtype, device=device).contiguous()
            setattr(self.get_submodule(owner), attr, nn.Parameter(value, requires_grad=False))
            seen.add(name)

        def get(name: str) -> torch.Tensor | QuantizedTensor:
            if name not in weights:
                raise ModelLoadError(f"weight {name} is missing from the checkpoint")
            return weights[name]

        def row_reader(name: str):
            """A reader of name's rows by slices (LazyWeights.row_reader), or None."""
            reader = getattr(weights, "row_reader", None)
            return None if reader is None else reader(name)

        def in_file(name: str):
            """name's rows read from its file at each lookup (LazyWeights.file_rows), or None."""
            source = getattr(weights, "file_rows", None)
            return None if source is None else source(name)

        def kept_packed(w: torch.Tensor | QuantizedTensor) -> QuantizedTensor | None:
            """w as a packed part, or None when it becomes a dense parameter."""
            if isinstance(w, QuantizedTensor):
                return w
            if dtype == torch.float32 and w.dtype in _STORED_FORMATS:
                return QuantizedTensor(_STORED_FORMATS[w.dtype], w, None, None, w.shape[1])
            return None

        def linear(dst: str, module: nn.Linear) -> None:
            """Load nn.Linear `dst` from its checkpoint linears (stacked along out)."""
            sources = self._sources(dst, module)  # (checkpoint name, rows) per part
            bias = module.bias is not None
            b = torch.cat([get(s + ".bias") for s, _ in sources]) if bias else None

            def check(p: QuantizedTensor) -> None:
                problem = p.validate() if p.in_features == module.in_features else (
                    f"{p.in_features} inputs, expected {module.in_features}")
                if problem:
                    raise ModelLoadError(f"weight {self.hf_name(dst)} ({p.format}): {problem}")

            def segment(w: torch.Tensor | QuantizedTensor) -> QuantizedTensor:
                """w checked and laid out for the device, a dense part as a dense segment."""
                p = kept_packed(w)
                if p is None:  # a dense part beside packed ones
                    p = QuantizedTensor("f32", w.float().contiguous(), None, None, w.shape[1])
                check(p)
                return QuantLinear.device_layout(p, device)

            # Parts the source reads by row slices (a GGUF's packed matrices) are laid out
            # for the device slice by slice, alike neighbours into one buffer
            # (QuantLinear.laid_out); the others are read whole, one at a time, each laid out
            # before the next is read. Either way the load never holds a file's whole copy of
            # a matrix beside its layout, nor laid-out parts beside their stack.
            readers = [row_reader(src + ".weight") for src, _ in sources]
            dense, segments = [], []
            if all(readers):
                segments = QuantLinear.laid_out(
                    [(rows, read) for (_, rows), read in zip(sources, readers)], device, check)
            else:
                for (src, rows), read in zip(sources, readers):
                    if read is not None and not dense:
                        segments += QuantLinear.laid_out([(rows, read)], device, check)
                        continue
                    w = get(src + ".weight")
                    if not segments and kept_packed(w) is None:
                        dense.append(w)  # dense until a packed part comes
                        continue
                    segments += [segment(d) for d in dense] + [segment(w)]
                    dense = []
                    del w
            if not segments:
                put(dst + ".weight", dense[0] if len(dense) == 1 else torch.cat(dense))
                if bias:
                    put(dst + ".bias", b)
                return
            segments = _stack_alike(segments)
            out = sum(seg.shape[0] for seg in segments)
            if out != module.out_features:
                raise ModelLoadError(f"weight {self.hf_name(dst)}: {out} output rows, expected "
                                     f"{module.out_features}")
            b = None if b is None else b.float()
            owner, _, attr = dst.rpartition(".")
            setattr(self.get_submodule(owner), attr, QuantLinear.on_device(segments, b, device))
            seen.update({dst + ".weight", dst + ".bias"})

        def embedding(dst: str, module: nn.Embedding) -> None:
            name = self.hf_name(dst) + ".weight"
            rows = module.weight.shape[0]
            owner, _, attr = dst.rpartition(".")
            source = in_file(name) if self.lm_head is not None and device.type == "cpu" else None
            if source is not None:  # untied: looked up a few rows a step, from the file
                if (source.num_rows, source.in_features) != tuple(module.weight.shape):
                    raise ModelLoadError(f"weight {name}: shape {(source.num_rows, source.in_features)}"
                                         f", expected {tuple(module.weight.shape)}")
                setattr(self.get_submodule(owner), attr, FileEmbedding(source, dtype))
                seen.add(dst + ".weight")
                return
            read = row_reader(name)

            def check(p: QuantizedTensor) -> None:
                problem = p.validate()
                if problem:
                    raise ModelLoadError(f"weight {name} ({p.format}): {problem}")

            w = get(name) if read is None else QuantLinear.laid_out([(rows, read)], device,
                                                                    check)[0]
            packed = kept_packed(w)
            if packed is None:
                put(dst + ".weight", w)
                return
            if packed.shape != tuple(module.weight.shape) or packed.validate():
                raise ModelLoadError(f"weight {self.hf_name(dst)} ({packed.format}): "
                                     f"{packed.validate() or f'shape {packed.shape}'}")
            setattr(self.get_submodule(owner), attr, QuantEmbedding.on_device(packed, dtype, device))
            seen.add(dst + ".weight")

        for name, module in list(self.named_modules()):  # modules are replaced as they load
            if isinstance(module, nn.Linear):
                linear(name, module)
            elif isinstance(module, nn.Embedding):
                embedding(name, module)
            else:  # norms
                for pname, _ in module.named_parameters(recurse=False):
                    put(f"{name}.{pname}", get(self.hf_name(f"{name}.{pname}")))
        missing = set(params) - seen
        assert not missing, f"parameters left unloaded: {sorted(missing)[:4]}"


# A dense fp16/bf16 weight in an fp32 model stays at its stored precision, as this format.
_STORED_FORMATS = {torch.float16: "f16", torch.bfloat16: "bf16"}


def _stack_alike(segments: list[QuantizedTensor]) -> list[QuantizedTensor]:
    """Merge neighbouring segments that can be stacked into one (same format, group size and
    symmetry): fewer, larger matmuls."""
    out = [segments[0]]
    for seg in segments[1:]:
        try:
            out[-1] = cat_quantized([out[-1], seg])
        except ValueError:
            out.append(seg)
    return out
