"""Embeddings (PoolingParams, LLM.embed) on the real default model in fp32, against Hugging
Face transformers' final hidden states (after the final norm): last-token, mean and first-token
pooling, `dimensions`, `normalize`; the same vectors through chunked prefill, a warm prefix
cache, a batch shared with generation requests, recompute preemption and an engine with
speculative decoding; the pooling a model declares (sentence-transformers' modules.json, a
GGUF's pooling_type); refusals. (The server's /v1/embeddings: test_server.py.)"""
import json
import shutil

import pytest
import torch

from qserve import LLM, PoolingParams, SamplingParams
from qserve.errors import ModelLoadError, QServeError
from qserve.sampling_params import SamplingParamsError
# the same three prompts (three blocks of 16 tokens, two, none) and fp32 engine
from test_prompt_logprobs import TEXTS, llm, prompts  # noqa: F401
import test_families as families
from test_families import tokenizer_model  # noqa: F401

pytestmark = pytest.mark.slow

# fp32 engine against fp32 transformers: summation order alone (~1e-6 on unit vectors)
ATOL = 1e-4


@pytest.fixture(scope="module")
def hidden(hf_model, prompts):
    """transformers' final hidden states of each prompt (after the final norm), (n, hidden)."""
    with torch.no_grad():
        return [hf_model.model(input_ids=torch.tensor([ids])).last_hidden_state[0].float()
                for ids in prompts]


def pooled(h: torch.Tensor, kind: str, dims: int | None = None, normalize: bool = True):
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[kind][:dims]
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


def assert_vectors(outs, hidden, kind: str, dims: int | None = None, normalize: bool = True):
    for out, h in zip(outs, hidden):
        assert out.finished and out.outputs == []
        got, want = torch.tensor(out.embedding), pooled(h, kind, dims, normalize)
        assert got.shape == want.shape
        scale = 1.0 if normalize else float(want.abs().max())
        assert torch.allclose(got, want, atol=ATOL * scale, rtol=0), (
            kind, float((got - want).abs().max()))


def run(engine) -> dict:
    """Step an LLMEngine until its requests finish: request id -> finished output."""
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
    return finished


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_pooled_hidden_states_match_transformers(llm, prompts, hidden, kind):
    outs = llm.embed(prompts, PoolingParams(pooling=kind))
    assert_vectors(outs, hidden, kind)
    assert all(abs(sum(x * x for x in o.embedding) - 1) < 1e-5 for o in outs)


def test_default_is_the_last_token_normalized(llm, prompts, hidden):
    """A model that declares no pooling is pooled as decoder embedding models are trained."""
    assert llm.engine.pooling is None
    assert_vectors(llm.embed(prompts), hidden, "last")
    [one] = llm.embed(TEXTS[0])  # a string is tokenized as generate() does
    assert_vectors([one], hidden[:1], "last")


def test_dimensions_and_normalize(llm, prompts, hidden):
    """dimensions keeps the first values (Matryoshka), then normalizes what is kept."""
    assert_vectors(llm.embed(prompts, PoolingParams(pooling="mean", dimensions=64)), hidden,
                   "mean", dims=64)
    assert_vectors(llm.embed(prompts, PoolingParams(pooling="last", normalize=False)), hidden,
                   "last", normalize=False)


