"""What a person at a terminal sees while long work runs: a bar with a total and an ETA
(tqdm), or a spinner for work with no count, both on stderr and only when stderr is a
terminal, so pipes, logs and --json output never carry them. QSERVE_NO_PROGRESS=1 turns them
off on a terminal too.

Shared by every layer (like config and errors): it imports the standard library and tqdm only.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import time


def enabled(stream=None) -> bool:
    """Whether progress may be drawn on `stream` (default stderr)."""
    stream = stream or sys.stderr
    if os.environ.get("QSERVE_NO_PROGRESS", "") not in ("", "0"):
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-less stream
        return False


def bar(total: int | None, desc: str, unit: str = "it", disable: bool = False,
        iterable=None, **tqdm_options):
    """A tqdm bar on stderr with `total` steps (its ETA comes from the rate so far), over
    `iterable` when given; a no-op bar when progress is off or `disable`. Close it (or use
    it as a context manager, or iterate it to the end)."""
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
                dynamic_ncols=True, disable=disable or not enabled(), **tqdm_options)


@contextlib.contextmanager
def spinner(text: str, disable: bool = False):
    """`with spinner("loading model"):` draws `⠋ loading model  2.1s` on stderr, redrawn every
    0.1 s from a background thread, and erases it when the block ends."""
    if disable or not enabled():
        yield
        return
    stop = threading.Event()
    start = time.monotonic()

    def draw() -> None:
        for frame in itertools.cycle("⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"):
            sys.stderr.write(f"\r{frame} {text}  {time.monotonic() - start:.1f}s\x1b[K")
            sys.stderr.flush()
            if stop.wait(0.1):
                break
        sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()

    thread = threading.Thread(target=draw, name="qserve-spinner", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
