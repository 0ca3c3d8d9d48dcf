"""`qserve quantize SRC -o OUT.gguf --format gguf`: the quantized model as a GGUF llama.cpp runs.

Only layouts GGML has exactly are written, so the file holds the very weights qserve runs:

    qserve int4 g32 asym   w = q * s + offset   -> Q4_1  d = s, m = offset
    qserve int4 g32 sym    w = (q - 8) * s      -> Q4_0  d = s
    qserve int8 g32 sym    w = q * s            -> Q8_0  d = s
    dense 2-D tensors (embedding, kept linears) -> F16 (F32 when stored so); norms, biases F32

Any other scheme (groups of 64/128, per-channel int8, a padded last group) is refused before
any work, naming the layer and the recipes that export losslessly. Tensor names and metadata
follow llama.cpp's convert_hf_to_gguf.py for each family:

    llama, mistral, mixtral -> llama    q/k rows interleaved for its rope; Mixtral's experts
    qwen2, qwen3            -> as named     stacked into 3-D ffn_{gate,up,down}_exps, expert
    qwen3_moe               -> qwen3moe     e the e-th (out, in) matrix, in its own GGML type
    phi3                    -> phi3     fused attn_qkv / ffn_up; longrope as rope_factors_*
    gemma2, gemma3_text     -> gemma2, gemma3   norms stored as 1 + w; soft-caps, windows
    smollm3, granite        -> as named     q/k interleaved as llama's; every fourth layer
                                            without rope, Granite's four scales

What llama.cpp would run differently is refused, in one line: a Gemma query_pre_attn_scalar
other than the one it derives, Gemma 2 without a window, Gemma 3 attention soft-capping,
Qwen3-MoE weights that are not renormalized over the chosen experts, a rope scaling the
format has no keys for. (Phi-3's window and longrope are written as the converter writes
them, though llama.cpp ignores the window and picks longrope's factors by context size.)
The tokenizer is copied from a GGUF source, or built from a Hugging Face directory's
tokenizer files (_tokenizer).

The `gguf` package (GGUFWriter) is imported only here, when an export runs.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from qserve.errors import QServeError
from qserve.formats import QuantizedTensor, ggml, unpack_int4
from qserve.models.registry import gguf_architecture, model_class

# The llama.cpp architectures written (a family's is models/registry.py gguf_architecture),
# with the rope scalings llama.cpp reads for each
ROPE_SCALINGS = {"llama": ("default", "linear", "llama3"), "qwen2": ("default", "linear"),
                 "qwen3": ("default", "linear"), "qwen3moe": ("default", "linear"),
                 "phi3": ("default", "longrope"), "gemma2": ("default",),
                 "gemma3": ("default", "linear"), "smollm3": ("default",),
                 "granite": ("default", "linear")}
# qserve's pooling names -> llama.cpp's enum llama_pooling_type (gguf_loader reads it back)
POOLING_TYPES = {"mean": 1, "cls": 2, "last": 3}
LOSSLESS = {(4, False): "Q4_1", (4, True): "Q4_0", (8, True): "Q8_0"}  # (bits, sym), groups of 32
LOSSLESS_RECIPES = ("w4g32 (int4 g32 asym -> Q4_1), int4 g32 symmetric (-> Q4_0), int8 with "
                    "group_size 32 (-> Q8_0), gguf-native from a GGUF (every quantized "
                    "type's blocks as stored)")


def check_plans(arch, plans) -> None:
    """Raise QServeError unless every planned layer has an exact GGML type and llama.cpp
    reads the architecture as qserve runs it."""
    name = gguf_architecture(arch.architecture)
    if name not in ROPE_SCALINGS:
        raise QServeError(f"GGUF export writes {', '.join(ROPE_SCALINGS)} models, not "
                          f"{arch.architecture!r} (llama.cpp's {name!r})")
    problem = _unexpressed(arch)
    if problem:
        raise QServeError(f"GGUF export: {problem}, which llama.cpp would run differently; "
                          f"this model is not exported")
    for p in plans:
        if p.scheme is None:
            continue
        if ((p.scheme.bits, p.scheme.sym) not in LOSSLESS or p.group_size != 32
                or p.shape[1] % 32 or p.format == "int4z"):  # Q4_1: -z s in fp16, inexact
            raise QServeError(f"{p.name} would be {p.describe()}, which no GGUF type holds "
                              f"exactly; GGUF export takes {LOSSLESS_RECIPES}")


def _unexpressed(arch) -> str | None:
    """What of `arch` a GGUF of its llama.cpp architecture cannot say (None: nothing)."""
    name = gguf_architecture(arch.architecture)
    if not arch.generates:  # a GGUF without output.weight is a tied model that generates
        return "a backbone without its output layer (an embedding model)"
    if arch.attn_temperature_beta is not None:  # llama.cpp's mistral3 has it; not written
        return "an attention temperature (Ministral 3's)"
    kind = (arch.rope_scaling or {}).get("rope_type", "default")
    if kind not in ROPE_SCALINGS[name]:
        return (f"rope scaling {kind!r} on {name} (written: "
                f"{', '.join(ROPE_SCALINGS[name])})")
    if name.startswith("gemma"):
        # llama.cpp scales scores by hidden / heads at the 27B's depth, else by head_dim
        big = arch.num_layers == model_class(arch.architecture).gguf_27b_layers
        derived = arch.hidden_size // arch.num_heads if big else arch.head_dim
        if arch.query_pre_attn_scalar not in (None, derived):
            return (f"query_pre_attn_scalar {arch.query_pre_attn_scalar:g} (llama.cpp takes "
                    f"{derived} for this shape)")
        if name == "gemma2" and not arch.sliding_window:
            return "Gemma 2 without a sliding window (llama.cpp then slides 4096)"
        if name == "gemma3" and arch.attn_logit_softcapping:
            return "Gemma 3 with attention soft-capping"
    if arch.nope_layers is not None and (name != "smollm3" or arch.nope_layers != [
            i for i in range(arch.num_layers) if (i + 1) % 4 == 0]):
        return "layers without rope other than every fourth (llama.cpp's fixed SmolLM3 step)"
    if name == "granite" and arch.head_dim != arch.hidden_size // arch.num_heads:
        return f"head_dim {arch.head_dim} (llama.cpp's Granite takes hidden / heads)"
    if name == "qwen3moe" and not arch.norm_topk_prob:
        return "norm_topk_prob false (llama.cpp always renormalizes the chosen experts)"
    return None


def check_replaceable(out: Path, src: Path) -> None:
    """Raise unless `--force` may replace `out`: a GGUF file that is not the source."""
    if out.resolve() == src.resolve():
        raise QServeError(f"{out} is the source model; write the export somewhere else")
    magic = b""
    if out.is_file():
        with open(out, "rb") as f:
            magic = f.read(4)
    if magic != b"GGUF":
        raise QServeError(f"{out} exists and is not a GGUF file; --force only replaces a "
                          f"GGUF. Remove it yourself or choose another path")


def ggml_blocks(qt: QuantizedTensor) -> tuple[np.ndarray, str]:
    """An int4/int8 g32 QuantizedTensor -> ((out, in / 32 * block_bytes) uint8 rows, type name):
    the inverse of formats/ggml.repack, so codes, scales and offsets are the tensor's own."""
    out, n_in = qt.shape
    key = (qt.bits, qt.offsets is None)
    assert qt.group_size == 32 and n_in == qt.padded_in and key in LOSSLESS, (qt.format, key)
    fp16 = lambda t: t.contiguous().view(torch.uint8).view(out, -1, 2)  # noqa: E731  (out, G, 2)
    head = [fp16(qt.scales)] + ([] if qt.offsets is None else [fp16(qt.offsets)])
    if qt.bits == 8:
        body = qt.qweight.view(torch.uint8).view(out, -1, 32)
    else:  # a GGML Q4 block's byte j holds input j (low nibble) and j + 16 (high)
        q = unpack_int4(qt.qweight).view(out, -1, 32)
        body = q[..., :16] | (q[..., 16:] << 4)
    rows = torch.cat(head + [body], dim=-1).reshape(out, -1)
    return rows.numpy(), LOSSLESS[key]


