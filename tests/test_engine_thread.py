"""The server's engine runs on one thread from load to shutdown (EngineThread): libgomp keeps
a worker pool per thread that starts parallel regions, and two pools on a small machine make
every barrier of a decode step sleep and wake (qserve/server/async_engine.py, EngineThread)."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from qserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from qserve.sampling_params import SamplingParams
from qserve.server.async_engine import AsyncEngine, EngineThread


class ThreadRecordingEngine:
    """One token per step per request; records the threads that built and stepped it."""

    def __init__(self, tokenizer=None):
        self.built_on = threading.get_ident()
        self.stepped_on: set[int] = set()
        self.tokenizer = tokenizer
        self.max_model_len = 64
        self.detokenize = True
        self.requests: dict[str, list[int]] = {}

    def stats(self) -> dict:
        return {"running": len(self.requests)}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, rid, prompt, params, prompt_token_ids):
        self.requests[rid] = []

    def abort(self, rid):
        self.requests.pop(rid, None)

    def step(self) -> list[RequestOutput]:
        self.stepped_on.add(threading.get_ident())
        outputs = []
        for rid, generated in list(self.requests.items()):
            generated.append(7)
            done = len(generated) >= 3
            outputs.append(RequestOutput(rid, None, [1], [CompletionOutput(
                0, "", list(generated), "length" if done else None)], done,
                RequestMetrics(0.0, first_token_time=0.0)))
            if done:
                del self.requests[rid]
        return outputs


def test_engine_thread_runs_calls_in_order_and_raises_their_errors():
    thread = EngineThread()
    assert thread.call(threading.get_ident) == thread.ident != threading.get_ident()
    with pytest.raises(ValueError, match="bad model"):
        thread.call(lambda: (_ for _ in ()).throw(ValueError("bad model")))
    order = []
    futures = [thread.submit(lambda i=i: order.append(i)) for i in range(5)]
    for f in futures:
        f.result()
    assert order == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("loaded_there", [True, False])
def test_the_engine_is_stepped_on_the_thread_that_loaded_it(loaded_there, monkeypatch):
    from qserve.server import async_engine

    monkeypatch.setattr(async_engine, "OutputProcessor", _PassThrough)
    thread = EngineThread() if loaded_there else None
    engine = thread.call(ThreadRecordingEngine) if loaded_there else ThreadRecordingEngine()
    server = AsyncEngine(engine, thread=thread)

    async def run():
        server.start()
        queue: asyncio.Queue = asyncio.Queue()
        await server.submit("r", [1], SamplingParams(max_tokens=3), queue)
        while not (await queue.get()).finished:
            pass
        assert server.alive
        server.shutdown()
    asyncio.run(run())
    assert not server.alive
    if loaded_there:
        assert engine.stepped_on == {engine.built_on} == {thread.ident}
    else:  # a built engine: a new EngineThread steps it
        assert len(engine.stepped_on) == 1 and engine.built_on not in engine.stepped_on


class _PassThrough:
    """OutputProcessor without a tokenizer: outputs pass as they are."""

    def __init__(self, tokenizer):
        self.requests = {}

    def add(self, rid, ids, params):
        self.requests[rid] = SimpleNamespace(params=params)

    def drop(self, rid):
        self.requests.pop(rid, None)

    def process(self, out):
        return out, []
