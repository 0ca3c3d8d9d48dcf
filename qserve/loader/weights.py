"""LazyWeights: a model's weights by Hugging Face name, each read from its file only when
looked up and never kept, so a loader's peak memory is the model being built plus one tensor
(the streaming load), and `qserve quantize` holds its output plus one layer."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Callable


class LazyWeights(Mapping):
    def __init__(self, shapes: dict[str, tuple[int, ...]], read: Callable[[str], object]):
        self.shapes = shapes  # name -> shape, known from the file's header
        self._read = read

    def __getitem__(self, name: str):
        if name not in self.shapes:
            raise KeyError(name)
        return self._read(name)

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)