def permute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order llama.cpp keeps q/k in for llama (convert_hf_to_gguf's permute): within each
    head the halves of HF's rotate-half layout interleave. (n_rows,) indices into HF rows."""
    idx = torch.arange(n_rows)
    return idx.reshape(n_head, 2, n_rows // n_head // 2).transpose(1, 2).reshape(-1)


def _stacks(names: dict[str, str]) -> dict[str, list[str]]:
    """GGUF name -> the HF tensors it holds: one, or a mixture's experts in order (hf_names
    lists expert e as `<stacked name>[e]`)."""
    out: dict[str, list[str]] = {}
    for g_name, hf in names.items():
        out.setdefault(g_name.partition("[")[0], []).append(hf)
    return out


def _tensor(w, n_head: int | None) -> tuple[np.ndarray, str | None]:
    """One HF-named tensor as GGUF stores it: (ggml blocks, their type name) for an int4/int8
    g32 QuantizedTensor, else (values, None), F32 for 1-D and fp32 tensors, F16 otherwise;
    rows permuted for llama's rope when n_head is given."""
    if isinstance(w, QuantizedTensor):
        if n_head is not None:
            w = w.rows(permute_rows(w.shape[0], n_head))
        if w.format in ("int4", "int8"):
            return ggml_blocks(w)
        if w.format in ggml.IN_PLACE:  # its GGML blocks, as the source file held them
            return w.qweight.contiguous().numpy(), w.format.upper()
        w = w.dequantize()
    elif n_head is not None:
        w = w[permute_rows(w.shape[0], n_head)]
    w = w.float() if w.dim() == 1 or w.dtype == torch.float32 else w.half()
    return w.contiguous().numpy(), None


def export(out: Path, loaded, tensors: dict, plans, atomic_dir=None) -> None:
    """Write the GGUF `out` (atomically: a sibling temporary file renamed into place; one
    file, so quantize's atomic_dir is not needed)."""
    import gguf

    from qserve.loader.gguf_loader import hf_names, llama3_rope_divisors, unpermute_rows

    arch = loaded.arch
    name = gguf_architecture(arch.architecture)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), name)
    try:
        _metadata(writer, arch, name, plans, loaded.path)
        if loaded.pooling in POOLING_TYPES:  # an embedding model's, as llama.cpp's converter
            writer.add_pooling_type(gguf.PoolingType(POOLING_TYPES[loaded.pooling]))
        _tokenizer(writer, loaded, name)
        if (arch.rope_scaling or {}).get("rope_type") == "llama3":  # as the converter bakes it
            divisors = llama3_rope_divisors(arch.rope_scaling, arch.rope_theta, arch.head_dim)
            writer.add_tensor("rope_freqs.weight", divisors.float().numpy())
        if (arch.rope_scaling or {}).get("rope_type") == "longrope":  # Phi-3, per frequency
            for which in ("long", "short"):
                factors = torch.tensor(arch.rope_scaling[f"{which}_factor"], dtype=torch.float32)
                writer.add_tensor(f"rope_factors_{which}.weight", factors.numpy())
        offset = model_class(arch.architecture).gguf_norm_offset
        for g_name, hfs in _stacks(hf_names(arch)).items():
            parts = [_tensor(tensors[hf], unpermute_rows(g_name, arch)) for hf in hfs]
            if g_name.endswith("norm.weight") and offset:  # llama.cpp multiplies by 1 + w
                parts = [(w + offset, dtype) for w, dtype in parts]
            data, dtype = parts[0]
            if len(parts) > 1:  # experts: (E, out, row) bytes or (E, out, in) values
                if any(d != dtype for _, d in parts):
                    raise QServeError(f"GGUF export: {g_name} stacks experts of different "
                                      f"types ({', '.join(sorted({str(d) for _, d in parts}))}"
                                      f"); quantize every expert alike")
                data = np.stack([w for w, _ in parts])
            raw = None if dtype is None else gguf.GGMLQuantizationType[dtype]
            writer.add_tensor(g_name, data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    except BaseException as e:
        writer.close()
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise QServeError(f"cannot write {out}: {e.strerror or e}") from None
        raise


def _metadata(writer, arch, name: str, plans, source: Path) -> None:
    """The hyperparameters convert_hf_to_gguf.py writes for these architectures."""
    import gguf

    writer.add_name(source.stem if source.is_file() else source.name)
    types = [p.format.upper() if p.scheme is None else LOSSLESS[(p.scheme.bits, p.scheme.sym)]
             for p in plans if p.packed]
    if types:  # the type most linears have, as llama-quantize labels a file (Q4_K: Q4_K_M)
        top, known = max(set(types), key=types.count), gguf.LlamaFileType.__members__
        file_type = known.get(f"MOSTLY_{top}", known.get(f"MOSTLY_{top}_M"))
        if file_type is not None:
            writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(arch.max_position_embeddings)
    writer.add_embedding_length(arch.hidden_size)
    writer.add_block_count(arch.num_layers)
    writer.add_feed_forward_length(arch.intermediate_size)
    writer.add_head_count(arch.num_heads)
    writer.add_head_count_kv(arch.num_kv_heads)
    writer.add_rope_freq_base(arch.rope_theta)
    writer.add_layer_norm_rms_eps(arch.rms_norm_eps)
    writer.add_vocab_size(arch.vocab_size)
    rot = int(arch.head_dim * arch.partial_rotary_factor)
    if name in ("llama", "phi3", "granite") or rot != arch.head_dim:
        writer.add_rope_dimension_count(rot)
    if arch.head_dim != arch.hidden_size // arch.num_heads or name.startswith("gemma"):
        writer.add_key_length(arch.head_dim)
        writer.add_value_length(arch.head_dim)
    scaling = arch.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    if scaling.get("rope_type") == "longrope":  # the factors are tensors (export)
        from qserve.models.rope import attention_factor

        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        writer.add_rope_scaling_attn_factors(attention_factor(scaling))
    if name == "phi3":  # 0: none (the converter's way of marking Phi-4)
        writer.add_sliding_window(arch.sliding_window or 0)
    if name.startswith("gemma"):
        _gemma_metadata(writer, arch, name)
    if name == "granite":  # the converter's names for its four multipliers
        writer.add_attention_scale((arch.query_pre_attn_scalar or arch.head_dim) ** -0.5)
        writer.add_embedding_scale(arch.embedding_multiplier)
        writer.add_residual_scale(arch.residual_multiplier)
        writer.add_logit_scale(arch.logits_scaling)
    if arch.num_experts:
        writer.add_expert_count(arch.num_experts)
        writer.add_expert_used_count(arch.num_experts_per_tok)
        if name == "qwen3moe":
            writer.add_expert_feed_forward_length(arch.moe_intermediate_size)


def _gemma_metadata(writer, arch, name: str) -> None:
    """Soft-caps, the window, which layers slide (only where they differ from llama.cpp's
    fixed pattern for the architecture) and Gemma 3's local rope base."""
    if arch.attn_logit_softcapping:
        writer.add_attn_logit_softcapping(arch.attn_logit_softcapping)
    if arch.final_logit_softcapping:
        writer.add_final_logit_softcapping(arch.final_logit_softcapping)
    if arch.sliding_window:
        writer.add_sliding_window(arch.sliding_window)
        n = model_class(arch.architecture).sliding_window_pattern
        default = ["full_attention" if (i + 1) % n == 0 else "sliding_attention"
                   for i in range(arch.num_layers)]
        layers = arch.layer_types or ["sliding_attention"] * arch.num_layers
        if layers != default:
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in layers])
    if name == "gemma3" and arch.rope_local_theta is not None:
        writer.add_rope_freq_base_swa(arch.rope_local_theta)


