"""AsyncEngine: one thread steps the LLMEngine; HTTP handlers await their requests' outputs.

The engine is not thread-safe, so every call into it happens on the engine thread. Handlers
only enqueue commands; the thread applies them between steps. The engine runs token-only: an
output thread turns each step's token ids into text (OutputProcessor) and hands the outputs to
the event loop in one call:

    handler ── add / abort ──> commands ──(between steps)──> engine.step()
       ^                          ^ finish (stop string)             │ token ids
       │                          └──────────── output thread <──────┘
       └──── asyncio.Queue per HTTP request <── call_soon_threadsafe(outputs with text)

Prompts are tokenized by the handlers (in a thread pool) before they are added, outputs are
detokenized on the output thread, and the handlers turn them into JSON, so a step never waits
on any of it.

The engine thread (EngineThread) also loads the engine when the server builds it through
`EngineThread.call`: every parallel region then starts on that one thread (see EngineThread).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from qserve.engine.output_processor import OutputProcessor, engine_params
from qserve.engine.sampler import checks_after_sampling
from qserve.errors import QServeError
from qserve.outputs import RequestOutput
from qserve.pooling_params import PoolingParams
from qserve.sampling_params import SamplingParams

log = logging.getLogger("qserve.server")


class EngineStopped(RuntimeError):
    """The server is shutting down (or the engine thread died); the request was aborted."""


class EngineThread(threading.Thread):
    """The one thread that runs the model: it loads the engine (`call(factory)`), then steps
    it (AsyncEngine.start), running what it is given in order.

    Why one thread: libgomp, torch's OpenMP runtime, which the CPU kernels use too, keeps a
    pool of worker threads for each thread that starts parallel regions, and once its pools
    hold more threads than there are cores, a worker waiting at a barrier spins 100 times
    instead of GOMP_SPINCOUNT before it sleeps. A decode step is ~200 regions, so each then
    puts the workers to sleep and wakes them: a server that loaded its engine on the main
    thread and stepped it on another ran the default model's C decode step in 13.2 ms instead
    of 6.6 (2 cores; ~50 voluntary context switches per token instead of none).
    """

    def __init__(self):
        super().__init__(name="qserve-engine", daemon=True)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.start()

    def submit(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run fn() on this thread after what was submitted before; its future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, future))
        return future

    def call(self, fn: Callable[[], object]):
        """fn() run on this thread: its result, or its exception raised here."""
        return self.submit(fn).result()

    def run(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # the caller (call / result()) re-raises it
                future.set_exception(e)


class AsyncEngine:
    """Runs `engine.step()` on its own thread for as long as there is work.

    Args:
        engine: an LLMEngine; after `start()` only the engine thread touches it.
        on_finished: called on the output thread with every finished RequestOutput (metrics).
        on_aborted: called on the output thread for every request aborted before it finished
            (its client went away, or the engine step failed).
        thread: the EngineThread that loaded `engine`, which steps it too; None: a new one.
    """

    def __init__(self, engine, on_finished: Callable[[RequestOutput], None] | None = None,
                 on_aborted: Callable[[], None] | None = None,
                 thread: EngineThread | None = None):
        self.engine = engine
        engine.detokenize = False  # the output thread does it
        self.processor = OutputProcessor(engine.tokenizer)  # only the output thread touches it
        # engine thread -> output thread, in order: ("add", rid, ids, params), ("drop", rid),
        # ("outputs", [RequestOutput]), None to stop
        self._to_output: queue.SimpleQueue = queue.SimpleQueue()
        self._output_thread: threading.Thread | None = None
        self.tokenizer = engine.tokenizer  # handlers' tokenizing happens off the engine thread
        self.max_model_len: int = engine.max_model_len
        self.stats: dict = engine.stats()  # a snapshot, replaced after every step
        self._on_finished = on_finished
        self._on_aborted = on_aborted
        self._commands: collections.deque = collections.deque()  # appends are thread-safe
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._thread = thread
        self._running: concurrent.futures.Future | None = None  # the stepping loop
        self._ids = itertools.count()

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = EngineThread()
        self._running = self._thread.submit(self._run)
        self._running.add_done_callback(_report_crash)
        self._output_thread = threading.Thread(target=self._run_output, name="qserve-output",
                                               daemon=True)
        self._output_thread.start()

    # what the model is, set at load and read-only: handlers read these off the event loop
    @property
    def hidden_size(self) -> int:
        """The model's hidden size: an embedding's most dimensions."""
        return self.engine.arch.hidden_size

    @property
    def arch(self):
        return self.engine.arch

    @property
    def model_path(self):
        return Path(str(self.engine.model_path))

    @property
    def weight_summary(self) -> str | None:
        """The format most of the weights' bytes are in (Q4_K, INT4, F16, ...), or None."""
        plan = getattr(self.engine, "memory_plan", None)
        if plan is None or not plan.weight_formats:
            return None
        return max(plan.weight_formats.items(), key=lambda kv: kv[1]["bytes"])[0].upper()

    @property
    def alive(self) -> bool:
        return self._running is not None and not self._running.done()

    def shutdown(self) -> None:
        """Stop stepping, abort whatever is still running, and end its streams."""
        self._stopping = True
        self._wake.set()
        if self._running is not None:
            concurrent.futures.wait([self._running])
        if self._output_thread is not None:
            self._to_output.put(None)  # after everything the engine thread sent
            self._output_thread.join()
        for rid in list(self._queues):  # the threads are gone: the engine is ours now
            self.engine.abort(rid)
            self._deliver_error(rid, EngineStopped("the server is shutting down"))

    # ---- called from the event loop ----------------------------------------------------
    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def submit(self, request_id: str, prompt_token_ids: list[int],
               params: SamplingParams | PoolingParams, queue: asyncio.Queue) -> asyncio.Future:
        """Queue a request; its outputs go to `queue`. The returned future resolves when the
        engine has accepted it, or raises the QServeError it was refused with."""
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        if self._stopping:
            accepted.set_exception(EngineStopped("the server is shutting down"))
            return accepted
        self._commands.append(("add", request_id, prompt_token_ids, params, loop, queue, accepted))
        self._wake.set()
        return accepted

    def abort(self, request_id: str) -> None:
        self._commands.append(("abort", request_id))
        self._wake.set()

    # ---- the engine thread -------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._apply_commands()
            if self._stopping:
                return
            if not self.engine.has_unfinished_requests():
                self.stats = self.engine.stats()
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug, not bad input: fail what is running, keep serving
                log.exception("engine step failed; aborting the running requests")
                for rid in list(self._queues):
                    self.engine.abort(rid)
                    self._to_output.put(("drop", rid))
                    self._deliver_error(rid, e)
                continue
            self.stats = self.engine.stats()
            self._to_output.put(("outputs", outputs))

    def _apply_commands(self) -> None:
        applied = False
        while self._commands:
            cmd = self._commands.popleft()
            applied = True
            if cmd[0] == "abort":
                self.engine.abort(cmd[1])
                self._queues.pop(cmd[1], None)
                self._to_output.put(("drop", cmd[1]))
                continue
            if cmd[0] == "finish":  # the output thread saw a stop string
                self.engine.finish_sample(cmd[1], cmd[2])
                continue
            _, rid, ids, params, loop, queue, accepted = cmd
            try:
                self.engine.add_request(rid, None, engine_params(params), prompt_token_ids=ids)
            except Exception as e:  # QServeError: the handler answers 400 / 503
                if not isinstance(e, QServeError):
                    log.exception("add_request failed")
                loop.call_soon_threadsafe(_settle, accepted, e)
                continue
            self._queues[rid] = (loop, queue)
            self._to_output.put(("add", rid, ids, params))
            loop.call_soon_threadsafe(_settle, accepted, None)
        if applied:
            self.stats = self.engine.stats()

    # ---- the output thread -------------------------------------------------------------
    def _run_output(self) -> None:
        while (item := self._to_output.get()) is not None:
            kind = item[0]
            if kind == "add":
                self.processor.add(*item[1:])
            elif kind == "drop":
                # still known here: no finished output was processed, so it was cut short
                if item[1] in self.processor.requests and self._on_aborted is not None:
                    self._on_aborted()
                self.processor.drop(item[1])
            else:
                try:
                    self._deliver(item[1])
                except Exception:  # a bug: keep the server up; the requests' streams end
                    log.exception("processing engine outputs failed")
                    for out in item[1]:
                        self.abort(out.request_id)
                        self._deliver_error(out.request_id, EngineStopped("internal error"))

    def _prefetch_masks(self, raw: list[RequestOutput]) -> None:
        """Fill the grammar masks of the constrained samples' next tokens now, while the engine
        thread runs the forward pass that precedes them (GrammarConstraint.prefetch). Not for
        samples that ask their grammar only after sampling: they rarely need a mask, and a
        fill here takes CPU from that forward pass as soon as the cores are all busy."""
        groups: dict[int, tuple] = {}
        for out in raw:
            req = self.processor.requests.get(out.request_id)
            constraint = getattr(req.params, "constraint", None) if req is not None else None
            if (constraint is None or not hasattr(constraint, "prefetch")
                    or checks_after_sampling(req.params)):
                continue
            groups.setdefault(id(constraint), (constraint, []))[1].extend(
                self.processor.histories(out))
        for constraint, outputs in groups.values():
            if outputs:
                constraint.prefetch(outputs)

    def _deliver(self, raw: list[RequestOutput]) -> None:
        self._prefetch_masks(raw)
        outputs = []
        for out in raw:
            text_out, stopped = self.processor.process(out)
            if stopped:
                for index in stopped:
                    self._commands.append(("finish", out.request_id, index))
                self._wake.set()
            if text_out is not None:
                outputs.append(text_out)
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            target = self._queues.get(out.request_id)
            if out.finished:
                self._queues.pop(out.request_id, None)
                if self._on_finished is not None:
                    self._on_finished(out)
            if target is not None:
                batches.setdefault(target[0], []).append((target[1], out))
        for loop, batch in batches.items():  # one wake-up of the event loop per step
            loop.call_soon_threadsafe(_put_all, batch)

    def _deliver_error(self, rid: str, error: BaseException) -> None:
        target = self._queues.pop(rid, None)
        if target is not None:
            target[0].call_soon_threadsafe(_put_all, [(target[1], error)])


