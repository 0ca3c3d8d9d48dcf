"""GGUF file -> ModelArchConfig, Hugging Face-named weights, and a Tokenizer.

A GGUF file is typed key/value metadata, a table of tensors, then the tensor data:

    "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv      x (key str, value_type u32, value)         str = u64 byte length + utf-8
    n_tensors x (name str, n_dims u32, dims u64[n_dims], ggml_type u32, offset u64)
    zero padding to `general.alignment` (default 32) | data  (tensor offsets count from here)

`dims` lists the fastest-varying axis first, so (ne0=in, ne1=out) is an HF (out, in) matrix.
A 3-D tensor (ne0=in, ne1=out, ne2=E) stacks E matrices, a mixture's experts (ffn_*_exps):
matrix e is the e-th contiguous run of its bytes, listed as its own tensor `<name>[e]`; so is
row e of a 2-D ffn_*_exps.bias (ne0=out, ne1=E), expert e's bias (gpt-oss).
The header is parsed here rather than with gguf.GGUFReader, which builds a numpy view per string
and takes seconds on a 49k-token vocabulary; dequantization is the `gguf` package's. A long
string array (a vocabulary, its merges) is checked at parse time but kept in the file's map
(GGUFStrings), its strings made when read: the memory planner, `qserve info` and the loader
each parse the header, and only the tokenizer reads the vocabulary.
"""
from __future__ import annotations

import array
import math
import mmap
import os
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qserve.config import ModelArchConfig, is_count, is_positive
from qserve.errors import ConfigError, ModelLoadError
from qserve.formats import QuantizedTensor, format_for_ggml, ggml
from qserve.heap import weight_buffer
from qserve.loader.hf_loader import check_shapes
from qserve.loader.weights import FileRows, LazyWeights
from qserve.loader.tokenizer import Tokenizer, byte_level_bpe, sentencepiece_bpe
from qserve.models import registry
from qserve.models.rope import attention_factor

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")  # a string's length
# String arrays longer than this stay in the file's map (GGUFStrings); shorter ones are lists
LAZY_STRINGS = 1024