def _tokenizer(writer, loaded, name: str) -> None:
    """From a GGUF source: its `tokenizer.*` keys as they are. From a Hugging Face directory
    (or a qserve checkpoint): tokenizer.json (byte-level BPE) or tokenizer.model
    (sentencepiece) through the gguf package's vocab readers, as the converter's fallbacks do,
    else a sentencepiece-style ("▁", byte fallback) tokenizer.json, which is what a qserve
    checkpoint keeps of a sentencepiece model (_SentencePieceJson)."""
    import gguf

    path = Path(loaded.path)
    if path.is_file():
        reader = gguf.GGUFReader(str(path))
        for key, field in reader.fields.items():
            if key.startswith("tokenizer."):
                sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(key, field.contents(), field.types[0], sub)
        return
    vocab = None
    for cls in (gguf.vocab.BpeVocab, gguf.vocab.SentencePieceVocab, _SentencePieceJson):
        try:
            vocab = cls(path)
            break
        except (FileNotFoundError, ValueError, KeyError):
            continue
    if vocab is None:
        raise QServeError(f"GGUF export: {path} has no byte-level BPE or sentencepiece-style "
                          f"tokenizer.json, nor a sentencepiece tokenizer.model, to write")
    tokens, scores, types = [], [], []
    for text, score, kind in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(kind)
    pad = loaded.arch.vocab_size - len(tokens)  # embedding rows past the vocabulary
    for i in range(max(pad, 0)):
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model(vocab.tokenizer_model)
    if vocab.tokenizer_model == "gpt2":
        writer.add_tokenizer_pre("default")  # the converter's hash table of pre-tokenizers is
        # not reproduced: llama.cpp then splits with its default GPT-2 regex
    if isinstance(vocab, _SentencePieceJson):
        writer.add_add_space_prefix(vocab.add_space_prefix)
    elif vocab.tokenizer_model == "llama" and name.startswith("gemma"):
        writer.add_add_space_prefix(False)  # as the converter marks Gemma's vocabulary
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(path, load_merges=vocab.tokenizer_model == "gpt2",
                                n_vocab=len(tokens))
    # whether BOS / EOS are added as the source's tokenizer adds them, not as a config file or
    # llama.cpp's default for the vocabulary type guesses
    tok = loaded.tokenizer
    plain, full = tok.encode("a", add_special_tokens=False), tok.encode("a")
    special.add_special_token["bos"] = full[:1] == [tok.bos_token_id] != plain[:1]
    special.add_special_token["eos"] = full[-1:] == [tok.eos_token_id] != plain[-1:]
    special.add_to_gguf(writer)


