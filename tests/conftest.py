"""Shared fixtures: the real default model (pulled once into the repo's .cache), and a
Hugging Face transformers copy of it in fp32 as the independent reference."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hf_reference import hf_reference_dir

from qserve.chat import history_path
from qserve.config import model_home

REPO = Path(__file__).resolve().parent.parent
# Where qserve keeps things for the person running the suite, read before the suite points
# both elsewhere; tests/test_home_isolation.py fails if the suite's home is (or is in) theirs.
USER_QSERVE_HOME, USER_CHAT_HISTORY = model_home(), history_path()
# The suite's model cache, kernel builds and Hugging Face reference live in the repository's
# .cache (or $QSERVE_TEST_HOME), never in the user's $QSERVE_HOME, and so does Triton's cache;
# the chat REPL keeps no history file unless a test names one under its tmp_path.
os.environ["QSERVE_HOME"] = os.environ.get("QSERVE_TEST_HOME") or str(REPO / ".cache" / "qserve")
os.environ["QSERVE_CHAT_HISTORY"] = ""
os.environ["TRITON_HOME"] = str(REPO / ".cache")  # Triton's kernel cache: .cache/.triton
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


# The `slow` set (`pytest -m "not slow"` leaves it out): a test that uses a fixture loading the
# real default model or transformers (directly or through another fixture), and the modules
# that compare tiny random models with transformers, whatever their own marks say.
_SLOW_FIXTURES = {"default_model_path", "loaded_model", "native_model", "tokenizer", "hf_dir",
                  "hf_model", "hf_tokenizer"}
_SLOW_MODULES = {"test_families.py", "test_moe.py", "test_awq_gptq_import.py",
                 "test_vision_language.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if (_SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))
                or item.path.name in _SLOW_MODULES):
            item.add_marker(pytest.mark.slow)