class GGUFStrings(Sequence):
    """A GGUF string array, read from the file's map as it is indexed or iterated: 400k
    Python strings (Llama 3's vocabulary and merges) cost ~30 MiB and most of a header's
    parse, and once freed leave Python's small-object arenas partly held. Compares equal to
    a list of the same strings; `+` gives a list."""

    def __init__(self, mm: mmap.mmap, starts: array.array):
        self._mm = mm
        self._starts = starts  # each string's u64 length field, as a byte offset in mm

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        at = self._starts[i]
        (n,) = _U64.unpack_from(self._mm, at)
        return self._mm[at + 8:at + 8 + n].decode("utf-8")  # checked when parsed

    def __eq__(self, other) -> bool:
        if not isinstance(other, (list, GGUFStrings)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __add__(self, other) -> list[str]:
        return list(self) + list(other)

    def __radd__(self, other) -> list[str]:
        return list(other) + list(self)

    def __repr__(self) -> str:
        return f"GGUFStrings({len(self)} strings)"


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy / HF order: dims reversed
    ggml_type: ggml.GGMLTypeId  # .name: 'Q4_K', ...
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """The parsed header of one GGUF file; tensor data is read from a memory map on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                if not os.fstat(f.fileno()).st_size:
                    raise self.error("is empty, not a GGUF file")
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise self.error(f"cannot be read ({e.strerror})") from None
        self._pos = 0
        try:
            self._parse()
        except (struct.error, IndexError):
            raise self.error("is truncated or corrupt (the header runs past the end)") from None
        except UnicodeDecodeError:
            raise self.error(f"is corrupt (a string near byte {self._pos} is not UTF-8)") from None

    def error(self, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: {problem}")

    def type_error(self, tensor: str, type_name: str) -> ModelLoadError:
        """Tensor `tensor` is of a GGML type qserve has no kernels for (IQ2_XXS, TQ1_0, ...)."""
        return self.error(f"tensor {tensor} has type {type_name}, which qserve cannot run "
                          f"(supported: F32, F16, BF16, "
                          f"{', '.join(t.upper() for t in ggml.TYPES)})")

    def _parse(self) -> None:
        if self._mm[:4] != b"GGUF":
            raise self.error("not a GGUF file (no GGUF magic); pass a .gguf file or a model directory")
        version, n_tensors, n_kv = self._unpack("IQQ", 4)
        if version not in (2, 3):
            raise self.error(f"GGUF version {version} is not supported (2 or 3)")
        self.metadata = {}
        for _ in range(n_kv):
            key = self._str()
            self.metadata[key] = self._value(self._unpack("I")[0])
        infos = []
        for _ in range(n_tensors):
            name = self._str()
            dims = self._unpack("Q" * self._unpack("I")[0])
            infos.append((name, dims) + self._unpack("IQ"))
        align = self.metadata.get("general.alignment", 32)
        if not is_count(align) or align & (align - 1):
            raise self.error(f"general.alignment is {align!r}; it must be a power of two")
        data_start = -(-self._pos // align) * align
        self.tensors: dict[str, GGUFTensorInfo] = {}
        end = 0
        for name, dims, type_id, offset in infos:
            if type_id not in ggml.ALL_TYPES:
                raise self.error(f"tensor {name} has unknown type id {type_id}")
            if name in self.tensors:
                raise self.error(f"tensor {name} is listed twice")
            if not dims or not all(dims):
                raise self.error(f"tensor {name} has shape {tuple(reversed(dims))}: an empty "
                                 f"tensor")
            qtype = ggml.GGMLTypeId(type_id)
            block, block_bytes = ggml.ALL_TYPES[type_id][1:]
            if dims[0] % block:
                raise self.error(f"tensor {name} has {dims[0]} columns, not a multiple of "
                                 f"{qtype.name}'s block of {block}")
            nbytes = math.prod(dims) // block * block_bytes
            # A GGUF's tensors lie back to back in the order listed, each padded to the
            # alignment (llama.cpp refuses a file otherwise): a corrupt offset, type or shape
            # that would put one on another's bytes, or leave a gap, fails here.
            if offset != end:
                raise self.error(f"is corrupt: tensor {name} starts at data offset {offset}, "
                                 f"but the tensors listed before it end at {end}")
            end = -(-(offset + nbytes) // align) * align
            info = GGUFTensorInfo(name, tuple(reversed(dims)), qtype, data_start + offset, nbytes)
            if info.offset + nbytes > len(self._mm):
                raise self.error(f"is truncated: tensor {name} ends at byte {info.offset + nbytes} "
                                 f"but the file has {len(self._mm)}")
            self.tensors[name] = info
            # stacked experts: each a (out, in) matrix, or a bias (gpt-oss), of its own
            if len(info.shape) == 3 or (len(info.shape) == 2 and name.endswith("_exps.bias")):
                per = nbytes // info.shape[0]
                for e in range(info.shape[0]):
                    self.tensors[f"{name}[{e}]"] = GGUFTensorInfo(
                        f"{name}[{e}]", info.shape[1:], qtype, info.offset + e * per, per)

    def _unpack(self, fmt: str, pos: int | None = None) -> tuple:
        self._pos = self._pos if pos is None else pos
        values = struct.unpack_from("<" + fmt, self._mm, self._pos)
        self._pos += struct.calcsize("<" + fmt)
        return values

    def _str(self) -> str:
        """The next string; a bad one names its length field's byte (self._pos)."""
        at = self._pos
        (n,) = _U64.unpack_from(self._mm, at)
        if at + 8 + n > len(self._mm):
            raise IndexError
        text = self._mm[at + 8:at + 8 + n].decode("utf-8")
        self._pos = at + 8 + n
        return text

    def _strings(self, n: int) -> GGUFStrings:
        """The next n strings, each checked as UTF-8 (a corrupt file fails here, not in the
        tokenizer) and dropped at once, their places kept."""
        starts = array.array("q")
        for _ in range(n):
            starts.append(self._pos)
            self._str()
        return GGUFStrings(self._mm, starts)

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._str()
        if vtype == _ARRAY:
            itype, n = self._unpack("IQ")
            if itype in _SCALARS:  # numeric arrays in one read
                dtype = np.dtype("<" + _SCALARS[itype].replace("?", "b1"))
                if self._pos + n * dtype.itemsize > len(self._mm):
                    raise IndexError
                arr = np.frombuffer(self._mm, dtype, n, self._pos)
                self._pos += n * dtype.itemsize
                return arr.tolist()
            if itype == _STRING and n > LAZY_STRINGS:
                return self._strings(n)
            return [self._value(itype) for _ in range(n)]
        if vtype not in _SCALARS:
            raise self.error(f"metadata near byte {self._pos} has unknown value type {vtype}")
        return self._unpack(_SCALARS[vtype])[0]

    def blocks(self, name: str) -> tuple[GGUFTensorInfo, np.ndarray]:
        """A tensor's raw bytes, one row per output: (out, bytes_per_row) uint8, read-only.
        For a block type a row is in_features / block blocks of GGML_QUANT_SIZES bytes."""
        info = self.tensors.get(name)
        if info is None:
            raise self.error(f"missing tensor {name}")
        raw = np.frombuffer(self._mm, np.uint8, info.nbytes, info.offset)
        return info, raw.reshape(-1, info.nbytes // int(np.prod(info.shape[:-1], dtype=np.int64)))

    def read(self, name: str) -> torch.Tensor:
        """A tensor's raw bytes, (nbytes,) uint8, read from the file into fresh memory."""
        info = self.tensors[name]
        buf = weight_buffer((info.nbytes,))
        with open(self.path, "rb") as f:
            f.seek(info.offset)
            if f.readinto(memoryview(buf.numpy())) != info.nbytes:
                raise self.error(f"is truncated: tensor {name} could not be read whole")
        return buf

    def read_rows(self, name: str, r0: int, r1: int, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """Rows r0 .. r1 of a 2-D tensor's raw bytes, (r1 - r0, bytes_per_row) uint8, read
        from the file into `out` (contiguous, that shape), or fresh memory."""
        info = self.tensors[name]
        row_bytes = info.nbytes // info.shape[0]
        buf = weight_buffer((r1 - r0, row_bytes)) if out is None else out
        assert buf.shape == (r1 - r0, row_bytes) and buf.dtype == torch.uint8
        assert buf.is_contiguous()
        with open(self.path, "rb") as f:
            f.seek(info.offset + r0 * row_bytes)
            if f.readinto(memoryview(buf.numpy()).cast("B")) != buf.numel():
                raise self.error(f"is truncated: tensor {name} could not be read whole")
        return buf

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor as stored, in HF (out, in) order but rows not un-permuted: F32/F16/BF16
        in their dtype, quantized types dequantized to fp32 (qserve/formats)."""
        info = self.tensors.get(name)
        if info is None:
            raise self.error(f"missing tensor {name}")
        raw = self.read(name)
        type_name = info.ggml_type.name
        if type_name in ("F32", "F16", "BF16"):
            dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
            return raw.view(dtype[type_name]).view(info.shape)
        try:
            format_for_ggml(type_name)  # KeyError: a type qserve cannot run
        except KeyError:
            raise self.type_error(name, type_name) from None
        rows = raw.view(int(np.prod(info.shape[:-1], dtype=np.int64)), -1)
        return _as_qtensor(rows, type_name, info.shape[-1]).dequantize().view(info.shape)


# llama.cpp's `{arch}.pooling_type` (enum llama_pooling_type) -> qserve's names; 0 is none
_POOLING_TYPES = {1: "mean", 2: "cls", 3: "last", 4: "rank"}


def read_pooling(gguf: GGUFFile) -> str | None:
    """The pooling an embedding model's GGUF declares (llama.cpp's converter writes
    sentence-transformers' as `{arch}.pooling_type`), or None; "rank" (a reranker's
    classifier head) comes back by name."""
    arch = gguf.metadata.get("general.architecture")
    value = gguf.metadata.get(f"{arch}.pooling_type")
    if value is None or value == 0:
        return None
    if value not in _POOLING_TYPES:
        raise gguf.error(f"metadata key {arch}.pooling_type is {value!r}; llama.cpp's types "
                         f"are 0-4")
    return _POOLING_TYPES[value]


def read_arch(gguf: GGUFFile) -> ModelArchConfig:
    """ModelArchConfig from the metadata (no tensor data is read, but for rope tables)."""
    md = gguf.metadata
    arch = md.get("general.architecture")
    try:  # Mixtral is a llama GGUF with experts
        family, model_type = registry.gguf_family(arch, md.get(f"{arch}.expert_count", 0))
    except ConfigError as e:
        raise gguf.error(str(e)) from None

    def key(name, default=None):
        value = md.get(f"{arch}.{name}", default)
        if value is None:
            raise gguf.error(f"missing metadata key {arch}.{name}")
        return value

    def count(name, default=None) -> int:  # what the shapes below are computed from
        value = key(name, default)
        if not is_count(value):
            raise gguf.error(f"metadata key {arch}.{name} is {value!r}; it must be a positive "
                             f"integer")
        return value

    hidden, heads = count("embedding_length"), count("attention.head_count")
    if "token_embd.weight" not in gguf.tensors:
        raise gguf.error("missing tensor token_embd.weight")
    layers = count("block_count")
    blocks = {int(m[1]) for m in (re.match(r"blk\.(\d+)\.", t) for t in gguf.tensors) if m}
    in_file = max(blocks, default=-1) + 1
    if layers != in_file:  # (and a corrupt count of 2**31 layers is not built name by name)
        raise gguf.error(f"metadata key {arch}.block_count is {layers}, but the file has "
                         f"tensors for {in_file} layers")
    if heads > hidden and f"{arch}.attention.key_length" not in md:
        raise gguf.error(f"metadata key {arch}.attention.head_count is {heads}, more heads "
                         f"than embedding_length {hidden} has dimensions")
    head_dim = count("attention.key_length", hidden // heads)
    window = md.get(f"{arch}.attention.sliding_window") or None  # 0: none (Phi-4)
    fields = dict(
        architecture=model_type,
        vocab_size=gguf.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=key("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=key("rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(gguf, arch),
        max_position_embeddings=key("context_length", 4096),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        sliding_window=window,
        layer_types=_layer_types(gguf, arch, family, layers) if window else None,
        partial_rotary_factor=key("rope.dimension_count", head_dim) / head_dim,
        attn_logit_softcapping=md.get(f"{arch}.attn_logit_softcapping"),
        final_logit_softcapping=md.get(f"{arch}.final_logit_softcapping"),
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_ids(md))
    try:
        fields |= family.gguf_config(fields, key, gguf.tensor)
    except ConfigError as e:
        raise gguf.error(str(e)) from None
    experts = fields.get("num_experts")
    if experts is not None:  # a mixture: its experts are stacked, the count their first dim
        stacked = gguf.tensors.get("blk.0.ffn_gate_exps.weight")
        if stacked is None:
            raise gguf.error("missing tensor blk.0.ffn_gate_exps.weight")
        if not is_count(experts, 0) or experts != stacked.shape[0]:
            raise gguf.error(f"metadata key {arch}.expert_count is {experts!r}, but "
                             f"blk.0.ffn_gate_exps.weight stacks {stacked.shape[0]} experts")
    try:
        return ModelArchConfig(**fields)
    except ConfigError as e:
        raise gguf.error(str(e)) from None


def _layer_types(gguf: GGUFFile, arch: str, family, num_layers: int) -> list[str] | None:
    """Which layers slide, as llama.cpp reads them: `attention.sliding_window_pattern`, a list
    (true: sliding) or n (every n-th layer global), else the family's n; None: all slide."""
    pattern = gguf.metadata.get(f"{arch}.attention.sliding_window_pattern",
                                family.sliding_window_pattern)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise gguf.error(f"{arch}.attention.sliding_window_pattern lists {len(pattern)} "
                             f"layers, but the model has {num_layers}")
        return ["sliding_attention" if s else "full_attention" for s in pattern]
    if not pattern:
        return None
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)]


EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id")


def _eos_ids(md: dict) -> list[int]:
    return list(dict.fromkeys(md[k] for k in EOS_KEYS if k in md))


def _entries(values) -> str:
    """'5 entries', or what a value that is not a list is."""
    return f"{len(values):,} entries" if isinstance(values, list) else f"a {type(values).__name__}"


def _rope_scaling(gguf: GGUFFile, arch: str) -> dict | None:
    """HF-style rope_scaling from `{arch}.rope.scaling.*`, or Llama 3's, which llama.cpp bakes
    into a `rope_freqs.weight` tensor of per-frequency divisors."""
    md = gguf.metadata
    kind = md.get(f"{arch}.rope.scaling.type", "linear" if f"{arch}.rope.scale_linear" in md else None)
    factor = md.get(f"{arch}.rope.scaling.factor", md.get(f"{arch}.rope.scale_linear", 1.0))
    original = md.get(f"{arch}.rope.scaling.original_context_length")
    if kind == "linear" and factor != 1.0:
        return {"rope_type": "linear", "factor": factor}
    longrope = kind == "longrope" or "rope_factors_long.weight" in gguf.tensors
    if (kind == "yarn" or longrope) and not is_count(original, 2):
        raise gguf.error(f"metadata key {arch}.rope.scaling.original_context_length is "
                         f"{original!r}; {'YaRN' if kind == 'yarn' else 'longrope'} scaling "
                         f"needs the original context, an integer of at least 2")
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor,
                   "original_max_position_embeddings": original}
        # As llama.cpp runs it: an extrapolation factor other than 1 is another method (not
        # supported), and yarn_attn_factor (a converted config's attention_factor) is replaced
        # by the factor worked out below
        ext = md.get(f"{arch}.rope.scaling.yarn_ext_factor", 1.0)
        if ext != 1.0:
            raise gguf.error(f"YaRN rope scaling with {arch}.rope.scaling.yarn_ext_factor "
                             f"{ext!r} is not supported (only 1)")
        for key in ("beta_fast", "beta_slow"):  # (llama.cpp's defaults, transformers' too)
            if f"{arch}.rope.scaling.yarn_{key}" in md:
                scaling[key] = md[f"{arch}.rope.scaling.yarn_{key}"]
        log_mul = md.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0)
        if log_mul:  # llama.cpp's ratio of mscales, transformers' mscale / mscale_all_dim
            scaling |= {"mscale": 1.0, "mscale_all_dim": log_mul}
        # llama.cpp multiplies YaRN's factor by the file's attn_factor (default 1); a factor
        # that is not a number is ModelArchConfig's to refuse
        stored = md.get(f"{arch}.rope.scaling.attn_factor", 1.0)
        if not is_positive(stored):
            raise gguf.error(f"metadata key {arch}.rope.scaling.attn_factor is {stored!r}; it "
                             f"must be a positive number")
        if stored != 1.0 and isinstance(factor, (int, float)):
            scaling["attention_factor"] = stored * attention_factor(scaling)
        return scaling
    if longrope:  # Phi-3: factors per frequency, as tensors (the converter writes no
        # scaling type for Phi-3)
        for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            if name not in gguf.tensors:
                raise gguf.error(f"longrope rope scaling without tensor {name}")
        context = md.get(f"{arch}.context_length", 4096)
        scaling = {"rope_type": "longrope",
                   "long_factor": gguf.tensor("rope_factors_long.weight").float().tolist(),
                   "short_factor": gguf.tensor("rope_factors_short.weight").float().tolist(),
                   "original_max_position_embeddings": original, "factor": context / original}
        stored = md.get(f"{arch}.rope.scaling.attn_factor")
        # the file keeps the attention factor in fp32: recompute it in double unless it differs
        if stored is not None and abs(stored - attention_factor(scaling)) > 1e-6:
            scaling["attention_factor"] = stored
        return scaling
    if kind not in (None, "none", "linear"):
        raise gguf.error(f"rope scaling {kind!r} is not supported (linear, yarn, llama3, "
                         f"longrope)")
    if "rope_freqs.weight" not in gguf.tensors:
        return None
    divisors = gguf.tensor("rope_freqs.weight").float()  # (head_dim // 2,)
    head_dim = 2 * divisors.numel()
    # Llama 3.x use low/high_freq_factor 1 and 4 over an 8192 context; check the tensor says so.
    scaling = {"rope_type": "llama3", "factor": divisors.max().item(), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": original or 8192}
    theta = md.get(f"{arch}.rope.freq_base", 10000.0)
    if not torch.allclose(divisors, llama3_rope_divisors(scaling, theta, head_dim), rtol=1e-4):
        raise gguf.error("rope_freqs.weight is not a Llama 3 rope scaling qserve can express")
    return scaling


def llama3_rope_divisors(s: dict, theta: float, head_dim: int) -> torch.Tensor:
    """Per-frequency divisors (head_dim // 2,) of Llama 3 rope scaling: long wavelengths are
    slowed by `factor`, short ones kept, and the band between blended smoothly."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * torch.pi / inv_freq
    orig = s["original_max_position_embeddings"]
    smooth = (orig / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    blended = 1 / ((1 - smooth) / s["factor"] + smooth)
    out = torch.where(wavelen > orig / s["low_freq_factor"], s["factor"], blended)
    return torch.where(wavelen < orig / s["high_freq_factor"], 1.0, out).float()


def hf_names(arch: ModelArchConfig) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, for every tensor the model needs (the family's
    gguf_names applied to its checkpoint names; expert e of a mixture is the slice `[e]` of
    its stacked tensor)."""
    gguf_names = registry.model_class(arch.architecture).gguf_names
    names = {}
    for hf in registry.checkpoint_shapes(arch):
        module, _, param = hf.removeprefix("model.").rpartition(".")
        layer = re.match(r"layers\.(\d+)\.", module)
        if layer:
            module = module[layer.end():]
        expert = re.search(r"\.experts\.(\d+)\.", module)
        if expert:  # mlp.experts.3.gate_proj -> mlp.experts.gate_proj, slice [3]
            module = module[:expert.start()] + ".experts." + module[expert.end():]
        prefix = f"blk.{layer[1]}." if layer else ""
        suffix = f"[{expert[1]}]" if expert else ""
        if f"{module}.{param}" in gguf_names:  # a parameter of its own name (attn_sinks.weight)
            names[f"{prefix}{gguf_names[f'{module}.{param}']}{suffix}"] = hf
            continue
        assert module in gguf_names, f"no GGUF name for {module}"
        names[f"{prefix}{gguf_names[module]}.{param}{suffix}"] = hf
    return names


def unpermute_rows(gguf_name: str, arch: ModelArchConfig) -> int | None:
    """The head count to `_unpermute` a tensor's rows by, or None if it is in HF order
    (llama.cpp permutes llama's q/k for its adjacent-pair rope, and leaves the rotate-half
    families' in HF order)."""
    if arch.architecture not in registry.model_class(arch.architecture).gguf_permuted_qk:
        return None
    if ".attn_q." in gguf_name:
        return arch.num_heads
    return arch.num_kv_heads if ".attn_k." in gguf_name else None


def read_tensor(gguf: GGUFFile, gguf_name: str, arch: ModelArchConfig, native: bool = True
                ) -> torch.Tensor | QuantizedTensor:
    """One tensor, rows in HF order, read from the file into memory of its own (so nothing
    stays mapped: a file changed under a running server cannot crash it).

    native: a 2-D tensor keeps its file's precision as a QuantizedTensor: Q4_0 / Q4_1 / Q8_0
    repacked losslessly into int4 / int8, the K-quants and Q5_0 / Q5_1 as their blocks, F16 /
    BF16 as stored; F32 and 1-D tensors are plain fp32 tensors. Otherwise every tensor is
    dequantized to fp32. A type qserve cannot run is a ModelLoadError naming it."""
    info = gguf.tensors.get(gguf_name)
    if info is None:
        raise gguf.error(f"missing tensor {gguf_name}")
    raw = gguf.read(gguf_name)  # (nbytes,) uint8
    type_name = info.ggml_type.name
    try:
        fmt = format_for_ggml(type_name)
    except KeyError:
        raise gguf.type_error(gguf_name, type_name) from None
    if fmt is None:
        w = raw.view(torch.float32).view(info.shape)
    elif len(info.shape) == 1:  # norms, biases: tiny, always fp32
        w = _as_qtensor(raw.view(1, -1), type_name, info.shape[0]).dequantize().view(-1)
    else:
        w = _as_qtensor(raw.view(info.shape[0], -1), type_name, info.shape[1])
        if not native:
            w = w.dequantize()
    offset = registry.model_class(arch.architecture).gguf_norm_offset
    if offset and gguf_name.endswith("norm.weight"):  # llama.cpp stored 1 + w (Gemma)
        w = w - offset
    n_head = unpermute_rows(gguf_name, arch)
    if n_head is None:
        return w
    if isinstance(w, QuantizedTensor):
        return w.rows(_unpermute(torch.arange(w.shape[0]), n_head))
    return _unpermute(w, n_head)


def tensor_rows(gguf: GGUFFile, gguf_name: str, arch: ModelArchConfig, native: bool = True
                ) -> Callable[[int, int], QuantizedTensor] | None:
    """A reader of a packed matrix's output rows r0 .. r1, each slice what read_tensor would
    give for those rows (LazyWeights.row_reader); None for what read_tensor must read whole:
    dense types, 1-D tensors, q/k rows llama.cpp permuted, expert slices, not native.
    Every slice is read into one buffer the reader keeps (its first, largest slice's size),
    so a slice is valid until the next read (Q4_0 / Q8_0's repack gives fresh tensors): a
    load allocates no file copy per slice, nor frees one."""
    info = gguf.tensors.get(gguf_name)
    if (not native or info is None or len(info.shape) != 2
            or info.ggml_type.name in ("F32", "F16", "BF16")
            or unpermute_rows(gguf_name, arch) is not None):
        return None
    type_name = info.ggml_type.name
    try:
        format_for_ggml(type_name)
    except KeyError:
        return None  # read_tensor names the type in its error
    row_bytes = info.nbytes // info.shape[0]
    buf = torch.empty(0, row_bytes, dtype=torch.uint8)

    def read(r0: int, r1: int) -> QuantizedTensor:
        nonlocal buf
        if buf.shape[0] < r1 - r0:
            buf = weight_buffer((r1 - r0, row_bytes))  # the part itself when read whole
        rows = gguf.read_rows(gguf_name, r0, r1, out=buf[:r1 - r0])
        return _as_qtensor(rows, type_name, info.shape[1])
    return read


def file_rows(gguf: GGUFFile, gguf_name: str, arch: ModelArchConfig, native: bool = True
              ) -> FileRows | None:
    """A 2-D tensor's rows read from the file on demand (FileRows), each decoded as read_tensor
    would give it; None for tensors whose rows llama.cpp permuted or of a type qserve cannot
    run (read_tensor names it)."""
    info = gguf.tensors.get(gguf_name)
    if info is None or len(info.shape) != 2 or unpermute_rows(gguf_name, arch) is not None:
        return None
    type_name = info.ggml_type.name
    try:
        fmt = format_for_ggml(type_name)
    except KeyError:
        return None
    rows, cols = info.shape

    def decode(raw: torch.Tensor) -> torch.Tensor | QuantizedTensor:
        if fmt is None:
            return raw.view(torch.float32)
        w = _as_qtensor(raw, type_name, cols)
        return w if native else w.dequantize()
    return FileRows(gguf.path, gguf_name, info.offset, rows, info.nbytes // rows, cols, decode)


def _as_qtensor(rows: torch.Tensor, type_name: str, in_features: int) -> QuantizedTensor:
    """(out, row_bytes) uint8 rows of a tensor of GGML type `type_name` (e.g. 'Q4_K') -> the
    QuantizedTensor of the format it runs in (format_for_ggml)."""
    fmt = format_for_ggml(type_name)
    if fmt in ("f16", "bf16"):
        dtype = torch.float16 if fmt == "f16" else torch.bfloat16
        return QuantizedTensor(fmt, rows.view(dtype), None, None, in_features)
    if fmt in ("int4", "int8"):  # Q4_0 / Q4_1 / Q8_0
        return ggml.repack(type_name.lower(), rows, in_features)
    return QuantizedTensor(fmt, rows, None, None, in_features)


def read_weights(gguf: GGUFFile, arch: ModelArchConfig, native: bool = True) -> LazyWeights:
    """Every weight the model needs under Hugging Face names, shapes (out, in): a lazy
    mapping that reads each tensor from the file when it is looked up (see read_tensor)."""
    names = _needed_tensors(gguf, arch)
    shapes = {h: gguf.tensors[g].shape for h, g in names.items()}
    check_shapes(shapes, arch, gguf.path)
    return LazyWeights(shapes, lambda h: read_tensor(gguf, names[h], arch, native),
                       lambda h: tensor_rows(gguf, names[h], arch, native),
                       lambda h: file_rows(gguf, names[h], arch, native))


def tensor_types(gguf: GGUFFile, arch: ModelArchConfig) -> dict[str, str]:
    """HF name -> GGML type name of every weight the model needs."""
    return {h: gguf.tensors[g].ggml_type.name for h, g in _needed_tensors(gguf, arch).items()}


def _needed_tensors(gguf: GGUFFile, arch: ModelArchConfig) -> dict[str, str]:
    """HF name -> GGUF name of every weight the model needs; the first missing one is an error."""
    names = {h: g for g, h in hf_names(arch).items()}
    missing = [g for g in names.values() if g not in gguf.tensors]
    if missing:
        raise gguf.error(f"missing tensor {missing[0]}")
    return names


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order. HF's rotate-half rope pairs row i of a head with row
    i + head_dim/2; llama.cpp's rope pairs adjacent rows, so its converter interleaves the two
    halves of every head. w: (n_head * head_dim, in) or (n_head * head_dim,)."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape).contiguous())


# The vocabulary's arrays, which read_tokenizer turns into the tokenizer: the strings'
# offsets (GGUFStrings) and the scores' and types' lists, ~4 MiB for Llama 3's (128k tokens,
# 280k merges), kept as long as the file is (the weights are read from it for the whole load)
# unless load_model drops them once the tokenizer is made.
VOCABULARY_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                     "tokenizer.ggml.token_type")


def read_tokenizer(gguf: GGUFFile) -> Tokenizer:
    """The tokenizer described by the `tokenizer.*` metadata."""
    md = gguf.metadata
    model, tokens = md.get("tokenizer.ggml.model"), md.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise gguf.error("has no tokenizer.ggml.tokens vocabulary")
    n = len(tokens)
    types = md.get("tokenizer.ggml.token_type", [1] * n)
    scores = md.get("tokenizer.ggml.scores", [0.0] * n)
    for key, values in (("token_type", types), ("scores", scores)):
        if not isinstance(values, list) or len(values) != n:
            raise gguf.error(f"tokenizer.ggml.{key} has {_entries(values)} for a vocabulary of "
                             f"{n:,} tokens")
    for key in ("tokenizer.ggml.bos_token_id", *EOS_KEYS):
        value = md.get(key)
        if value is not None and not (is_count(value, 0) and value < n):
            raise gguf.error(f"{key} is {value!r}, not a token of the {n:,}-token vocabulary")
    if model not in ("gpt2", "llama"):
        raise gguf.error(f"tokenizer model {model!r} is not supported (gpt2, llama)")
    try:  # the tokenizers library raises Exception for a merge of unknown tokens
        if model == "gpt2":
            backend = byte_level_bpe(tokens, md.get("tokenizer.ggml.merges", []), types,
                                     md.get("tokenizer.ggml.pre", "default"))
        else:
            backend = sentencepiece_bpe(tokens, scores, types,
                                        md.get("tokenizer.ggml.add_space_prefix", True))
    except Exception as e:  # noqa: BLE001 (a malformed merge is a TypeError)
        raise gguf.error(f"has a vocabulary no tokenizer can be built from "
                         f"({str(e).splitlines()[0]})") from None
    add_bos_default = model == "llama"  # llama.cpp's default for sentencepiece vocabularies
    eos_ids = _eos_ids(md)
    return Tokenizer(backend, bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
                     eos_token_id=eos_ids[0] if eos_ids else None, extra_eos_ids=eos_ids[1:],
                     add_bos=md.get("tokenizer.ggml.add_bos_token", add_bos_default),
                     add_eos=md.get("tokenizer.ggml.add_eos_token", False),
                     chat_template=_template(gguf, "tokenizer.chat_template"),
                     tool_use_template=_template(gguf, "tokenizer.chat_template.tool_use"))


def _template(gguf: GGUFFile, key: str) -> str | None:
    """A chat template key (llama.cpp reads the named `.tool_use` one for requests with tools)."""
    value = gguf.metadata.get(key)
    if value is not None and not isinstance(value, str):
        raise gguf.error(f"metadata key {key} is {type(value).__name__}, not text")
    return value