def test_chunked_prefill_prefix_cache_and_a_shared_batch(loaded_model, prompts, hidden):
    """Chunks of 7 tokens, a warm prefix cache, generation requests in the same steps: the
    same vectors. Last-token pooling takes cached prefix blocks (the last token always runs);
    mean and first-token pooling run every position."""
    eng = LLM(loaded=loaded_model, kv_cache_memory="64MiB", max_model_len=512,
              max_num_batched_tokens=7, enable_prefix_caching=True)
    plain = SamplingParams(temperature=0, max_tokens=4)
    eng.generate(prompts, plain)  # the prompts' blocks are now in the prefix cache
    engine = eng.engine
    for kind in ("last", "mean", "cls"):
        ids = [f"{kind}-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, None, PoolingParams(pooling=kind), prompt_token_ids=p)
            engine.add_request(rid + "-gen", None, plain, prompt_token_ids=p)
        finished = run(engine)
        embedded = [finished[rid] for rid in ids]
        assert_vectors(embedded, hidden, kind)
        assert all(len(finished[rid + "-gen"].outputs[0].token_ids) == 4 for rid in ids)
        cached = sum(o.num_cached_tokens for o in embedded)
        assert cached > 0 if kind == "last" else cached == 0


def test_recompute_preemption_pools_each_position_once(loaded_model, prompts, hidden):
    from qserve.engine.cache_engine import KV_STORAGE, bytes_per_block

    per_block = bytes_per_block(loaded_model.arch, 16, KV_STORAGE["fp32"])
    small = LLM(loaded=loaded_model, kv_cache_memory=6 * per_block, max_model_len=96,
                preemption_mode="recompute", watermark=0.0, max_num_batched_tokens=16,
                enable_prefix_caching=False)
    eng = small.engine
    for i, p in enumerate(prompts * 2):
        eng.add_request(f"gen-{i}", None, SamplingParams(temperature=0, max_tokens=40,
                                                        ignore_eos=True), prompt_token_ids=p)
        eng.add_request(f"emb-{i}", None, PoolingParams(pooling="mean"), prompt_token_ids=p)
    finished = run(eng)
    assert eng.stats()["recomputes"] > 0
    assert_vectors([finished[f"emb-{i}"] for i in range(6)], hidden * 2, "mean")


@pytest.mark.parametrize("draft", ["ngram", "self:w8"])
def test_beside_speculative_decoding(loaded_model, prompts, hidden, draft):
    """Embedding requests in the batches of generations that speculate (prompt lookup, or a
    draft model with its own runner and cache): the same vectors, the drafts still verified."""
    spec = LLM(loaded=loaded_model, kv_cache_memory="64MiB", max_model_len=512, draft=draft,
               max_num_batched_tokens=24, spec_max_batch_size=8)
    eng = spec.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"gen-{i}", None, SamplingParams(temperature=0, max_tokens=48,
                                                        ignore_eos=True), prompt_token_ids=p)
        eng.add_request(f"emb-{i}", None, PoolingParams(pooling="mean"), prompt_token_ids=p)
    finished = run(eng)
    assert eng.stats()["spec_draft_tokens"] > 0
    assert_vectors([finished[f"emb-{i}"] for i in range(3)], hidden, "mean")


def test_refusals(llm, prompts):
    for bad in (dict(pooling="max"), dict(dimensions=0), dict(dimensions=True),
                dict(normalize="yes")):
        with pytest.raises(SamplingParamsError):
            PoolingParams(**bad)
    with pytest.raises(QServeError, match=r"^dimensions=577 is more than the model's 576$"):
        llm.embed(prompts, PoolingParams(dimensions=577))
    with pytest.raises(QServeError, match=r"the prompt has 600 tokens but --max-model-len "
                                          r"is 512"):
        llm.embed([[1] * 600])
    assert not llm.engine.has_unfinished_requests()


# ---- the pooling a model declares ---------------------------------------------------------

def test_sentence_transformers_pooling_is_the_default(hf_dir, tmp_path, prompts, hidden):
    """sentence-transformers' modules.json names a Pooling module whose config says how the
    model was trained to pool; a mode qserve does not pool by is refused unless the request
    names another."""
    path = tmp_path / "st"
    shutil.copytree(hf_dir, path)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 576, "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    st = LLM(str(path), kv_cache_memory="32MiB", max_model_len=256)
    assert st.engine.pooling == "mean"
    assert_vectors(st.embed(prompts), hidden, "mean")
    from click.testing import CliRunner

    from qserve.cli import main

    info = CliRunner().invoke(main, ["info", str(path), "--json"])
    assert json.loads(info.output)["pooling"] == "mean", info.output
    # a quantized copy and a GGUF export keep it (qserve's quantization_config, the GGUF's
    # pooling_type as llama.cpp's converter writes it)
    from qserve.loader import load_model
    from qserve.quant.quantize import quantize

    quantize(str(path), tmp_path / "w8", recipe="w8")
    quantize(str(path), tmp_path / "m.gguf", recipe="w4g32", fmt="gguf")
    assert load_model(tmp_path / "w8").pooling == load_model(tmp_path / "m.gguf").pooling == "mean"
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True}))
    st = LLM(str(path), kv_cache_memory="32MiB", max_model_len=256)
    with pytest.raises(QServeError, match=r"^this model pools its embeddings by 'max', which "
                                          r"qserve does not; ask for one of last, mean, cls$"):
        st.embed(prompts)
    assert_vectors(st.embed(prompts, PoolingParams(pooling="last")), hidden, "last")


