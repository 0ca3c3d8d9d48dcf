"""Speculative decoding on tiny random checkpoints (64-token vocabulary, two layers), fast on a
CPU: greedy output equals the target's alone for every draft kind, batched; sampled tokens
follow the target's distribution (chi-square); rollback leaks no blocks; stops inside an
accepted run; a draft with another vocabulary is refused."""
import json
import math
import random
import shutil

import pytest
import torch

from qserve import LLM, SamplingParams
from qserve.config import engine_config
from qserve.engine.proposer import ngram_lookup
from qserve.engine.spec_decode import rejection_sample
from qserve.errors import ConfigError

V = 64  # vocabulary: <unk>, <eos>, w2 .. w63
EOS = 1


def save_tiny(path, seed: int, vocab: int = V, noise_from=None, noise: float = 0.0):
    """A random Llama checkpoint with a word-level tokenizer as a Hugging Face directory. With
    noise_from, the weights are noise_from's plus Gaussian noise (a draft close to a target)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    from qserve.config import ModelArchConfig
    from qserve.loader.hf_loader import expected_shapes

    path.mkdir()
    cfg = dict(model_type="llama", vocab_size=vocab, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
               eos_token_id=EOS)
    (path / "config.json").write_text(json.dumps(cfg))
    arch = ModelArchConfig("llama", vocab, 64, 128, 2, 4, 2, 16, tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(arch).items():
        if len(shape) == 1:
            w = torch.ones(shape)
        else:  # scale 0.3 keeps next-token distributions peaked but not one-hot
            w = torch.randn(shape, generator=gen) * (0.3 if "embed" not in name else 1.0)
        if noise_from is not None:
            w = noise_from[name] + noise * torch.randn(shape, generator=gen) * (len(shape) > 1)
        weights[name] = w.contiguous()
    save_file(weights, str(path / "model.safetensors"))
    words = {"<unk>": 0, "<eos>": EOS} | {f"w{i}": i for i in range(2, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return weights


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Matrices this small gain nothing from a second thread, and on a shared CPU the threads'
    synchronisation makes every step tens of times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target = save_tiny(root / "target", seed=0)
    save_tiny(root / "close", seed=1, noise_from=target, noise=0.02)  # accepts about 40%
    save_tiny(root / "far", seed=2)  # an unrelated model: accepts few
    save_tiny(root / "other-vocab", seed=3, vocab=V + 16)
    return root


OPTS = dict(kv_cache_memory="2MiB", max_model_len=256, block_size=4, device="cpu")


def llm(models, **kw):
    return LLM(str(models / "target"), **(OPTS | kw))


def prompts(n: int, length: int = 12, seed: int = 0) -> list[list[int]]:
    """Random prompts; every other one repeats a phrase, so n-gram lookup finds matches."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(2, V) for _ in range(length)]
        out.append(p + p[:length // 2] if i % 2 else p)
    return out


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(models):
    """The target alone, greedy, on the batch every draft kind is checked against."""
    return [o.outputs[0].token_ids for o in llm(models).generate(prompts(6), GREEDY)]


@pytest.mark.parametrize("draft", ["close", "far", "self:w4g64", "self:w8", "ngram"])
def test_greedy_output_equals_the_target_alone(models, reference, draft):
    spec = llm(models, draft=draft if ":" in draft or draft == "ngram" else str(models / draft),
               num_speculative_tokens=3, spec_max_batch_size=8)
    outs = spec.generate(prompts(6), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    accepted = [o.outputs[0].spec_accepted_tokens for o in outs]
    assert sum(o.outputs[0].spec_draft_tokens for o in outs) > 0
    if draft == "close":  # batched sequences that accept different numbers of tokens
        assert len(set(accepted)) > 1 and max(accepted) > 0
    stats = spec.engine.stats()
    assert stats["spec_draft_tokens"] >= stats["spec_accepted_tokens"]
    bm = spec.engine.block_manager
    bm.check_invariants([])  # every block came back
    assert bm.num_free_blocks == bm.num_blocks


def test_rejection_sampler_follows_the_target_distribution():
    """Chi-square of the first two emitted tokens against p over 10,000 trials."""
    gen = torch.Generator().manual_seed(0)
    K, W, trials = 3, 8, 10_000
    p = torch.softmax(torch.randn(K + 1, W, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(K, W, generator=gen) * 1.5, dim=-1)
    counts = torch.zeros(2, W)
    drafts = torch.stack([torch.multinomial(q[i], trials, replacement=True, generator=gen)
                          for i in range(K)], dim=1).tolist()  # (trials, K), row t ~ q
    for t in range(trials):
        tokens = rejection_sample(drafts[t], q, p, gen)
        counts[0, tokens[0]] += 1
        if len(tokens) > 1:
            counts[1, tokens[1]] += 1
    for pos in range(2):
        assert chi_square(counts[pos], p[pos]) < chi_square_critical(W - 1), pos


def chi_square(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic; bins expected to hold fewer than 5 are pooled into one."""
    expected = probs * observed.sum()
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum(0, keepdim=True)])
    exp = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())


def chi_square_critical(df: int) -> float:
    """The 0.999 quantile of chi-square(df) by the Wilson-Hilferty approximation (within 1%
    for df >= 3): a correct sampler fails this test once in a thousand seeds; this seed is
    fixed, and a biased sampler (e.g. one that skips the residual) exceeds it many times over."""
    z = 3.0902  # the standard normal's 0.999 quantile
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_engine_samples_follow_the_target_distribution(models):
    """End to end on the tiny model: a one-token prompt, so the first output token already
    comes out of verification against the unrelated draft's samples (temperature 1)."""
    target = llm(models)
    captured = []
    run = target.engine.runner.run
    target.engine.runner.run = lambda out: captured.append(run(out)) or captured[-1]
    target.generate([[5]], SamplingParams(temperature=1.0, max_tokens=1))
    p = torch.softmax(captured[0][0], dim=-1)  # the target's next-token distribution

    spec = llm(models, draft=str(models / "far"), num_speculative_tokens=3,
               spec_max_batch_size=256, spec_min_acceptance=0.0)
    n = 2000
    outs = spec.generate([[5]] * n, SamplingParams(temperature=1.0, max_tokens=4,
                                                  ignore_eos=True))
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[0] for o in outs]),
                            minlength=V).float()
    stats = spec.engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]  # both paths taken
    df = int((p * n >= 5).sum())  # bins kept by chi_square, + the pooled one, - 1
    assert chi_square(counts, p) < chi_square_critical(df)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_rollback_and_preemption_leak_no_blocks(models, mode):
    """A pool too small for the batch: sequences speculate, are preempted and resume; every
    step the block tables account for every reference, and all blocks come back."""
    spec = llm(models, draft=str(models / "close"), num_speculative_tokens=4,
               kv_cache_memory="64KiB", max_model_len=64, preemption_mode=mode,
               swap_space="1MiB", spec_max_batch_size=8)
    eng = spec.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    batch = prompts(6, length=10, seed=1)
    for i, p in enumerate(batch):
        eng.add_request(str(i), None, params, prompt_token_ids=p)
    draft_bm = eng.speculator.proposer.block_manager
    while eng.has_unfinished_requests():
        eng.step()
        live = [s for r in eng.requests.values() for s in r.seqs if not s.is_finished]
        eng.block_manager.check_invariants(live)
        draft_bm.check_invariants(list(eng.speculator.proposer.drafts.values()))
    assert eng.stats()["preemptions"] > 0 and eng.stats()["spec_accepted_tokens"] > 0
    eng.block_manager.check_invariants([])
    eng.speculator.propose([])  # releases the draft state of the finished sequences
    draft_bm.check_invariants([])
    ref = llm(models, max_model_len=64).generate(batch, params)
    again = spec.generate(batch, params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ref]


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quantized_kv_and_prefix_sharing(models, kv_dtype):
    """Two requests sharing a prompt prefix, quantized KV: same greedy output with and
    without speculation."""
    shared = prompts(1, length=16, seed=3)[0]
    batch = [shared + [7, 8, 9], shared + [10, 11]]
    base = llm(models, kv_dtype=kv_dtype).generate(batch, GREEDY)
    spec = llm(models, kv_dtype=kv_dtype, draft="ngram", num_speculative_tokens=4)
    spec.generate(batch[:1], GREEDY)  # warms the prefix cache
    outs = spec.generate(batch, GREEDY)
    assert spec.engine.block_manager.prefix_hits > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]


