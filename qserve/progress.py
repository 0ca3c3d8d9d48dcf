"""What a person at a terminal sees while long work runs: a bar with a total and an ETA
(tqdm), or a spinner for work with no count, both on stderr and only when stderr is a
terminal, so pipes, logs and --json output never carry them. QSERVE_NO_PROGRESS=1 turns them
off on a terminal too, and so does `with off():` (a command's --json) for the work inside it.

A bar opened while a spinner runs (a KV codebook calibrated, or a self-draft quantized, while
a model loads) joins the spinner's line as `· what 12/60, ETA 4s` rather than draw a second
line that the spinner's redraws would overwrite.

Shared by every layer (like config and errors): it imports the standard library and tqdm only.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import time

_off = 0  # how many `off()` blocks are open
_spinners: list[_Line] = []  # the spinners drawing now, innermost last


def enabled(stream=None) -> bool:
    """Whether progress may be drawn on `stream` (default stderr)."""
    stream = stream or sys.stderr
    if _off or os.environ.get("QSERVE_NO_PROGRESS", "") not in ("", "0"):
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-less stream
        return False


@contextlib.contextmanager
def off(when: bool = True):
    """`with off(as_json):` draws no progress inside the block when `when` is true."""
    global _off
    _off += bool(when)
    try:
        yield
    finally:
        _off -= bool(when)


def bar(total: int | None, desc: str, unit: str = "it", disable: bool = False,
        iterable=None, **tqdm_options):
    """A tqdm bar on stderr with `total` steps (its ETA comes from the rate so far), over
    `iterable` when given; a no-op bar when progress is off or `disable`; inside a running
    spinner, a count on the spinner's line. Close it (or use it as a context manager, or
    iterate it to the end). `total` may be set later (`b.total = n`)."""
    disable = disable or not enabled()
    if _spinners and not disable:
        return _SpinnerSteps(_spinners[-1], total, desc, iterable)
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
                dynamic_ncols=True, disable=disable, **tqdm_options)


class _Line:
    """A spinner's text, and what a bar inside it adds."""

    def __init__(self, text: str):
        self.text, self.detail = text, ""


class _SpinnerSteps:
    """The part of tqdm's interface that callers use, drawn as `· desc n/total (postfix), ETA
    4s` on the innermost spinner's line; the ETA is the time left at the rate so far."""

    def __init__(self, line: _Line, total: int | None, desc: str, iterable=None):
        self.line, self.total, self.desc, self.iterable = line, total, desc, iterable
        self.n, self.postfix, self.start = 0, "", time.monotonic()
        self._show()

    def update(self, n: int = 1) -> None:
        self.n += n
        self._show()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s
        self._show()

    def close(self) -> None:
        self.line.detail = ""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self):
        try:
            for item in self.iterable:
                yield item
                self.update()
        finally:
            self.close()

    def _show(self) -> None:
        count = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        eta = ""
        if self.total and 0 < self.n < self.total:
            left = (time.monotonic() - self.start) * (self.total - self.n) / self.n
            eta = f", ETA {left:.0f}s"
        label = f" ({self.postfix})" if self.postfix else ""
        self.line.detail = f" · {self.desc} {count}{label}{eta}"


@contextlib.contextmanager
def spinner(text: str, disable: bool = False):
    """`with spinner("loading model"):` draws `⠋ loading model  2.1s` on stderr, redrawn every
    0.1 s from a background thread, and erases it when the block ends."""
    if disable or not enabled():
        yield
        return
    stop = threading.Event()
    start = time.monotonic()
    line = _Line(text)

    def draw() -> None:
        for frame in itertools.cycle("⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"):
            sys.stderr.write(f"\r{frame} {line.text}{line.detail}  "
                             f"{time.monotonic() - start:.1f}s\x1b[K")
            sys.stderr.flush()
            if stop.wait(0.1):
                break
        sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()

    thread = threading.Thread(target=draw, name="qserve-spinner", daemon=True)
    _spinners.append(line)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        _spinners.remove(line)