@pytest.mark.parametrize("value, pooling", [(0, None), (1, "mean"), (2, "cls"), (3, "last"),
                                            (4, "rank")])
def test_gguf_pooling_type(tmp_path, value, pooling):
    from test_loader import write_tiny_gguf

    from qserve.loader import load_model

    path = write_tiny_gguf(tmp_path / "m.gguf", extra_kv={"llama.pooling_type": value})
    assert load_model(path).pooling == pooling


def test_gguf_pooling_type_out_of_range_is_one_line(tmp_path):
    from test_loader import write_tiny_gguf

    from qserve.loader import load_model

    path = write_tiny_gguf(tmp_path / "m.gguf", extra_kv={"llama.pooling_type": 9})
    with pytest.raises(ModelLoadError, match=r"m\.gguf: metadata key llama\.pooling_type is 9; "
                                             r"llama\.cpp's types are 0-4$"):
        load_model(path)


# ---- a backbone saved alone (sentence-transformers' Qwen3-Embedding) -----------------------

@pytest.fixture(scope="module")
def backbones(tokenizer_model, tmp_path_factory):  # noqa: F811
    """tied -> a tiny random Qwen3 saved as transformers' Qwen3Model (AutoModel): tensors
    named without "model.", no lm_head, as Qwen3-Embedding ships (its 0.6B says tied, its
    4B and 8B untied)."""
    from transformers import Qwen3Config

    root = tmp_path_factory.mktemp("backbones")
    return {tied: families.write_checkpoint(
        Qwen3Config(**families.COMMON, vocab_size=320, num_hidden_layers=2, head_dim=32,
                    tie_word_embeddings=tied), root / f"tied-{tied}", tokenizer_model,
        auto="AutoModel") for tied in (False, True)}


@torch.no_grad()
def backbone_hidden(path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return model(input_ids=torch.tensor([ids])).last_hidden_state[0].float()


@pytest.mark.parametrize("tied", [False, True])
def test_a_backbone_saved_alone_embeds_as_transformers(backbones, tied):
    """Its names gain the "model." prefix; without the output layer its config names (the
    untied case) it embeds and refuses to generate, in one line."""
    from safetensors import safe_open

    path = backbones[tied]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" in f.keys() and not any("lm_head" in k for k in f.keys())
    ids = list(families.prompt())
    h = backbone_hidden(path, ids)
    llm = LLM(str(path), kv_cache_memory="16MiB", max_model_len=256)
    assert llm.engine.arch.generates is tied
    for kind in ("last", "mean"):
        assert_vectors(llm.embed([ids], PoolingParams(pooling=kind)), [h], kind)
    if tied:  # the tied table is the model's own output layer
        assert len(llm.generate([ids], SamplingParams(max_tokens=3, ignore_eos=True))[0]
                   .outputs[0].token_ids) == 3
    else:
        with pytest.raises(QServeError, match=r"^this model was saved without its output layer "
                                              r"\(an embedding model\): it serves embeddings"):
            llm.generate([ids])


def test_a_quantized_backbone_stays_one(backbones, tmp_path):
    """`qserve quantize` keeps a backbone without its output layer so (its checkpoint reads
    back untied, without lm_head); a GGUF would read back as a tied model that generates,
    so that export is refused."""
    from click.testing import CliRunner

    from qserve.cli import main
    from qserve.quant.quantize import quantize

    src, out = backbones[False], tmp_path / "w8"
    quantize(str(src), out, recipe="w8")
    ids = list(families.prompt())
    llm = LLM(str(out), kv_cache_memory="16MiB", max_model_len=256)
    assert not llm.engine.arch.generates
    [got] = llm.embed([ids])
    want = pooled(backbone_hidden(src, ids), "last")
    assert float(torch.tensor(got.embedding) @ want) > 0.999  # int8 weights: cosine
    info = json.loads(CliRunner().invoke(main, ["info", str(out), "--json"]).output)
    assert info["generates"] is False
    with pytest.raises(QServeError, match=r"GGUF export: a backbone without its output layer "
                                          r"\(an embedding model\)"):
        quantize(str(src), tmp_path / "x.gguf", recipe="w4g32", fmt="gguf")
    assert not (tmp_path / "x.gguf").exists()