def test_eos_and_stop_string_inside_an_accepted_run(models):
    """Output stops exactly where the target alone stops: at EOS, at a stop token id and at a
    stop string, each falling inside a run of accepted drafts."""
    base = llm(models)
    spec = llm(models, draft=str(models / "close"), num_speculative_tokens=4)
    prompt = prompts(1, seed=5)[0]
    free = base.generate([prompt], GREEDY)[0].outputs[0].token_ids
    stop_tok = free[10]
    first = free.index(stop_tok)
    word = f"w{free[6]}"
    for params in (SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok]),
                   SamplingParams(temperature=0, max_tokens=24, stop=[word]),
                   SamplingParams(temperature=0, max_tokens=24, stop=[word],
                                  include_stop_str_in_output=True)):
        a = base.generate([prompt], params)[0].outputs[0]
        b = spec.generate([prompt], params)[0].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert b.spec_accepted_tokens > 0
    assert base.generate([prompt], SamplingParams(
        temperature=0, max_tokens=24, stop_token_ids=[stop_tok]))[0].outputs[0].token_ids == \
        free[:first + 1]
    # EOS: make the draft's favourite token the target's EOS by giving it that id
    eos_at = free[8]
    spec.engine.eos_token_ids.add(eos_at)
    base.engine.eos_token_ids.add(eos_at)
    a = base.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    b = spec.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert b.token_ids == a.token_ids == free[:free.index(eos_at) + 1]
    assert b.finish_reason == "stop"