class _SentencePieceJson:
    """A sentencepiece-style BPE tokenizer.json ("▁" for spaces, <0xNN> byte tokens) as
    llama.cpp's "llama" vocabulary, which merges the adjacent pair whose union scores highest:
    a token's score is minus the rank of the first merge that makes it, so the merge order is
    the file's. Token types: added special tokens CONTROL (the unk token UNKNOWN), other added
    tokens USER_DEFINED, <0xNN> BYTE, the rest NORMAL."""

    tokenizer_model = "llama"

    def __init__(self, path: Path):
        import json

        import gguf

        with open(path / "tokenizer.json", encoding="utf-8") as f:  # FileNotFoundError: none
            tj = json.load(f)
        model = tj["model"]
        steps = json.dumps([tj.get(k) for k in ("normalizer", "pre_tokenizer", "decoder")],
                           ensure_ascii=False)
        if model["type"] != "BPE" or "▁" not in steps:
            raise ValueError("not a sentencepiece-style BPE tokenizer.json")
        vocab: dict[str, int] = dict(model["vocab"])
        added = {t["content"]: t for t in tj.get("added_tokens", [])}
        vocab |= {c: t["id"] for c, t in added.items()}
        if sorted(vocab.values()) != list(range(len(vocab))):
            raise ValueError("tokenizer.json's ids are not 0..n-1")
        merges = [m.split(" ", 1) if isinstance(m, str) else m for m in model.get("merges", [])]
        rank: dict[str, int] = {}
        for r, (left, right) in enumerate(merges):
            rank.setdefault(left + right, r)
        T = gguf.TokenType
        self._tokens = []
        for text, i in sorted(vocab.items(), key=lambda kv: kv[1]):
            if text in added:
                kind = (T.UNKNOWN if text == model.get("unk_token") else
                        T.CONTROL if added[text].get("special") else T.USER_DEFINED)
            elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                kind = T.BYTE
            else:
                kind = T.NORMAL
            self._tokens.append((text.encode("utf-8"), -float(rank.get(text, len(merges))),
                                 kind))
        # a leading "▁" before the text, as sentencepiece's add_dummy_prefix
        self.add_space_prefix = any(
            step.get("type") == "Prepend" or (step.get("type") == "Metaspace" and step.get(
                "prepend_scheme", "always") != "never" and step.get("add_prefix_space", True))
            for part in (tj.get("normalizer"), tj.get("pre_tokenizer")) if part
            for step in part.get("normalizers", part.get("pretokenizers", [part])))

    def all_tokens(self):
        return iter(self._tokens)
