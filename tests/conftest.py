"""Shared fixtures: the real default model (pulled once into the repo's .cache), and a
Hugging Face transformers copy of it in fp32 (converted from the GGUF once, then cached as a
safetensors directory) as the independent reference."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("QSERVE_HOME", str(REPO / ".cache" / "qserve"))
torch.manual_seed(0)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """Path of the default model's GGUF, pulled into $QSERVE_HOME on first use."""
    from qserve.loader.registry import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def loaded_model(default_model_path):
    from qserve.loader import load_model

    return load_model(str(default_model_path))


@pytest.fixture(scope="session")
def tokenizer(loaded_model):
    return loaded_model.tokenizer


@pytest.fixture(scope="session")
def hf_dir(default_model_path) -> Path:
    """The default model as a Hugging Face directory (fp32 safetensors + tokenizer files),
    written by transformers from the GGUF the first time and reused afterwards."""
    out = Path(os.environ["QSERVE_HOME"]) / "hf-ref" / "smollm2-135m-instruct-fp32"
    if not (out / "config.json").exists():
        import shutil

        from tokenizers import pre_tokenizers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        kw = dict(gguf_file=default_model_path.name)
        try:  # transformers >= 5 keeps GGUF weights "quantized" unless told to dequantize
            from transformers import GgufConfig

            kw["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:
            pass
        model = AutoModelForCausalLM.from_pretrained(
            str(default_model_path.parent), dtype=torch.float32, **kw)
        kw.pop("quantization_config", None)
        tok = AutoTokenizer.from_pretrained(str(default_model_path.parent), **kw)
        # transformers does not know this GGUF's "smollm" pre-tokenizer, which splits digits
        # off one by one (as llama.cpp and the original tokenizer.json do): restore it.
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(out)
    return out


@pytest.fixture(scope="session")
def hf_model(hf_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def hf_tokenizer(hf_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_dir))
