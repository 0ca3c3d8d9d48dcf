"""SamplingParams.prompt_logprobs on the real default model in fp32: each prompt token's
logprob and the top-N at its position, against Hugging Face transformers, and the same through
chunked prefill, a warm prefix cache, n > 1, a batch with other requests, recompute
preemption, speculative decoding and the engine's "delta" outputs. (The server's echo +
logprobs: test_server.py.)"""
import pytest
import torch

from qserve import LLM, SamplingParams
from qserve.sampling_params import SamplingParamsError

pytestmark = pytest.mark.slow

TEXTS = ["The capital of France is Paris, and the capital of Germany is Berlin. Rome is the "
         "capital of Italy; Madrid is the capital of Spain, and Lisbon that of Portugal.",
         "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
         "fibonacci(n - 2)\n\nprint(fibonacci(10))",
         "Once upon a time, there was a little"]  # three blocks of 16 tokens, two, none
TOP = 5
ATOL = 1e-3  # nats: fp32 engine against fp32 transformers


@pytest.fixture(scope="module")
def llm(loaded_model):
    return LLM(loaded=loaded_model, kv_cache_memory="128MiB", max_model_len=512)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    """transformers' log-softmax at every position of each prompt, (n, vocab)."""
    with torch.no_grad():
        return [torch.log_softmax(hf_model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
                for ids in prompts]


def params(k=TOP, max_tokens=2, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=k, **kw)


def assert_matches(ids: list[int], got: list, ref: torch.Tensor, k: int = TOP):
    """got (one RequestOutput's prompt_logprobs) against ref (n, vocab) log-probs."""
    assert len(got) == len(ids) and got[0] is None
    for t in range(1, len(ids)):
        d, row = got[t], ref[t - 1]
        assert abs(d[ids[t]] - float(row[ids[t]])) < ATOL, (t, d[ids[t]], float(row[ids[t]]))
        assert len(d) in (k, k + 1) if k else len(d) == 1  # the top k, and the token's own
        kth = float(row.topk(k).values[-1]) if k else 0.0
        for i, v in d.items():
            assert abs(v - float(row[i])) < ATOL, (t, i, v, float(row[i]))
            assert i == ids[t] or v > kth - ATOL  # each listed alternative is in the top k


def test_prompt_logprobs_match_transformers(llm, prompts, reference):
    outs = llm.generate(prompts, params())
    for ids, out, ref in zip(prompts, outs, reference):
        assert out.prompt_token_ids == ids
        assert_matches(ids, out.prompt_logprobs, ref)
        assert list(out.prompt_logprobs[1])[:TOP] == ref[0].topk(TOP).indices.tolist()


def test_a_prompt_tokens_logprob_is_the_one_it_was_generated_with(llm, prompts):
    """Generated tokens appended to the prompt: their prompt logprobs (one prefill pass) are
    the logprobs they were sampled with (decode steps)."""
    made = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                logprobs=0))
    longer = [ids + m.outputs[0].token_ids for ids, m in zip(prompts, made)]
    for ids, m, out in zip(prompts, made, llm.generate(longer, params(k=0))):
        c = m.outputs[0]
        got = [d[t] for d, t in zip(out.prompt_logprobs[len(ids):], c.token_ids)]
        assert got == pytest.approx([d[t] for d, t in zip(c.logprobs, c.token_ids)], abs=ATOL)


def test_without_the_parameter_there_are_none(llm, prompts):
    out = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.prompt_logprobs is None


def test_chunked_prefill_prefix_cache_batch_and_n(loaded_model, prompts, reference):
    """Chunks of 7 tokens, a warm prefix cache (which such a request does not use, so every
    position is computed), n = 2 (the prompt runs once), and requests without the parameter in
    the same steps: the same values."""
    eng = LLM(loaded=loaded_model, kv_cache_memory="64MiB", max_model_len=512,
              max_num_batched_tokens=7, enable_prefix_caching=True)
    plain = SamplingParams(temperature=0, max_tokens=4)
    eng.generate(prompts, plain)  # the prompts' blocks are now in the prefix cache
    outs = eng.generate(prompts + prompts, [params(n=2)] * 3 + [plain] * 3)
    for ids, out, ref in zip(prompts, outs[:3], reference):
        assert out.num_cached_tokens == 0
        assert len(out.outputs) == 2
        assert_matches(ids, out.prompt_logprobs, ref)
    assert all(o.prompt_logprobs is None for o in outs[3:])
    assert sum(o.num_cached_tokens for o in outs[3:]) > 0  # the others still hit the cache


def test_recompute_preemption_records_each_token_once(loaded_model, prompts, reference):
    from qserve.engine.cache_engine import KV_STORAGE, bytes_per_block

    per_block = bytes_per_block(loaded_model.arch, 16, KV_STORAGE["fp32"])
    small = LLM(loaded=loaded_model, kv_cache_memory=6 * per_block, max_model_len=96,
                preemption_mode="recompute", watermark=0.0, max_num_batched_tokens=16)
    outs = small.generate(prompts * 2, params(max_tokens=40, ignore_eos=True))
    assert small.engine.stats()["recomputes"] > 0
    for ids, out, ref in zip(prompts * 2, outs, reference * 2):
        assert_matches(ids, out.prompt_logprobs, ref)


def test_with_speculative_decoding_they_are_the_targets(loaded_model, prompts, reference):
    """Prompt-lookup drafts verified beside the prompts' chunks: the prompt logprobs are the
    target's (a draft model's runner reports none)."""
    spec = LLM(loaded=loaded_model, kv_cache_memory="64MiB", max_model_len=512, draft="ngram",
               max_num_batched_tokens=24, spec_max_batch_size=4)
    outs = spec.generate(prompts, params(max_tokens=48, ignore_eos=True))
    assert spec.engine.stats()["spec_draft_tokens"] > 0
    for ids, out, ref in zip(prompts, outs, reference):
        assert_matches(ids, out.prompt_logprobs, ref)


def test_top_zero_gives_the_tokens_own_logprob_only(llm, prompts, reference):
    out = llm.generate(prompts[:1], params(k=0))[0]
    assert all(len(d) == 1 for d in out.prompt_logprobs[1:])
    assert_matches(prompts[0], out.prompt_logprobs, reference[0], k=0)


def test_delta_outputs_carry_them_once(llm, prompts, reference):
    eng = llm.engine
    eng.add_request("delta", prompt_token_ids=prompts[0],
                    params=params(max_tokens=5, ignore_eos=True, output_kind="delta"))
    seen = []
    while eng.has_unfinished_requests():
        seen += [o.prompt_logprobs for o in eng.step() if o.request_id == "delta"]
    carried = [p for p in seen if p is not None]
    assert len(seen) == 5 and len(carried) == 1
    assert_matches(prompts[0], carried[0], reference[0])


@pytest.mark.parametrize("bad", [-1, 21, 100])
def test_out_of_range_is_refused(bad):
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
