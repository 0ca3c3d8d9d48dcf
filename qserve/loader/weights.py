"""LazyWeights: a model's weights by Hugging Face name, each read from its file only when
looked up and never kept, so a loader's peak memory is the model being built plus one tensor
(the streaming load), and `qserve quantize` holds its output plus one layer. Freed heap goes
back to the OS before each whole tensor's read (trim_heap), or the temporaries of every tensor
before it would stay resident until the load ends. Row slices need no trims: each is read into
its reader's one buffer and laid out in place (QuantLinear.laid_out), freeing nothing."""
from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from qserve.errors import ModelLoadError
from qserve.heap import trim_heap


def rows_from_file() -> bool:
    """Whether a lookup table may be left in its file (LazyWeights.file_rows): unless
    QSERVE_EMBEDDING_IN_FILE=0."""
    return os.environ.get("QSERVE_EMBEDDING_IN_FILE", "1") != "0"


class FileRows:
    """A 2-D tensor whose rows are read from its file when asked (os.preadv), never held whole:
    an untied token embedding, of which a step looks up a few rows (Llama-3.1-8B's: 282 MiB
    as Q4_K, 1 GiB as F16). The rows go to memory of the caller's, not a mapping of the file,
    so a file changed under a running model cannot crash it (read_tensor's rule); one cut short
    fails the read with a one-line error. The page cache keeps the rows read often, which
    resident memory does not count.

    decode: (n, row_bytes) uint8 rows -> what the weights mapping holds for those rows (a
    QuantizedTensor, or a dense tensor)."""

    def __init__(self, path: Path | str, name: str, offset: int, num_rows: int, row_bytes: int,
                 in_features: int, decode: Callable[[torch.Tensor], object]):
        self.path, self.name, self.offset = Path(path), name, offset
        self.num_rows, self.row_bytes, self.in_features = num_rows, row_bytes, in_features
        self._decode = decode
        self._fd: int | None = None

    def rows(self, ids: list[int]) -> object:
        """Rows `ids` (each in range), decoded, in that order."""
        buf = torch.empty(len(ids), self.row_bytes, dtype=torch.uint8)
        view = memoryview(buf.numpy()).cast("B")
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except OSError as e:
                raise ModelLoadError(f"{self.path}: cannot be read again for tensor {self.name} "
                                     f"({e.strerror})") from None
        rb = self.row_bytes
        for k, i in enumerate(ids):
            if os.preadv(self._fd, [view[k * rb:(k + 1) * rb]], self.offset + i * rb) != rb:
                raise ModelLoadError(f"{self.path}: tensor {self.name} row {i} could not be "
                                     f"read (the file changed under the running model)")
        return self._decode(buf)

    def __del__(self):
        if self._fd is not None:
            os.close(self._fd)


class LazyWeights(Mapping):
    def __init__(self, shapes: dict[str, tuple[int, ...]], read: Callable[[str], object],
                 row_reader: Callable[[str], Callable[[int, int], object] | None] | None = None,
                 file_rows: Callable[[str], FileRows | None] | None = None):
        self.shapes = shapes  # name -> shape, known from the file's header
        self._read = read
        self._row_reader = row_reader
        self._file_rows = file_rows

    def file_rows(self, name: str) -> FileRows | None:
        """A 2-D tensor read a few rows at a time from its file for as long as the model runs
        (FileRows): what a lookup table needs; None where the source cannot (a tensor stored
        other than as its rows in order, sources without it) or rows_from_file() says no."""
        if self._file_rows is None or name not in self.shapes or not rows_from_file():
            return None
        return self._file_rows(name)

    def row_reader(self, name: str) -> Callable[[int, int], object] | None:
        """For a packed matrix the source can read a slice of output rows at a time: a
        function (r0, r1) -> those rows, a QuantizedTensor as weights[name] would hold them,
        valid until its next call (a GGUF's reader reads every slice into one buffer). A model
        lays a large matrix out for its device (QuantLinear.laid_out) slice by slice, so the
        file's copy of it is never whole beside the laid-out one (Llama-3-8B's Q6_K output
        matrix: 411 MiB). None where it cannot (dense or permuted tensors, sources without
        it)."""
        if self._row_reader is None or name not in self.shapes:
            return None
        return self._row_reader(name)

    def __getitem__(self, name: str):
        if name not in self.shapes:
            raise KeyError(name)
        trim_heap()  # earlier tensors' temporaries (file copies, re-layouts)
        return self._read(name)

    def __contains__(self, name) -> bool:  # Mapping's default would read the tensor to answer
        return name in self.shapes

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


@dataclass(frozen=True)
class Stored:
    """Where a tensor the model reads lies in a safetensors checkpoint: the stored tensors it
    is read from, (file, stored name) each, and take(their slices) -> it; take None: it is
    the first, whole. A family's stored_tensors (models/base.py) says when one stored tensor
    holds several of the model's (stacked experts: only a slice is read) or one of the model's
    takes several (MXFP4 blocks and their scales)."""

    sources: tuple[tuple[Path, str], ...]
    take: Callable | None = None

    @property
    def file(self) -> Path:
        return self.sources[0][0]

    @property
    def name(self) -> str:
        return self.sources[0][1]


def read_safetensor(where: dict[str, Stored], key: str) -> torch.Tensor:
    """The tensor the model knows as `key`, read as `where` says (hf_loader.tensor_index)."""
    from safetensors import safe_open

    stored = where[key]
    try:
        if stored.take is None:
            with safe_open(str(stored.file), framework="pt") as f:
                return f.get_tensor(stored.name)
        with ExitStack() as stack:
            files = {file: stack.enter_context(safe_open(str(file), framework="pt"))
                     for file, _ in stored.sources}
            return stored.take(*(files[file].get_slice(name) for file, name in stored.sources))
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{stored.file}: tensor {stored.name} cannot be read "
                             f"({type(e).__name__}: {e})".splitlines()[0]) from None
