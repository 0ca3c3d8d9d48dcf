"""OutputProcessor: the engine in token-only mode plus the processor gives exactly what the
engine gives when it detokenizes inline: text, deltas, token ids, logprobs, finish and stop
reasons, for stop strings, stop tokens, EOS, length and n > 1; and in each output_kind a caller
can ask of it (the engine reporting deltas)."""
import dataclasses


import pytest

from qserve import LLM, SamplingParams
from qserve.engine.output_processor import OutputProcessor, engine_params

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three primary colors:"]


@pytest.fixture(scope="module")
def llm(loaded_model):
    return LLM(loaded=loaded_model, kv_cache_memory="64MiB", max_model_len=512)


def run(engine, prompts, params, processor=None):
    """Step to completion. Returns {request id: [outputs]} and, with a processor, the number of
    outputs the engine produced for requests the processor had already finished."""
    for i, p in enumerate(prompts):
        ids = engine.tokenizer.encode(p)
        engine.add_request(f"r{i}", None, params if processor is None else engine_params(params),
                           prompt_token_ids=ids)
        if processor is not None:
            processor.add(f"r{i}", ids, params)
    seen: dict[str, list] = {}
    late = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if processor is not None:
                out, stopped = processor.process(out)
                if out is None:
                    late += 1
                    continue
                for index in stopped:
                    engine.finish_sample(out.request_id, index)
            seen.setdefault(out.request_id, []).append(out)
    return seen, late


def summary(outs):
    return [[(c.index, c.text, c.delta_text, c.token_ids, c.finish_reason, c.stop_reason,
              c.logprobs) for c in o.outputs] + [o.finished] for o in outs]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40, stop=[" the", "\n"]),
    SamplingParams(temperature=0, max_tokens=40, stop=["e"], include_stop_str_in_output=True,
                   logprobs=2),
    SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=24, stop=[" a"]),
    SamplingParams(temperature=0, max_tokens=300),  # EOS or length
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
], ids=["stop", "include-stop-logprobs", "n2-sampled", "eos", "length"])
def test_token_only_engine_plus_processor_equals_inline(llm, params):
    engine = llm.engine
    inline, _ = run(engine, PROMPTS, params)
    engine.detokenize = False
    try:
        processed, _ = run(engine, PROMPTS, params, OutputProcessor(engine.tokenizer))
    finally:
        engine.detokenize = True
    assert set(inline) == set(processed)
    for rid in inline:
        want, got = summary(inline[rid]), summary(processed[rid])
        # a stop string is seen one output later at most: the processor's last output may be
        # the engine's next one, so compare the streams joined and the final outputs
        assert "".join(d for o in want for c in o[:-1] for d in [c[2]]) == \
               "".join(d for o in got for c in o[:-1] for d in [c[2]])
        assert want[-1] == got[-1]
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40, stop=[" the", "\n"], logprobs=1),
    SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=24, stop=[" a"]),
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
], ids=["stop-logprobs", "n2-sampled", "length"])
def test_delta_and_final_only_callers(llm, params):
    """A caller asking output_kind "delta" gets outputs that join to the inline engine's final
    output (ids, logprobs, text); one asking "final_only" gets that final output alone."""
    engine = llm.engine
    inline, _ = run(engine, PROMPTS, params)
    engine.detokenize = False
    try:
        deltas, _ = run(engine, PROMPTS, dataclasses.replace(params, output_kind="delta"),
                        OutputProcessor(engine.tokenizer))
        finals, _ = run(engine, PROMPTS, dataclasses.replace(params, output_kind="final_only"),
                        OutputProcessor(engine.tokenizer))
    finally:
        engine.detokenize = True
    for rid, outs in inline.items():
        want = summary(outs[-1:])[0]
        joined: dict[int, list] = {}
        for o in deltas[rid]:
            for c in o.outputs:
                j = joined.setdefault(c.index, [c.index, "", "", [], None, None, None])
                assert c.text == c.delta_text and c.num_tokens == len(j[3]) + len(c.token_ids)
                j[1] += c.text
                j[2] = j[1]
                j[3] = j[3] + c.token_ids
                j[4:6] = [c.finish_reason, c.stop_reason]
                if c.logprobs is not None:
                    j[6] = (j[6] or []) + c.logprobs
        got = [tuple(joined[i]) for i in sorted(joined)] + [deltas[rid][-1].finished]
        # the inline final's delta_text is its last step's; a joined stream's is all of it
        assert [w[:2] + w[3:] for w in want[:-1]] == [g[:2] + g[3:] for g in got[:-1]]
        assert want[-1] == got[-1] is True
        assert len(finals[rid]) == 1
        [final] = summary(finals[rid])
        assert [w[:2] + w[3:] for w in want[:-1]] == [f[:2] + f[3:] for f in final[:-1]]
        assert all(f[1] == f[2] for f in final[:-1])  # final_only: delta_text is all the text
    assert not engine.has_unfinished_requests()


def test_histories_are_each_live_samples_whole_output(llm):
    """histories(out), asked before out is processed (the grammar prefetch), gives each sample
    still running here its whole output so far, the engine reporting only deltas."""
    engine = llm.engine
    params = SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=20, stop=[" a"])
    processor = OutputProcessor(engine.tokenizer)
    ids = engine.tokenizer.encode(PROMPTS[0])
    engine.detokenize = False
    try:
        engine.add_request("h", None, engine_params(params), prompt_token_ids=ids)
        processor.add("h", ids, params)
        so_far: dict[int, list[int]] = {}
        stopped: set[int] = set()
        checked = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                for c in out.outputs:
                    so_far[c.index] = so_far.get(c.index, []) + c.token_ids
                want = [so_far[c.index] for c in out.outputs
                        if c.finish_reason is None and c.index not in stopped]
                assert processor.histories(out) == want
                checked += len(want)
                _, now_stopped = processor.process(out)
                stopped.update(now_stopped)
                for index in now_stopped:
                    engine.finish_sample("h", index)
    finally:
        engine.detokenize = True
    assert checked >= 2 * 5  # several steps of both samples were checked
