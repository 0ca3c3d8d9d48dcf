"""LazyWeights: a model's weights by Hugging Face name, each read from its file only when
looked up and never kept, so a loader's peak memory is the model being built plus one tensor
(the streaming load), and `qserve quantize` holds its output plus one layer. Freed heap goes
back to the OS before each whole tensor's read (trim_heap), or the temporaries of every tensor
before it would stay resident until the load ends. Row slices need no trims: each is read into
its reader's one buffer and laid out in place (QuantLinear.laid_out), freeing nothing."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

from qserve.heap import trim_heap


class LazyWeights(Mapping):
    def __init__(self, shapes: dict[str, tuple[int, ...]], read: Callable[[str], object],
                 row_reader: Callable[[str], Callable[[int, int], object] | None] | None = None):
        self.shapes = shapes  # name -> shape, known from the file's header
        self._read = read
        self._row_reader = row_reader

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
