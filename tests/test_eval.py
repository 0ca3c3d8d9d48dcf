"""Quality evaluation through the engine: all-position log-probs match one plain forward pass,
perplexity / KL / top-1 are what they should be against itself and under quantized KV, the
output is deterministic, and `qserve eval` works end to end."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qserve.eval import (default_text, eval_engine, evaluate, evaluate_all, score,
                         tokenize_for_eval, windows)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TOKENS, CONTEXT = 112, 48  # 3 windows: 48 + 48 + 16


@pytest.fixture(scope="module")
def ref(loaded_model):
    return eval_engine(None, CONTEXT, loaded=loaded_model)


@pytest.fixture(scope="module")
def ids(ref):
    return tokenize_for_eval(ref, default_text(), TOKENS)


def test_windows_do_not_overlap():
    assert windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a 1-token tail: no target


def test_score_matches_generation_logits_and_frees_blocks(loaded_model, ref, ids):
    """Chunked through the scheduler (7-token steps) or not, each row is the log-softmax of the
    logits generation would sample from at that position."""
    from qserve import LLM, SamplingParams

    chunky = eval_engine(None, CONTEXT, loaded=loaded_model, max_num_batched_tokens=7)
    w = ids[:CONTEXT]
    full, chunked = score(ref, w), score(chunky, w)
    assert full.shape == (CONTEXT, ref.arch.vocab_size)
    torch.testing.assert_close(chunked, full, atol=2e-4, rtol=0)  # fp32 chunked vs whole
    llm = LLM(loaded=loaded_model, kv_cache_memory="32MiB", max_model_len=256)
    for n in (1, 17, CONTEXT):
        [out] = llm.generate([w[:n]], SamplingParams(temperature=0, max_tokens=1, logprobs=1))
        [lp] = out.outputs[0].logprobs
        tok = out.outputs[0].token_ids[0]
        assert tok == int(full[n - 1].argmax())
        assert abs(lp[tok] - full[n - 1, tok].item()) < 1e-4
    for eng in (ref, chunky):
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        assert not eng.scheduler.has_unfinished()


def test_against_itself_and_with_quantized_kv(loaded_model, ref, ids):
    engines = [ref] + [eval_engine(None, CONTEXT, loaded=loaded_model, kv_dtype=kv)
                       for kv in ("int8", "int4")]
    same, int8, int4 = evaluate_all(engines, ids, CONTEXT, ref_engine=ref)
    assert same.num_tokens == TOKENS - 3 and same.num_windows == 3
    assert same.kl == pytest.approx(0, abs=1e-6) and same.top1 == 1
    assert same.ppl == same.ref_ppl and 1 < same.ppl < 100
    assert same.nll == pytest.approx(math.log(same.ppl))
    assert evaluate(ref, ids, CONTEXT) == evaluate_all([ref], ids, CONTEXT)[0]  # deterministic
    assert same.kv_dtype == "fp32" and same.dtype == "fp32"  # what ran, not "auto"
    for r, kv in ((int8, "int8"), (int4, "int4")):
        assert r.kv_dtype == kv and r.ref_ppl == same.ppl and r.kl > 0
    # int8 KV is close to lossless, int4 less so
    assert int8.kl < 0.01 and int8.top1 > 0.95 and abs(int8.ppl / same.ppl - 1) < 0.01
    assert int8.kl < int4.kl < 0.3


def qserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qserve", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=600)


def test_cli_eval_json_is_deterministic(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(default_text()[:4000], encoding="utf-8")
    args = ("eval", "--text", str(text), "--score-tokens", "96", "--context", "48",
            "--kv-dtype", "int4", "--json")
    runs = [qserve(*args) for _ in range(2)]
    for proc in runs:
        assert proc.returncode == 0, proc.stderr
    assert runs[0].stdout == runs[1].stdout
    result = json.loads(runs[0].stdout)
    assert result["kv_dtype"] == "int4" and result["num_tokens"] == 94
    assert result["dtype"] == "fp32"
    assert result["kl"] is None and result["ppl"] > 1


def test_cli_eval_reference_keeps_full_precision_kv(tmp_path):
    """--ref scores against the reference at its own compute dtype: K/V in fp32 on a CPU,
    where the model under test gets the fp16 K/V of --kv-dtype auto."""
    text = tmp_path / "t.txt"
    text.write_text(default_text()[:2000], encoding="utf-8")
    proc = qserve("eval", "--text", str(text), "--score-tokens", "48", "--context", "48",
                  "--ref", "smollm2-135m-instruct", "--json")
    assert proc.returncode == 0, proc.stderr
    model, ref = [line for line in proc.stderr.splitlines() if line.startswith("qserve: ")]
    assert " · KV fp16 " in model and ref.startswith("qserve: reference ")
    assert " · KV fp32 " in ref
    result = json.loads(proc.stdout)
    assert result["kv_dtype"] == "fp16" and 0 <= result["kl"] < 0.01


def test_cli_eval_max_tokens_is_not_the_scored_tokens():
    """--max-tokens means output tokens in every other command; eval names its limit
    --score-tokens and says so, before any model loads."""
    proc = qserve("eval", "--max-tokens", "96")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("error: eval generates no tokens, so it has no --max-tokens; to "
                           "score the text's first 96 tokens use --score-tokens 96\n")


def test_cli_eval_unreadable_text():
    proc = qserve("eval", "--text", "/no/such/file.txt")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --text")