def test_batch_expansion_matches_the_multi_token_path(models):
    """run_speculative computes a verification step as one-token rows; its logits equal the
    ordinary multi-token forward's at the same positions."""
    eng = llm(models).engine
    batch = prompts(2, seed=7)
    for i, p in enumerate(batch):
        eng.add_request(str(i), None, SamplingParams(temperature=0, max_tokens=8),
                        prompt_token_ids=p)
    eng.step()  # prompts in, first tokens out
    a, b = eng.scheduler.running
    a.add_spec_tokens([3, 4, 5])
    out = eng.scheduler.schedule()
    expanded = eng.runner.run_speculative(out)  # (4 + 1, V)
    full = eng.runner.run_all_positions(out)  # (5, V): a's 4 positions, then b's 1
    # fp32 both ways; only the summation order differs (decode vs prefill attention)
    torch.testing.assert_close(expanded, full, atol=1e-4, rtol=1e-4)
    eng.scheduler.postprocess(out)
    for rid in ("0", "1"):
        eng.abort(rid)


def test_vocabulary_mismatch_and_bad_self_recipes_are_refused(models):
    with pytest.raises(ConfigError, match="vocabulary of 80 tokens.*target's 64"):
        llm(models, draft=str(models / "other-vocab"))
    with pytest.raises(ConfigError, match="self:gguf-native imports GGUF blocks"):
        llm(models, draft="self:gguf-native")
    with pytest.raises(ConfigError, match="self:nope: unknown recipe"):
        llm(models, draft="self:nope")


def test_config_errors():
    with pytest.raises(ConfigError, match="needs a draft"):
        engine_config(None, num_speculative_tokens=3)
    with pytest.raises(ConfigError, match="num-speculative-tokens=0"):
        engine_config(None, draft="ngram", num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="self:w4g64"):
        engine_config(None, draft="self:")
    assert engine_config(None, draft="ngram").speculative.kind == "ngram"


def test_ngram_lookup():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 3, 1) == [7, 1]  # latest match
    assert ngram_lookup([5, 6, 7, 5], 3, 3, 1) == [6, 7, 5]  # falls back to n = 1
    assert ngram_lookup([1, 2, 3], 2, 3, 1) == []
    assert ngram_lookup([4, 4, 4], 4, 2, 1) == [4]  # the continuation ends at the sequence end


def test_acceptance_reaches_metrics_json_and_chat_stats(models):
    """One run with a draft, then the three places that report acceptance."""
    from qserve.chat import _format_stats, _reply_stats
    from qserve.cli import _completion_record
    from qserve.server.metrics import Metrics

    spec = llm(models, draft=str(models / "close"), num_speculative_tokens=3)
    [out] = spec.generate(prompts(1, seed=2), GREEDY)
    c = out.outputs[0]
    assert c.spec_draft_tokens > 0 and 0 < c.spec_acceptance_rate <= 1
    record = _completion_record(0, out, c, speculative=True)
    assert record["spec_accepted_tokens"] == c.spec_accepted_tokens
    assert record["spec_mean_accepted_tokens"] == c.spec_accepted_tokens / c.spec_steps
    assert "spec_draft_tokens" not in _completion_record(0, out, c)

    class Snapshot:  # what AsyncEngine exposes: the engine's stats after its last step
        stats = spec.engine.stats()

    metrics = Metrics()
    metrics.watch(Snapshot)
    text = metrics.render().decode()
    assert f"qserve_spec_accepted_tokens_total {float(c.spec_accepted_tokens)}" in text
    assert "qserve_spec_acceptance_rate " in text
    assert "% of" in _format_stats(_reply_stats(out, 3, Snapshot.stats))


@pytest.mark.slow
def test_default_model_greedy_output_is_unchanged(loaded_model):
    """The real default model, chat template, a reply that repeats its input: n-gram lookup
    and a self-draft accept most drafts and leave the greedy text exactly as it was."""
    messages = [[{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over "
                                             "the lazy dog, and the dog sleeps on."}],
                [{"role": "user", "content": "Name three colours."}]]
    params = SamplingParams(temperature=0, max_tokens=24)
    opts = dict(loaded=loaded_model, kv_cache_memory="64MiB", max_model_len=512)
    ref = [o.outputs[0].token_ids for o in LLM(None, **opts).chat(messages, params)]
    for draft in ("ngram", "self:w8"):
        outs = LLM(None, draft=draft, spec_max_batch_size=2, **opts).chat(messages, params)
        assert [o.outputs[0].token_ids for o in outs] == ref, draft
        assert outs[0].outputs[0].spec_acceptance_rate > 0.5, draft


def test_a_shorter_draft_caps_the_context_no_flag_named(models, tmp_path):
    """No --max-model-len: the run gets the shorter of the target's and the draft's contexts
    (each 256 here, the draft cut to 128); a --max-model-len the draft cannot hold is refused."""
    short = tmp_path / "short"
    shutil.copytree(models / "close", short)
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": 128}))
    opts = {k: v for k, v in OPTS.items() if k != "max_model_len"}
    spec = LLM(str(models / "target"), draft=str(short), num_speculative_tokens=3, **opts)
    assert spec.engine.max_model_len == 128
    assert len(spec.generate(prompts(2), GREEDY)) == 2
    with pytest.raises(ConfigError, match="handles 128"):
        llm(models, draft=str(short), num_speculative_tokens=3)