def _report_crash(running: concurrent.futures.Future) -> None:
    """The stepping loop ended by an exception (a bug): log it (handlers then see the engine
    dead and answer 503)."""
    error = running.exception()
    if error is not None:
        log.error("the engine thread stopped", exc_info=error)


def _settle(fut: asyncio.Future, error: BaseException | None) -> None:
    if fut.done():  # the handler went away while the add was queued
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def _put_all(batch: list) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


class Generation:
    """One HTTP request's prompts, each an engine request with `params.n` samples.

    `await start()` adds them all (raising the QServeError of the first refused, with the
    others aborted); iterating yields (prompt index, RequestOutput) until all have finished;
    `close()` aborts whatever has not finished (a client that went away) and is idempotent.
    """

    def __init__(self, engine: AsyncEngine, prefix: str, prompts: list[list[int]],
                 params: SamplingParams | PoolingParams):
        self.engine = engine
        self.prompts = prompts
        self.params = params
        self.request_ids = [engine.new_request_id(prefix) for _ in prompts]
        self._index = {rid: i for i, rid in enumerate(self.request_ids)}
        self._queue: asyncio.Queue = asyncio.Queue()
        self._unfinished = set(self.request_ids)

    async def start(self) -> None:
        futures = [self.engine.submit(rid, ids, self.params, self._queue)
                   for rid, ids in zip(self.request_ids, self.prompts)]
        try:
            results = await asyncio.gather(*futures, return_exceptions=True)
        except asyncio.CancelledError:
            self.close()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.close()
            raise errors[0]

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._unfinished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.close()
                raise item
            if item.finished:
                self._unfinished.discard(item.request_id)
            yield self._index[item.request_id], item

    async def final_outputs(self) -> list[RequestOutput]:
        """Run to completion; the finished output of each prompt, in order."""
        finals: list[RequestOutput | None] = [None] * len(self.prompts)
        try:
            async for i, out in self:
                if out.finished:
                    finals[i] = out
        finally:
            self.close()
        return finals  # type: ignore[return-value]

    def close(self) -> None:
        for rid in self._unfinished:
            self.engine.abort(rid)
        self._unfinished.clear()
