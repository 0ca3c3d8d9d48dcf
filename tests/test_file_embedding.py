"""A GGUF's untied token embedding stays in its file on a CPU (FileEmbedding over the
loader's FileRows): each lookup reads the rows it needs. Greedy output equals the resident
table's (QSERVE_EMBEDDING_IN_FILE=0) for several GGML types, the rows equal the weights, the
memory plan leaves the table out, and a file cut short under a running model fails a lookup
in one line."""
from __future__ import annotations

import json
import os
import shutil

import gguf
import pytest
import torch

from qserve import LLM, SamplingParams
from qserve.errors import ModelLoadError
from qserve.layers import FileEmbedding, QuantEmbedding
from qserve.loader import load_model
from qserve.loader.gguf_loader import GGUFFile

from test_loader import V, write_tiny_gguf, write_tiny_hf_dir

Q = gguf.GGMLQuantizationType
PROMPTS = [[0, 5, 17, 200, 31, 9], [0, 300, 301, 2, 2, 64, 65]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def run(path, monkeypatch, in_file: bool):
    """(token ids of PROMPTS' greedy runs, the engine's embedding module)."""
    monkeypatch.setenv("QSERVE_EMBEDDING_IN_FILE", "1" if in_file else "0")
    llm = LLM(str(path), kv_dtype="fp32", kv_cache_memory="8MiB", max_model_len=64)
    ids = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return ids, llm.engine.model.embed_tokens


@pytest.mark.parametrize("qtype", [None, Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.IQ4_XS])
def test_gguf_embedding_from_the_file_runs_as_the_resident_table(tmp_path, monkeypatch, qtype):
    """The tiny GGUF's untied token_embd (Q8_0, or `qtype`): greedy tokens equal, and each row
    a lookup decodes equals the loaded weights' row."""
    types = {} if qtype is None else {"token_embd.weight": qtype}
    path = write_tiny_gguf(tmp_path / "tiny.gguf", types=types)
    want, resident = run(path, monkeypatch, in_file=False)
    got, embed = run(path, monkeypatch, in_file=True)
    assert isinstance(resident, QuantEmbedding) and isinstance(embed, FileEmbedding)
    assert got == want
    table = load_model(str(path)).weights["model.embed_tokens.weight"].dequantize()
    ids = torch.tensor([[3, V - 1, 3], [0, 7, 100]])
    assert torch.equal(embed(ids), table[ids])
    with pytest.raises(IndexError, match=f"outside the embedding table's {V} rows"):
        embed(torch.tensor([V]))
    assert embed(torch.tensor([], dtype=torch.long)).shape == (0, table.shape[1])


def test_tied_embedding_stays_resident(tmp_path, monkeypatch):
    """qwen2's tiny GGUF ties the embedding to the output: the table is the output matrix."""
    _, embed = run(write_tiny_gguf(tmp_path / "tied.gguf", arch="qwen2"), monkeypatch, True)
    assert isinstance(embed, QuantEmbedding)


def test_memory_plan_leaves_the_table_in_the_file(tmp_path, monkeypatch):
    from qserve.cli import main
    from click.testing import CliRunner

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    nbytes = GGUFFile(path).tensors["token_embd.weight"].nbytes
    plans = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("QSERVE_EMBEDDING_IN_FILE", flag)
        res = CliRunner().invoke(main, ["info", str(path), "--json"])
        assert res.exit_code == 0, res.output
        plans[flag] = json.loads(res.output)["memory_plan"]
    assert plans["1"]["file_weight_bytes"] == nbytes and plans["0"]["file_weight_bytes"] == 0
    assert plans["0"]["weight_bytes"] - plans["1"]["weight_bytes"] == nbytes


def test_a_file_cut_short_fails_the_lookup_in_one_line(tmp_path, monkeypatch):
    path = shutil.copy(write_tiny_gguf(tmp_path / "tiny.gguf"), tmp_path / "cut.gguf")
    monkeypatch.setenv("QSERVE_EMBEDDING_IN_FILE", "1")
    llm = LLM(str(path), kv_dtype="fp32", kv_cache_memory="8MiB", max_model_len=64)
    info = GGUFFile(path).tensors["token_embd.weight"]
    os.truncate(path, info.offset + info.nbytes // V)  # row 0 only
    with pytest.raises(ModelLoadError) as e:
        llm.generate([[0, 5]], GREEDY)
    msg = str(e.value)
    assert "\n" not in msg and "token_embd.weight row 5 could not be read" in msg



def test_safetensors_embedding_is_left_to_its_mapping(tmp_path, monkeypatch):
    """An untied HF checkpoint: safetensors maps its tensors from the file already (rows not
    looked up take no memory), so the table is not read through FileRows, and the plan counts
    it as resident, as the engine keeps it."""
    from qserve.engine.memory_plan import embedding_in_file
    from qserve.loader import load_arch

    write_tiny_hf_dir(tmp_path, "llama", tie_word_embeddings=False)
    _, embed = run(tmp_path, monkeypatch, in_file=True)
    assert not isinstance(embed, FileEmbedding)
    assert not embedding_in_file(tmp_path, load_arch(str(tmp_path)), torch.device("cpu"))
