"""The default model as Hugging Face transformers sees it: converted from the GGUF to an fp32
safetensors directory once (about 30 s), then reused. Shared by the tests and the benchmarks."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch


def hf_reference_dir(gguf_path: Path) -> Path:
    out = Path(os.environ["QSERVE_HOME"]) / "hf-ref" / (gguf_path.stem + "-fp32")
    if (out / "config.json").exists():
        return out
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    kw = dict(gguf_file=gguf_path.name)
    try:  # transformers >= 5 keeps GGUF weights "quantized" unless told to dequantize
        from transformers import GgufConfig

        kw["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kw)
    kw.pop("quantization_config", None)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
    # transformers does not know this GGUF's "smollm" pre-tokenizer, which splits digits off
    # one by one (as llama.cpp and the original tokenizer.json do): restore it.
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def assert_layout_comes_from_the_model(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """For each tiny checkpoint transformers wrote: the tensors it saved are exactly the ones
    the meta-built model asks for (as the model reads them: gpt-oss's stacked experts split up
    by its family, tests/test_gpt_oss.py), the parameter count is theirs, and a qserve
    checkpoint's config.json reads back the same arch (tests/test_families.py,
    tests/test_moe.py)."""
    import json

    from safetensors import safe_open

    from qserve.loader import load_arch
    from qserve.loader.checkpoint import hf_config
    from qserve.loader.hf_loader import expected_shapes, tensor_index
    from qserve.models.registry import num_params

    for name, path in checkpoints.items():
        arch = load_arch(path)
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert expected_shapes(arch) == tensor_index(path)[0], name
        assert num_params(arch) == sum(torch.Size(s).numel() for s in saved.values()), name
        (tmp_path / "config.json").write_text(json.dumps(hf_config(arch)))
        assert load_arch(tmp_path) == arch, name
