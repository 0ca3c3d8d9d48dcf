"""Shared fixtures: the real default model (pulled once into the repo's .cache), and a
Hugging Face transformers copy of it in fp32 as the independent reference."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hf_reference import hf_reference_dir

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
    """The default model with every weight dequantized to fp32 (held in memory), the
    precision of the Hugging Face reference; `native_model` keeps the file's Q4_1/Q8_0."""
    from qserve.loader import load_model

    loaded = load_model(str(default_model_path), native=False)
    loaded.weights = dict(loaded.weights)  # read once, shared by the session's engines
    return loaded


@pytest.fixture(scope="session")
def native_model(default_model_path):
    from qserve.loader import load_model

    loaded = load_model(str(default_model_path))
    loaded.weights = dict(loaded.weights)
    return loaded


@pytest.fixture(scope="session")
def tokenizer(loaded_model):
    return loaded_model.tokenizer


@pytest.fixture(scope="session")
def hf_dir(default_model_path) -> Path:
    """The default model as a Hugging Face directory (fp32 safetensors + tokenizer files)."""
    return hf_reference_dir(default_model_path)


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
